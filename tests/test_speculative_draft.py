"""Speculative decoding with a draft model: rejection sampling keeps the target's processed
distribution (chi-square over 10k+ draws, for plain, top-k, top-p and min-p rows, seeded or
not, with a draft distribution far from the target's); greedy output is token-identical to
decoding without speculation; seeded requests repeat exactly across runs and engines; bad draft
checkpoints are startup errors naming the field."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoints import make_checkpoint
from sampler_harness import Harness
from test_sampler import chi_square_ok, ref_min_p, ref_top_k_top_p
from test_speculative import ANSWER, LOOP, PROMPT, SCHEMA, engine, run

from ladle.config import EngineConfig
from ladle.llm import LLM
from ladle.models.demo import ensure_demo_model
from ladle.sample.rejection import DraftTest
from ladle.sampling_params import SamplingParams, StructuredOutputsParams


# ---- the distribution, at the sampler ---------------------------------------------------------
def target_probs(base: torch.Tensor, case: dict) -> torch.Tensor:
    r = base / case["temperature"]
    if case.get("min_p"):
        r = ref_min_p(r, case["min_p"])
    r = ref_top_k_top_p(r, case.get("top_k", 0), case.get("top_p", 1.0))
    return torch.softmax(r, -1)


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("case", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.15),
])
def test_rejection_sampling_keeps_the_target_distribution(case, seeded):
    vocab, rows = 12, 10240  # one batch of 10240 draws at one output position
    h = Harness(vocab, max_rows=rows, seed=7)
    g = torch.Generator().manual_seed(11)
    base = torch.randn(vocab, generator=g) * 1.5
    # q: far from p, and with mass where p has none (top-k / top-p / min-p removed tokens), so
    # both rejections and residual draws are frequent.
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    specs = [(SamplingParams(seed=(1000 + i) if seeded else None, max_tokens=100, **case),
              [1], [5, 6]) for i in range(rows)]
    h.set_requests(specs)
    drafts = torch.multinomial(q, rows, replacement=True, generator=g)
    test = DraftTest(rows=torch.arange(rows), token_ids=drafts, probs=q.expand(rows, vocab))
    positions = torch.full((rows,), 2)
    h.sampler.update_state(None)
    toks = h.sampler(base.expand(rows, vocab).clone(), h.meta, positions,
                     draft=test).sampled_token_ids
    p = target_probs(base, case)
    counts = torch.bincount(toks, minlength=vocab).float()
    assert chi_square_ok(counts, p), (counts, p * rows)
    # The acceptance rate is sum(min(p, q)); a rejected draft is never emitted.
    accepted = (toks == drafts).float().mean().item()
    assert accepted == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.025)
    assert 0.1 < accepted < 0.9
    if seeded:  # seeded rows draw the accept tests and residuals from their own noise
        again = h.sampler(base.expand(rows, vocab).clone(), h.meta, positions,
                          draft=test).sampled_token_ids
        assert torch.equal(toks, again)


# ---- the engine, with a real target and a different draft checkpoint -------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The target, and a draft that is the target with perturbed weights (same vocabulary):
    it agrees often but not always, so drafts are both accepted and rejected."""
    target = tmp_path_factory.mktemp("target")
    model = make_checkpoint("qwen3", target, torch.float32)
    draft = tmp_path_factory.mktemp("draft")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std())
    model.save_pretrained(draft)
    return target, draft


def draft_spec(path, k: int) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def _p(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 30)
    return SamplingParams(**kw)


GREEDY = {
    "loop": (LOOP, _p(temperature=0)),
    "prompt": (PROMPT, _p(temperature=0)),
    "penalties": (PROMPT, _p(temperature=0, repetition_penalty=1.3, frequency_penalty=0.2)),
    "bias": (PROMPT, _p(temperature=0, logit_bias={501: 3.0, 7: -50.0})),
    "stop": ([7] * 6, _p(temperature=0, stop_token_ids=[144, 501], min_tokens=3)),
    "short": (LOOP, _p(temperature=0, max_tokens=3)),
}
SEEDED = {
    "plain": (PROMPT, _p(temperature=1.0, seed=1)),
    "top_k": (LOOP, _p(temperature=0.8, top_k=20, seed=2)),
    "top_p": (PROMPT, _p(temperature=0.8, top_p=0.9, seed=3)),
    "min_p": (LOOP, _p(temperature=0.9, min_p=0.1, seed=4)),
    "stop_ids": (PROMPT, _p(temperature=1.0, seed=5, stop_token_ids=[505, 372], max_tokens=25)),
    "logprobs": (LOOP, _p(temperature=0.8, seed=6, logprobs=3, presence_penalty=0.4)),
}


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_is_token_identical_with_a_draft_model(ckpts, k):
    target, draft = ckpts
    want, want_lps = run(engine(target), GREEDY)
    # A small cache of 4-token blocks: requests are preempted and recompute, and the second
    # run hits the prefix cache (for the draft's KV too).
    eng = engine(target, speculative_config=draft_spec(draft, k), block_size=4,
                 num_kv_blocks=18, max_model_len=64)
    for _ in range(2):
        got, _ = run(eng, GREEDY)
        assert got == want
    assert eng.scheduler.num_preemptions > 0 and eng.kv_cache.num_prefix_hits > 0
    stats = eng.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert len(stats["spec_decode_num_accepted_tokens_per_pos"]) == k
    assert eng.kv_cache.num_used_blocks == 0


