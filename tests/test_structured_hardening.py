"""Structured outputs under hostile conditions, on ladle-demo in-process: a finished grammar wins
over min_tokens; hot sampling never yields output that breaks its constraint; a token the grammar
rejects fails the request (never "stop"); hung compiles time out alone and give their worker
slots back; an abort cancels a queued compile; the compile cache keeps to its byte bound."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch
from sampler_harness import Harness

from ladle import LLM, SamplingParams, StructuredOutputsParams
from ladle.messages import EngineCoreRequest
from ladle.sample.logits_processors.interface import RowStateProcessor
from ladle.structured_output.backend import ConstraintKey
from ladle.structured_output.xgrammar_backend import XgrammarBackend

CHOICES = ["red", "green", "blue"]
REGEX = r"[a-z]{2,6}-[0-9]{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                   "ok": {"type": "boolean"},
                   "size": {"enum": ["S", "M", "L"]}},
    "required": ["name", "ok", "size"], "additionalProperties": False,
}
COMPILE_TIMEOUT = 3.0
CACHE_BYTES = 16 * 2**20  # a few of the schemas below (xgrammar: ~3.5 MB each)


class ForceAfterMask(RowStateProcessor):
    """extra_args={"force": token}: the row produces that token, whatever its grammar allows (a
    custom processor runs after the grammar mask)."""

    def is_argmax_invariant(self):
        return False

    def new_state(self, a):
        return (a.params.extra_args or {}).get("force")

    def apply(self, logits):
        for row, tok in self.states.items():
            logits[row] = float("-inf")
            logits[row, tok] = 0.0
        return logits


@pytest.fixture(scope="module")
def llm():
    return LLM("ladle-demo", max_num_seqs=128, logits_processors=[f"{__name__}:ForceAfterMask"],
               structured_outputs_compile_timeout=COMPILE_TIMEOUT,
               structured_outputs_cache_bytes=CACHE_BYTES)


def so(seed=0, **kw) -> SamplingParams:
    extra = {k: kw.pop(k) for k in ("min_tokens", "max_tokens", "temperature", "extra_args")
             if k in kw}
    return SamplingParams(**({"temperature": 1.0, "max_tokens": 60, "seed": seed} | extra),
                          structured_outputs=StructuredOutputsParams(**kw))


def run_engine(eng, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add the requests to the engine and step until they are done; returns req_id ->
    [token ids, finish reason, error, first-token time, finish time] (times from the start)."""
    t0 = time.monotonic()
    for rid, (prompt, params) in requests.items():
        eng.add_request(EngineCoreRequest(rid, prompt, params, [151643, 151645], t0))
    done: dict[str, list] = {rid: [[], None, None, None, None] for rid in requests}
    while any(d[1] is None for d in done.values()):
        for o in eng.step():
            if o.req_id in done:
                d, now = done[o.req_id], time.monotonic() - t0
                d[0] += o.new_token_ids
                if o.new_token_ids and d[3] is None:
                    d[3] = now
                if o.finish_reason is not None:
                    d[1:3], d[4] = [o.finish_reason, o.error], now
    return done


def test_min_tokens_yields_to_a_finished_choice(llm):
    params = [so(seed, choice=CHOICES, min_tokens=50, backend=backend)
              for backend in ("xgrammar", "guidance") for seed in range(6)]
    outs = llm.generate([f"Pick {i}:" for i in range(len(params))], params)
    for o in outs:
        assert o.outputs[0].text in CHOICES, o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop"


def test_min_tokens_never_empties_a_row():
    """The same precedence at the sampler, for allowed_token_ids: min_tokens bans the stop
    tokens only while something else is allowed."""
    V = 32
    h = Harness(V)
    p = dict(temperature=0, min_tokens=3, stop_token_ids=[5], logprobs=V,
             logprobs_mode="processed_logits", max_tokens=10)
    h.set_requests([(SamplingParams(**p, allowed_token_ids=[0, 5]), [1], [2]),
                    (SamplingParams(**p, allowed_token_ids=[0, 5, 7]), [1], [2])], eos=(0,))
    logits = torch.randn(2, V)
    got = h.processed_logits(logits)
    assert torch.isfinite(got[0]).tolist() == [t in (0, 5) for t in range(V)]  # kept: all left
    assert torch.isfinite(got[1]).tolist() == [t == 7 for t in range(V)]  # banned as usual


