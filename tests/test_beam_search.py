"""Beam search (issue 27): in the engine's batch, equal to transformers'
`generate(num_beams=k, do_sample=False)` (the numerical reference)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from checkpoints import make_checkpoint

from ladle import LLM, BeamSearchParams
from ladle.models.demo import ensure_demo_model

EOS = 2
PROMPTS = [[5, 6, 7], list(range(20, 37)), list(range(100, 140))]  # 3, 17 and 40 tokens
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    """A float32 random model whose EOS logit is scaled up, so beams end at different lengths,
    as transformers' model and as ladle's LLM."""
    path = tmp_path_factory.mktemp(request.param)
    ref = make_checkpoint(request.param, path, torch.float32)
    with torch.no_grad():
        ref.lm_head.weight[EOS] *= 2.5
    ref.config.eos_token_id = ref.generation_config.eos_token_id = EOS
    ref.save_pretrained(path)
    llm = LLM(str(path), tokenizer=str(ensure_demo_model()), dtype="float32",
              kv_cache_memory="32MB")
    yield ref, llm
    llm.close()


def hf_beams(ref, prompt, eos, width, length_penalty, early_stopping):
    """transformers' beams: (generated tokens up to and with the first EOS, score), best first."""
    import transformers as tf

    cfg = tf.GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping, eos_token_id=eos,
                              pad_token_id=eos[0], return_dict_in_generate=True,
                              output_scores=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    try:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), generation_config=cfg)
    finally:
        torch.set_num_threads(threads)
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
        tokens = seq[len(prompt):].tolist()
        ends = [i for i, t in enumerate(tokens) if t in eos]
        beams.append((tokens[: ends[0] + 1] if ends else tokens, float(score)))
    return beams


WIDTHS, PENALTIES, EARLY = (2, 4, 8), (0.0, 1.0, 2.0, -0.5), (True, False, "never")
CASES = list(itertools.product(WIDTHS, PENALTIES, EARLY))


def test_beams_equal_transformers(models):
    """Every width x length_penalty x early_stopping, each on one of the prompts in turn, all 36
    searches in one batch of the engine."""
    ref, llm = models
    eos = llm.processor.eos_token_ids
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(CASES))]
    outs = llm.beam_search(prompts, [
        BeamSearchParams(beam_width=w, max_tokens=MAX_TOKENS, length_penalty=lp,
                         early_stopping=early) for w, lp, early in CASES])
    lengths = set()
    for (width, lp, early), prompt, out in zip(CASES, prompts, outs, strict=True):
        want = hf_beams(ref, prompt, eos, width, lp, early)
        got = [(s.tokens[len(prompt):], s.score) for s in out.sequences]
        case = f"width {width}, length_penalty {lp}, early_stopping {early}, prompt {prompt[:3]}"
        assert [t for t, _ in got] == [t for t, _ in want], case
        for (_, a), (_, b) in zip(got, want, strict=True):
            # 1e-5, or a few float32 ulps of scores near -40 (two float32 forwards round apart
            # by ~1e-7 relative per token)
            assert a == pytest.approx(b, abs=1e-5, rel=1e-6), case
        for s in out.sequences:
            assert s.tokens[: len(prompt)] == prompt
            n = len(s.tokens) - len(prompt)
            assert s.score == pytest.approx(s.cum_logprob / n ** lp, abs=1e-5, rel=1e-6)
            lengths.add(n)
    assert len(lengths) >= 3, f"the EOS should end beams at different lengths: {lengths}"


# ---- through the API ------------------------------------------------------------------------
API_CASES = [(4, 1.0, False), (2, 0.0, True), (3, -0.5, "never"), (4, 2.0, "never")]