def test_seeded_requests_repeat_exactly_and_respect_limits(ckpts):
    target, draft = ckpts
    spec = draft_spec(draft, 3)
    first_engine = engine(target, speculative_config=spec)
    a, a_lps = run(first_engine, SEEDED)
    b, b_lps = run(first_engine, SEEDED)  # the same engine again (prefix-cache hits)
    c, c_lps = run(engine(target, speculative_config=spec), SEEDED)  # a second engine
    assert a == b == c
    assert a_lps["logprobs"] == c_lps["logprobs"] and len(a_lps["logprobs"]) == len(a["logprobs"])
    stats = first_engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    for rid, (_, params) in SEEDED.items():
        toks = a[rid]
        assert 0 < len(toks) <= params.max_tokens, rid
        stops = set(params.stop_token_ids) | {2}  # 2: EOS in run()
        assert not stops & set(toks[:-1]), rid  # a stop token inside a draft ends the output
        if len(toks) < params.max_tokens:
            assert toks[-1] in stops, rid
    assert a["stop_ids"][-1] in (505, 372, 2) or len(a["stop_ids"]) == 25


def test_draft_equal_to_target_accepts_every_plain_draft(ckpts):
    """With q = p (the draft is the target, no processor on the target's side only), every
    draft passes min(1, p/q) = 1: the mechanism's upper bound."""
    target, _ = ckpts
    # ignore_eos: an accepted EOS would end the request and leave its later drafts unverified.
    reqs = {"plain": (PROMPT, _p(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True)),
            "top_k": (LOOP, _p(temperature=0.7, top_k=10, seed=10, max_tokens=40,
                               ignore_eos=True))}
    eng = engine(target, speculative_config=draft_spec(target, 4))
    got, _ = run(eng, reqs)
    stats = eng.stats()
    assert stats["spec_decode_num_draft_tokens"] > 20
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert all(len(t) == 40 for t in got.values())


def test_llm_with_a_draft_model_on_constraints():
    """Through LLM(speculative_config=...) on the demo model (real tokenizer), the demo model
    drafting for itself: greedy constrained output equals decoding without speculation; a
    random constrained request, whose drafts ignore the grammar, still only emits what the
    grammar allows (rejected drafts have p = 0) and repeats exactly with its seed."""
    so = StructuredOutputsParams
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=so(json=SCHEMA)),
              SamplingParams(temperature=0.8, seed=11, max_tokens=40,
                             structured_outputs=so(json=SCHEMA)),
              SamplingParams(temperature=0.9, seed=12, max_tokens=20,
                             structured_outputs=so(regex=r"(ab|cd){2,10}x"))]
    plain = LLM("ladle-demo", dtype="float32", max_num_seqs=4)
    want = [o.outputs[0] for o in plain.generate([ANSWER] * 3, params)]
    del plain
    spec = {"method": "draft_model", "model": str(ensure_demo_model()),
            "num_speculative_tokens": 3}
    llm = LLM("ladle-demo", dtype="float32", max_num_seqs=4, speculative_config=spec)
    got = [o.outputs[0] for o in llm.generate([ANSWER] * 3, params)]
    again = [o.outputs[0] for o in llm.generate([ANSWER] * 3, params)]
    assert got[0].token_ids == want[0].token_ids
    assert [o.token_ids for o in got] == [o.token_ids for o in again]
    assert got[1].finish_reason == "stop" and set(json.loads(got[1].text)) == {"name", "tags"}
    assert got[2].finish_reason == "stop" and re.fullmatch(r"(ab|cd){2,10}x", got[2].text)
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0


# ---- startup errors ---------------------------------------------------------------------------
def test_draft_vocabulary_must_be_the_targets(ckpts, tmp_path):
    target, _ = ckpts
    make_checkpoint("qwen3", tmp_path, torch.float32, vocab_size=256)
    with pytest.raises(ValueError, match=r"speculative_config.model.*vocab_size 256.*512"):
        engine(target, speculative_config=draft_spec(tmp_path, 2))
    with pytest.raises(ValueError, match=r"vocab_size 256.*512"):
        LLM(str(target), speculative_config=draft_spec(tmp_path, 2))


def test_missing_draft_model_is_a_startup_error_naming_the_path(tmp_path):
    missing = tmp_path / "no-such-draft"
    with pytest.raises(ValueError, match=re.escape(f"speculative_config.model: {str(missing)!r}")):
        EngineConfig(speculative_config=draft_spec(missing, 2))
    with pytest.raises(ValueError, match="speculative_config.model.*no config.json"):
        EngineConfig(speculative_config=draft_spec(tmp_path, 2))
    with pytest.raises(ValueError, match="speculative_config.prompt_lookup_min"):
        EngineConfig(speculative_config=draft_spec(tmp_path, 2) | {"prompt_lookup_min": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config=draft_spec(tmp_path, 0))