def test_hot_sampling_output_validates_or_is_cut_by_length(llm):
    """200 seeded runs at temperature 2.0 over both backends, half with min_tokens: every
    output is a prefix the constraint accepts; a 'stop' one is complete and validates."""
    kinds = [dict(json=SCHEMA), dict(regex=REGEX), dict(choice=CHOICES)]
    params = [so(i, temperature=2.0, max_tokens=40, min_tokens=(i // 6) % 2 * 30,
                 backend=("xgrammar", "guidance")[i % 2], **kinds[i % 3]) for i in range(200)]
    outs = llm.generate([f"Example {i}:" for i in range(200)], params)
    mgr = llm.engine.structured
    finishes, compiled = [], {}
    for p, o in zip(params, outs, strict=True):
        c = o.outputs[0]
        finishes.append(c.finish_reason)
        key = ConstraintKey.from_params(p.structured_outputs)
        backend = mgr._backend(p.structured_outputs.backend)
        if (backend.name, key) not in compiled:
            compiled[backend.name, key] = backend.compile(key)
        grammar = backend.new_grammar(compiled[backend.name, key])  # a fresh matcher
        assert grammar.accept_tokens(c.token_ids), (key.kind, c.text)
        assert c.finish_reason in ("stop", "length"), (key.kind, c.finish_reason, c.text)
        if c.finish_reason == "length":
            continue
        assert grammar.is_terminated()
        if key.kind == "json":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif key.kind == "regex":
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES
    assert finishes.count("stop") > 100  # most runs really completed their constraint


def test_token_rejected_by_the_grammar_fails_the_request(llm):
    eng = llm.engine
    forbidden = llm.tokenizer.encode("x", add_special_tokens=False)[0]
    got = run_engine(eng, {
        "forced": ([1, 2, 3], so(0, choice=CHOICES, extra_args={"force": forbidden})),
        "fine": ([1, 2, 3], so(1, choice=CHOICES)),
        "free": ([4, 5], SamplingParams(temperature=0, max_tokens=5)),
    })
    tokens, reason, error, _, _ = got["forced"]
    assert reason == 3 and tokens == [forbidden]  # FinishReason.ERROR, not STOP
    assert "structured_outputs.choice" in error and "not allowed" in error
    assert llm.tokenizer.decode(got["fine"][0], skip_special_tokens=True) in CHOICES
    assert got["fine"][1] == 0
    assert got["free"][1] == 1 and len(got["free"][0]) == 5


@pytest.fixture
def hanging_compiles(monkeypatch):
    """Compiles of constraints containing 'hang' block until the test ends; returns the list of
    constraint specs compile was called with."""
    release = threading.Event()
    calls: list[str] = []
    real = XgrammarBackend.compile

    def compile_or_hang(self, key):
        calls.append(key.spec)
        if "hang" in key.spec:
            release.wait(60)
        return real(self, key)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_or_hang)
    yield calls
    release.set()


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_hung_compiles_time_out_alone_and_give_their_slots_back(llm, hanging_compiles):
    eng = llm.engine
    pool = eng.structured.compile_pool
    before = eng.stats()
    reqs = {f"hang{i}": ([1, 2], so(i, regex=f"hang{i}[a-z]+")) for i in range(2)}
    reqs |= {f"ok{i}": ([3, 4], so(i, regex=f"ok{i}[a-z]{{2,5}}")) for i in range(6)}
    reqs["free"] = ([5, 6], SamplingParams(temperature=0, max_tokens=8))
    got = run_engine(eng, reqs)
    gave_up = min(got[f"hang{i}"][4] for i in range(2))
    for i in range(6):
        tokens, reason, _, first, _ = got[f"ok{i}"]
        assert reason == 0
        assert re.fullmatch(f"ok{i}[a-z]{{2,5}}", llm.tokenizer.decode(
            tokens, skip_special_tokens=True))
        assert first < gave_up  # generating before the hung ones gave up, not queued behind
    for i in range(2):
        _, reason, error, _, end = got[f"hang{i}"]
        assert reason == 3
        assert "--structured-outputs-compile-timeout" in error
        assert f"within {COMPILE_TIMEOUT:g} s" in error
        assert end >= COMPILE_TIMEOUT  # not before the timeout was reached
    # The hung compiles still run (native code cannot be interrupted) but hold no slot, so a
    # pool's worth of new compiles all run at once.
    after = eng.stats()
    assert after["grammar_compile_timeouts"] == before["grammar_compile_timeouts"] + 2
    assert after["grammar_compiles_abandoned"] == 2
    more = {f"more{i}": ([7], so(i, regex=f"more{i}[0-9]{{1,3}}"))
            for i in range(pool.num_workers)}
    assert all(d[1] == 0 for d in run_engine(eng, more).values())