def test_completions_beam_search_equals_transformers(server):
    """/v1/completions with use_beam_search on the shared ladle-demo server (float32), all
    searches at once, against transformers' generate on the same checkpoint."""
    import asyncio

    import httpx
    import transformers as tf
    from test_server import API_KEY, MODEL

    from ladle.tokenizer import eos_token_ids, load_tokenizer

    path = ensure_demo_model()
    eos = eos_token_ids(load_tokenizer(path), path)
    prompts = [[9707, 11, 1879, 0], list(range(1000, 1013)), [785, 3974, 13876], [40, 1079]]

    async def search(client, prompt, width, lp, early):
        r = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "use_beam_search": True,
            "best_of": width, "n": width, "length_penalty": lp, "early_stopping": early,
            "logprobs": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    async def all_searches():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            return await asyncio.gather(*(search(client, p, *case)
                                          for p, case in zip(prompts, API_CASES, strict=True)))

    answers = asyncio.run(all_searches())
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, (width, lp, early), body in zip(prompts, API_CASES, answers, strict=True):
        want = hf_beams(ref, prompt, eos, width, lp, early)
        choices = sorted(body["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [t for t, _ in want]
        for c, (tokens, score) in zip(choices, want, strict=True):
            cum = sum(c["logprobs"]["token_logprobs"])
            assert cum / len(tokens) ** lp == pytest.approx(score, abs=1e-5, rel=1e-6)
        assert body["usage"]["completion_tokens"] == sum(len(t) for t, _ in want)


@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": True, "best_of": 129, "n": 2}, "best_of"),
    ({"use_beam_search": True, "n": 129}, "n"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "n": 2, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "best_of": 2, "n": 3}, "n"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": True, "n": 2, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_hostile_beam_values_are_400s(server, body, param):
    import httpx
    from test_server import API_KEY, MODEL

    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    ok = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_clients_that_leave_a_search_free_every_beam(server):
    """A beam search whose client goes away (a streamed search closed early, a non-streamed
    one timed out) is aborted in the engine: every beam's rows and KV blocks are freed and the
    server goes on serving."""
    import httpx
    from test_server import API_KEY, MODEL

    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 900, "ignore_eos": True,
            "use_beam_search": True, "n": 2, "best_of": 4}
    aborted = 'ladle:request_success_total{finished_reason="abort"}'
    server.wait_idle()
    before = server.metrics()

    # Streamed: a beam search streams its beams' text when the search ends, so this client
    # sees the response start and gives up waiting for the rest.
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + 60  # a loaded machine may take seconds to start
            while server.metrics()["ladle:num_requests_running"] < 4:  # the four beams run
                assert time.monotonic() < deadline, "the search never started its beams"
                time.sleep(0.05)
    # Not streamed: a client that times out.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=headers, timeout=1.5, json=body)
    server.wait_idle()
    after = server.metrics()
    # Per returned choice (n = 2 each), as for any n > 1 request; not per beam (4 each).
    assert after[aborted] - before[aborted] == 2 * body["n"]
    generated = after["ladle:generation_tokens_total"] - before["ladle:generation_tokens_total"]
    assert generated < 2 * 4 * body["max_tokens"] / 2, generated
    ok = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                    json={**body, "max_tokens": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


# ---- inside the engine ----------------------------------------------------------------------
def test_prefill_once_per_prompt_and_abort_frees_every_beam(models):
    from ladle.messages import EngineCoreRequest
    from ladle.sampling_params import SamplingParams

    _, llm = models
    engine = llm.engine
    prompts = [list(range(300, 331)), list(range(400, 419))]  # new to the prefix cache
    before = engine.scheduler.num_prefill_tokens
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))
    assert all(len(o.sequences) == 4 for o in outs)
    assert engine.scheduler.num_prefill_tokens - before == sum(map(len, prompts))
    assert engine.kv_cache.num_used_blocks == 0 and not engine.beam_groups

    # An aborted search (by its request id or a choice's id) frees every beam's blocks.
    for abort_id in ("gone", "gone2-1"):
        rid = abort_id.split("-")[0]
        engine.add_request(EngineCoreRequest(
            rid, list(range(200, 240)), SamplingParams(n=2, beam_width=4, temperature=0,
                                                        max_tokens=64, ignore_eos=True),
            [EOS], 0.0))
        for _ in range(4):
            engine.step()
        assert len(engine.scheduler.running) == 4 and engine.kv_cache.num_used_blocks > 0
        engine.abort_request(abort_id)
        assert not engine.has_unfinished_requests() and not engine.beam_groups
        assert engine.kv_cache.num_used_blocks == 0


@pytest.fixture(scope="module")
def demo():
    llm = LLM("ladle-demo", dtype="float32", kv_cache_memory="64MB")
    yield llm
    llm.close()


def test_constraints_and_processors_hold_on_every_beam(demo):
    """json_schema beams all validate; bad_words and logit_bias hold on every beam (through
    LLM.generate with beam_width, the path the API takes)."""
    import json

    import jsonschema

    from ladle import SamplingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    beam = dict(n=3, beam_width=3, temperature=0, max_tokens=48)
    out = demo.generate("A person as JSON:", SamplingParams(
        **beam, structured_outputs=StructuredOutputsParams(json=schema)))[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), schema)

    prompt = "The river stone"
    free = demo.generate(prompt, SamplingParams(**beam))[0].outputs
    seen = {t for o in free for t in o.token_ids}
    biased = demo.generate(prompt, SamplingParams(**beam, logit_bias={t: -100 for t in seen}))
    assert all(not seen & set(o.token_ids) for o in biased[0].outputs)

    word = next(w for w in (demo.tokenizer.decode([t]).strip() for o in free for t in o.token_ids)
                if w.isalpha())
    params = SamplingParams(**beam, bad_words=[word])
    banned = demo.generate(prompt, params)[0].outputs
    params.update_from_tokenizer(demo.tokenizer)
    for o in banned:
        for seq in params.bad_words_token_ids:
            assert not any(o.token_ids[i:i + len(seq)] == seq for i in range(len(o.token_ids))), \
                (word, o.token_ids)


def test_beams_under_few_rows_and_blocks(models):
    """With 3 rows and 12 KV blocks, a width-8 search cannot hold all its beams: forks wait for a
    row or a block and recompute from the prefix cache, beams are preempted, and beams wait for
    the rest of their group. The beams and scores are those of the roomy engine."""
    ref, roomy = models
    prompts = [list(range(60, 100)), list(range(120, 135))]
    params = [BeamSearchParams(beam_width=8, max_tokens=MAX_TOKENS, length_penalty=1.0),
              BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, early_stopping=True)]
    want = roomy.beam_search(prompts, params)
    tight = LLM(roomy.config.model, tokenizer=str(ensure_demo_model()), dtype="float32",
                max_num_seqs=3, num_kv_blocks=12, max_model_len=128)
    try:
        got = tight.beam_search(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0
        assert tight.engine.kv_cache.num_used_blocks == 0
    finally:
        tight.close()
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        for a, b in zip(g.sequences, w.sequences, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5, rel=1e-6)
