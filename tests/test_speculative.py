"""Speculative decoding (ngram): with drafts, every request's tokens and logprobs equal decoding
without them, for every sampling parameter and constraint, through preemption and prefix-cache
hits; drafts do get accepted; a custom processor without position support keeps its requests
undrafted; bad configs fail at startup naming the field."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from checkpoints import make_checkpoint

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.llm import LLM
from ladle.messages import EngineCoreRequest
from ladle.models.demo import ensure_demo_model
from ladle.sample.logits_processors.custom import AdapterLogitsProcessor
from ladle.sampling_params import SamplingParams, StructuredOutputsParams
from ladle.tokenizer import load_tokenizer

PROMPT = [11, 12, 13, 14, 15]
# Prompts the tiny model's greedy decoding loops on (505 x 33, then 279 ...; ... then 501 x 24),
# so ngram drafts get accepted.
LOOP = [1] * 6
LOOP7 = [7] * 6


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3spec")
    make_checkpoint("qwen3", path, torch.float32)
    return path


def engine(path, **kw) -> EngineCore:
    kw.setdefault("kv_cache_memory", "16MB")
    return EngineCore(EngineConfig(model=str(path), dtype="float32", **kw))


def run(eng: EngineCore, requests: dict, drafted: dict | None = None):
    """Token ids and per-token sampled logprobs of each request; `drafted` collects the
    requests that were given drafts in some step."""
    if drafted is not None:
        schedule = eng.scheduler.schedule

        def recording_schedule():
            out = schedule()
            for r in out.scheduled:
                drafted[r.req_id] = drafted.get(r.req_id, False) or r.req_id in out.draft_token_ids
            return out
        eng.scheduler.schedule = recording_schedule
    for rid, (prompt, params) in requests.items():
        eng.add_request(EngineCoreRequest(rid, prompt, params, [2], 0.0))
    toks = {rid: [] for rid in requests}
    lps = {rid: [] for rid in requests}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.req_id] += o.new_token_ids
            if o.logprobs is not None:
                assert len(o.logprobs.sampled_values) == len(o.new_token_ids)
                lps[o.req_id] += [(v, ids, vals) for v, ids, vals in zip(
                    o.logprobs.sampled_values, o.logprobs.token_ids, o.logprobs.values, strict=True)]
    return toks, lps


def _p(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 40)
    return SamplingParams(**kw)


MIXED = {
    "greedy": (PROMPT, _p(temperature=0)),
    "loop": (LOOP, _p(temperature=0)),
    "top_p": (PROMPT, _p(temperature=0.8, top_p=0.9, seed=1)),
    "loop7": (LOOP7, _p(temperature=0)),
    "top_k": (LOOP, _p(temperature=0.8, top_k=20, seed=2)),
    "min_p": (PROMPT, _p(temperature=0.8, min_p=0.1, seed=3)),
    "penalties": (LOOP, _p(temperature=0.7, seed=4, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.2)),
    "greedy_pen": (LOOP, _p(temperature=0, repetition_penalty=1.3, frequency_penalty=0.1)),
    "bias": (PROMPT, _p(temperature=0, logit_bias={501: 3.0, 7: -50.0})),
    # Bans 505 right after 505: the loop itself, only in that two-token context.
    "bad_words": (LOOP, _p(temperature=0, bad_words_token_ids=[[505, 505]])),
    "allowed": (PROMPT, _p(temperature=0.9, seed=5, allowed_token_ids=[1, 46, 100, 501, 502])),
    "min_tokens": (LOOP, _p(temperature=0, min_tokens=36, stop_token_ids=[279])),
    "stop_ids": (LOOP7, _p(temperature=0, stop_token_ids=[144, 501], min_tokens=3)),
    "eos": (LOOP, _p(temperature=0.9, seed=6, top_k=5)),  # EOS is 2 (see run())
    "logprobs_raw": (PROMPT, _p(temperature=0.8, seed=7, logprobs=5)),
    "logprobs_proc": (LOOP, _p(temperature=0.8, seed=8, top_k=10, logprobs=5,
                               logprobs_mode="processed_logprobs", presence_penalty=0.4)),
    "short": (LOOP, _p(temperature=0, max_tokens=3)),
}


@pytest.fixture(scope="module")
def baseline(ckpt):
    return run(engine(ckpt), MIXED)


def assert_same(got, want):
    toks, lps = got
    want_toks, want_lps = want
    for rid in MIXED:
        assert toks[rid] == want_toks[rid], rid
        assert len(lps[rid]) == len(want_lps[rid]), rid
        for (v, ids, vals), (wv, wids, wvals) in zip(lps[rid], want_lps[rid], strict=True):
            assert ids == wids, rid
            assert v == pytest.approx(wv, abs=1e-4), rid
            assert vals == pytest.approx(wvals, abs=1e-4), rid


def test_baseline_exercises_the_parameters(baseline):
    toks, lps = baseline
    assert toks["loop"][:30] == [505] * 30 and toks["loop7"][-20:] == [501] * 20
    assert toks["bad_words"] != toks["loop"]
    assert all(b != 505 for a, b in pairwise(toks["bad_words"]) if a == 505)
    assert 279 in toks["loop"] and 279 not in toks["min_tokens"][:36]
    stop = toks["stop_ids"]
    assert len(stop) < 40 and stop[-1] in (144, 501) and not {144, 501} & set(stop[2:-1])
    assert toks["short"] == toks["loop"][:3]
    assert set(toks["allowed"]) <= {1, 46, 100, 501, 502}
    assert len(lps["logprobs_raw"]) == len(toks["logprobs_raw"])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_token_identical_with_preemption_and_prefix_hits(ckpt, baseline, k):
    # A cache too small for the batch: requests are preempted and recomputed. Blocks of 4
    # tokens so prompts and outputs fill blocks; the second run hits the prefix cache.
    eng = engine(ckpt, speculative_config=ngram(k), block_size=4, num_kv_blocks=48,
                 max_model_len=64)
    drafted: dict = {}
    assert_same(run(eng, MIXED, drafted), baseline)
    assert eng.scheduler.num_preemptions > 0
    hits = eng.kv_cache.num_prefix_hits
    assert_same(run(eng, MIXED), baseline)
    assert eng.kv_cache.num_prefix_hits > hits
    stats = eng.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == \
        stats["spec_decode_num_accepted_tokens"]
    assert len(stats["spec_decode_num_accepted_tokens_per_pos"]) == k
    assert drafted["loop"] and drafted["bias"]
    # Rejected drafts never reach the prefix cache: every published block holds known tokens.
    assert eng.kv_cache.num_used_blocks == 0


def test_fewer_steps_when_drafts_are_accepted(ckpt):
    req = {"loop": (LOOP, _p(temperature=0, max_tokens=60))}
    plain = engine(ckpt)
    want, _ = run(plain, req)
    spec = engine(ckpt, speculative_config=ngram(4))
    got, _ = run(spec, req)
    assert got == want
    assert spec.num_steps < plain.num_steps * 0.6, (spec.num_steps, plain.num_steps)


def test_rejected_draft_slots_are_given_back_and_never_published(ckpt):
    bs = 4
    eng = engine(ckpt, speculative_config=ngram(5), block_size=bs)
    eng.add_request(EngineCoreRequest("r", LOOP7, _p(temperature=0, max_tokens=40), [2], 0.0))
    req = eng.scheduler.requests["r"]
    saw_rejection = False
    while eng.has_unfinished_requests():
        drafts_before = eng.num_draft_tokens
        accepted_before = eng.num_accepted_tokens
        eng.step()
        if req.is_finished:
            break
        saw_rejection |= (eng.num_draft_tokens - drafts_before
                          > eng.num_accepted_tokens - accepted_before)
        # KV counts only accepted tokens; blocks past the known tokens went back to the pool.
        assert req.num_computed_tokens == req.num_tokens - 1
        held = len(eng.kv_cache.get_blocks("r"))
        assert -(-req.num_computed_tokens // bs) <= held <= -(-req.num_tokens // bs)
        # Every published block is named by a hash over known tokens only.
        published = {h for h, b in eng.kv_cache.cached.items() if b in eng.kv_cache.get_blocks("r")}
        assert published <= set(req.block_hashes[: (req.num_tokens - 1) // bs])
    assert saw_rejection and eng.num_accepted_tokens > 0


def test_ngram_proposer():
    from ladle.spec_decode.ngram import NgramProposer

    p = NgramProposer(1, 3, 3)
    assert p.propose([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1]  # longest suffix (1, 2) matched
    assert p.propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]  # capped by the room left
    assert p.propose([1, 2, 3, 4, 5], 5) == []  # no earlier occurrence
    assert p.propose([9, 5, 6, 7, 8, 5, 6, 7, 8, 5], 5) == [6, 7, 8]  # latest with k after it
    assert NgramProposer(2, 3, 3).propose([4, 1, 2, 1], 5) == []  # below prompt_lookup_min


class BanOneProcessor(AdapterLogitsProcessor):
    """A custom processor that does not declare position support: bans token extra_args["ban"]
    once the output has 3 tokens."""

    def new_req_logits_processor(self, params):
        ban = (params.extra_args or {}).get("ban")
        if ban is None:
            return None

        def fn(out, logits):
            if len(out) >= 3:
                logits[ban] = float("-inf")
            return logits
        return fn


def test_custom_processor_without_positions_runs_its_requests_undrafted(ckpt):
    reqs = {"custom": (LOOP, _p(temperature=0, extra_args={"ban": 505})),
            "plain": (LOOP, _p(temperature=0))}
    proc = ["test_speculative:BanOneProcessor"]
    want, _ = run(engine(ckpt, logits_processors=proc), reqs)
    drafted: dict = {}
    got, _ = run(engine(ckpt, logits_processors=proc, speculative_config=ngram(3)), reqs,
                 drafted)
    assert got == want
    assert 505 not in want["custom"][3:] and want["custom"] != want["plain"]
    assert drafted == {"custom": False, "plain": True}


@pytest.mark.parametrize("config, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "drafts": 1}, "drafts"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 2},
     "model"),
    ('{"method": "ngram", ', "speculative_config"),
])
def test_bad_config_is_a_startup_error_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=config)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM("ladle-demo", speculative_config=config)


def test_serve_rejects_a_bad_speculative_config_before_loading():
    import subprocess
    import sys

    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    proc = subprocess.run([sys.executable, "-m", "ladle.entrypoints.cli", "serve",
                           "--speculative-config", bad], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "--speculative-config: speculative_config.num_speculative_tokens" in proc.stderr


# ---- constraints and text parameters on the demo model (real Qwen tokenizer) ----------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                     "maxItems": 6}},
          "required": ["name", "tags"], "additionalProperties": False}


ANSWER = "Tags: a b a b a b a b a b a b.<think>\n\n</think>\n\n"  # constrained from token 1
THINK = "Tags: a b a b a b a b.<think>\n"  # output opens thinking


def demo_requests() -> list[tuple[str, SamplingParams]]:
    so = StructuredOutputsParams
    return [
        (ANSWER, SamplingParams(temperature=0, max_tokens=30, structured_outputs=so(json=SCHEMA))),
        (ANSWER, SamplingParams(temperature=0.8, seed=11, max_tokens=30,
                                structured_outputs=so(json=SCHEMA))),
        (ANSWER, SamplingParams(temperature=0.9, seed=12, max_tokens=20,
                                structured_outputs=so(regex=r"(ab|cd){2,10}x"))),
        # Repetitive constraints, so drafts inside the grammar get accepted.
        (ANSWER, SamplingParams(temperature=0, max_tokens=24,
                                structured_outputs=so(regex=r"(abc){5,12}"))),
        (ANSWER, SamplingParams(temperature=0.8, seed=16, max_tokens=30,
                                structured_outputs=so(regex=r"\[(1, ){8,12}1\]"))),
        (ANSWER, SamplingParams(temperature=1.0, seed=13, max_tokens=10,
                                structured_outputs=so(choice=["red", "green", "blue"]))),
        (ANSWER, SamplingParams(temperature=0, max_tokens=20, bad_words=["a b", " b"])),
        (ANSWER, SamplingParams(temperature=0.8, seed=14, max_tokens=20, logprobs=3, top_p=0.9,
                                frequency_penalty=0.5)),
        (THINK, SamplingParams(temperature=0.7, seed=15, max_tokens=20, thinking_token_budget=5)),
    ]


def test_constraints_and_thinking_budget_identical_on_demo_model():
    # float32: in bfloat16 a multi-token verification forward rounds differently from a
    # one-token decode step, enough to flip a sampled token now and then (see README).
    reqs = demo_requests()
    outs = {}
    for k in (None, 3):
        llm = LLM("ladle-demo", reasoning_parser="qwen3", max_num_seqs=16, dtype="float32",
                  speculative_config=None if k is None else ngram(k))
        step, widest = llm.engine.step, [0]

        def recording_step(step=step, widest=widest):
            outs = step()
            widest[0] = max([widest[0]] + [len(o.new_token_ids) for o in outs])
            return outs
        llm.engine.step = recording_step
        res = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        outs[k] = [(o.outputs[0].token_ids, o.outputs[0].text,
                    [x and sorted(x.items()) for x in (o.outputs[0].logprobs or [])])
                   for o in res]
        stats = llm.engine.stats()
        end_id = llm.engine.reasoning.end_id
        del llm
    for i, (a, b) in enumerate(zip(outs[None], outs[3], strict=True)):
        assert a[0] == b[0], (i, a[1], b[1])
        assert len(a[2]) == len(b[2])
    assert outs[3][5][1] in ("red", "green", "blue")
    assert outs[3][3][1].startswith("abcabcabc") and outs[3][4][1].startswith("[1, 1, 1,")
    assert end_id in outs[3][8][0][:7]  # the budget closed the thinking
    assert stats["spec_decode_num_accepted_tokens"] >= 10, stats
    assert widest[0] >= 3  # a step emitted several tokens of one request


# ---- through the server -----------------------------------------------------------------------
SERVER_PROMPTS = ["1, 2, 3, 1, 2,", "a b a b a b a b"]


@pytest.fixture(scope="module")
def spec_server():
    from test_server import RemoteServer

    s = RemoteServer("--max-model-len", "512", "--dtype", "float32", "--disable-access-log",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    yield s
    assert s.stop() == 0, s.log()


def test_server_stream_equals_non_stream_equals_no_speculation(spec_server):
    from test_server import MODEL

    # Prompts under one KV block: no prefix-cache hit changes the numerics between runs.
    ref = LLM("ladle-demo", dtype="float32", max_model_len=512)
    client = spec_server.client()
    for i, prompt in enumerate(SERVER_PROMPTS):
        for temperature, seed in ((0.0, None), (0.8, 100 + i)):
            # top_p / top_k explicit: the server would take the checkpoint's generation_config.
            params = SamplingParams(temperature=temperature, seed=seed, max_tokens=40,
                                    top_p=0.9, top_k=50)
            want = ref.generate(prompt, params)[0].outputs[0]
            kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=temperature,
                      seed=seed, top_p=0.9, extra_body={"top_k": 50})
            full = client.completions.create(
                **kw | {"extra_body": {"top_k": 50, "return_token_ids": True}})
            assert full.choices[0].token_ids == want.token_ids, (prompt, seed)
            assert full.choices[0].text == want.text
            assert full.usage.completion_tokens == len(want.token_ids)
            text, usage = "", None
            for chunk in client.completions.create(**kw, stream=True,
                                                   stream_options={"include_usage": True}):
                text += "".join(c.text for c in chunk.choices)
                usage = chunk.usage or usage
            assert text == want.text and usage.completion_tokens == len(want.token_ids)
    m = spec_server.metrics()  # vLLM's spec_decode series, with ladle's prefix
    drafted = m["ladle:spec_decode_num_draft_tokens_total"]
    accepted = m["ladle:spec_decode_num_accepted_tokens_total"]
    assert m["ladle:spec_decode_num_drafts_total"] > 0 and drafted > 0
    assert 0 <= accepted <= drafted
    assert m["ladle:spec_decode_num_accepted_tokens_per_pos_total"] == accepted


def test_server_stop_strings_with_drafts(spec_server):
    from test_server import MODEL, _stop_strings

    client = spec_server.client()
    tokenizer = load_tokenizer(ensure_demo_model())
    prompt = SERVER_PROMPTS[0]
    kw = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=120)
    ref = client.completions.create(**{**kw, "max_tokens": 40},
                                    extra_body={"return_token_ids": True})
    ids, text = ref.choices[0].token_ids, ref.choices[0].text
    for span, (stop, start) in _stop_strings(tokenizer, ids, text).items():
        full = client.completions.create(**kw, stop=[stop])
        assert (full.choices[0].text, full.choices[0].finish_reason) == (text[:start], "stop")
        deltas = [c.text for chunk in client.completions.create(**kw, stop=[stop], stream=True)
                  for c in chunk.choices]
        assert "".join(deltas) == text[:start], (span, deltas)