def test_abort_cancels_a_queued_compile_and_frees_running_slots(llm, hanging_compiles):
    eng = llm.engine
    pool = eng.structured.compile_pool
    wait_for(lambda: pool.num_abandoned == 0)  # the last test's hung compiles have ended
    n = pool.num_workers
    hung = {f"h{i}": ([1], so(i, regex=f"hang-slot{i}[a-z]")) for i in range(n)}
    for rid, (prompt, params) in hung.items():
        eng.add_request(EngineCoreRequest(rid, prompt, params, [], time.monotonic()))
    wait_for(lambda: sum("hang-slot" in s for s in hanging_compiles) == n)  # every slot taken
    eng.add_request(EngineCoreRequest("queued", [1], so(0, regex="hang-queued[a-z]"), [],
                                      time.monotonic()))
    eng.abort_request("queued")
    for rid in hung:  # aborted while running: they run on, without a slot
        eng.abort_request(rid)
    got = run_engine(eng, {"next": ([2], so(0, regex="next[0-9]{2}"))})
    assert got["next"][1] == 0
    assert not any("hang-queued" in s for s in hanging_compiles)  # never compiled


def test_compile_cache_keeps_to_its_byte_bound(llm):
    """500 distinct schemas (xgrammar, plus some llguidance): the cache never holds more than
    its bound, evicts least recently used first, and counts its evictions."""
    eng = llm.engine
    cache = eng.structured.cache
    before = eng.stats()

    def schema(i):
        props = {f"k{i}": {"type": "integer"}, "v": {"type": "string", "maxLength": 4}}
        if i % 5:  # no length limit: served by xgrammar; else by llguidance
            props["v"] = {"type": "string", "pattern": "^[a-z]{1,4}$"}
        return {"type": "object", "properties": props, "required": list(props)}

    params = {f"s{i}": ([1], so(i, json=schema(i), max_tokens=1)) for i in range(500)}
    largest = 0
    for rid, (prompt, p) in params.items():
        eng.add_request(EngineCoreRequest(rid, prompt, p, [], time.monotonic()))
    while eng.has_unfinished_requests():
        assert all(o.finish_reason in (None, 1) for o in eng.step())
        largest = max(largest, cache.num_bytes)
    after = eng.stats()
    assert 0 < largest <= CACHE_BYTES and after["grammar_cache_bytes"] <= CACHE_BYTES
    # xgrammar's own sub-rule cache is bounded too (it may pass its bound by about one entry).
    assert eng.structured.backends["xgrammar"].compiler.get_cache_size_bytes() < 2 * CACHE_BYTES
    misses = after["grammar_cache_misses"] - before["grammar_cache_misses"]
    evictions = after["grammar_cache_evictions"] - before["grammar_cache_evictions"]
    assert misses == 500
    assert evictions >= 500 - len(cache)  # what is not in the cache any more was counted
    # Least recently used out first: of two schemas just used, the older is still there; one
    # from the start of the burst is not.
    def hit(i):
        hits = eng.stats()["grammar_cache_hits"]
        run_engine(eng, {f"again{i}": ([1], so(0, json=schema(i), max_tokens=1))})
        return eng.stats()["grammar_cache_hits"] == hits + 1

    hit(499), hit(498)
    assert hit(499)
    assert not hit(1)


def test_flags_reach_the_config_and_metrics_show_the_cache(llm):
    import argparse

    from ladle.config import EngineConfig
    from ladle.entrypoints.api_server import engine_config_from_args
    from ladle.entrypoints.cli import add_serve_args
    from ladle.frontend.metrics import ServerMetrics

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = engine_config_from_args(parser.parse_args([
        "--structured-outputs-compile-timeout", "7.5", "--structured-outputs-cache-bytes", "1000"]))
    assert config.structured_outputs_compile_timeout == 7.5
    assert config.structured_outputs_cache_bytes == 1000
    for field, bad in (("structured_outputs_compile_timeout", 0),
                       ("structured_outputs_compile_timeout", float("inf")),
                       ("structured_outputs_cache_bytes", -1)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})
    metrics = ServerMetrics("ladle-demo")
    metrics.set_engine_stats(0, llm.engine.stats())
    text = metrics.render().decode()
    for name in ("grammar_cache_hits_total", "grammar_cache_misses_total",
                 "grammar_cache_evictions_total", "grammar_compile_timeouts_total",
                 "grammar_cache_bytes", "grammar_compiles_abandoned"):
        assert f'ladle:{name}{{engine="0",model_name="ladle-demo"}}' in text
