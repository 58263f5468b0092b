"""A failure stays with the request that caused it: a custom logits processor that raises when a
marked request is in the batch fails the marked requests only (the others complete with the
tokens they would have had), a processor whose validate_params raises rejects only its request,
and the engine serves new requests exactly as a fresh engine would afterwards."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch
from checkpoints import make_checkpoint

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.engine.request import FinishReason
from ladle.messages import EngineCoreRequest
from ladle.sampling_params import SamplingParams

FAULTY = textwrap.dedent('''
    from ladle.sample.logits_processors.interface import RowStateProcessor

    class Faulty(RowStateProcessor):
        """extra_args={"explode": true}: apply() raises while such a row is in the batch;
        {"reject": true}: validate_params refuses the request."""
        def is_argmax_invariant(self):
            return False
        @classmethod
        def validate_params(cls, params):
            if (params.extra_args or {}).get("reject"):
                raise ValueError("extra_args.reject: this processor refuses the request")
        def new_state(self, a):
            return True if (a.params.extra_args or {}).get("explode") else None
        def apply(self, logits):
            if self.states:
                raise RuntimeError("faulty processor: a marked row is in the batch")
            return logits
''')

PROMPTS = [[11, 12, 13, 14, 15], [3, 4], [20, 21, 22], [7, 8, 9, 10], [5], [30, 31]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("faulty")
    make_checkpoint("qwen3", path, torch.float32)
    (path / "ladle_faulty_proc.py").write_text(FAULTY)
    sys.path.insert(0, str(path))
    yield path
    sys.path.remove(str(path))
    sys.modules.pop("ladle_faulty_proc", None)


def engine(path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="16MB",
                                   logits_processors=["ladle_faulty_proc:Faulty"]))


def params(i: int, **extra) -> SamplingParams:
    # greedy and seeded rows, so a rerun must give the same tokens
    if i % 2:
        return SamplingParams(temperature=0, max_tokens=12, extra_args=extra or None)
    return SamplingParams(temperature=0.9, seed=i, top_p=0.9, max_tokens=12,
                          extra_args=extra or None)


def run(eng: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, p) in reqs.items():
        eng.add_request(EngineCoreRequest(rid, prompt, p, [], 0.0))
    toks = {rid: [] for rid in reqs}
    reasons, errors = {}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[o.req_id] = FinishReason(o.finish_reason)
                errors[o.req_id] = o.error
    return toks, reasons, errors


def test_a_raising_processor_fails_only_the_marked_requests(ckpt):
    reference, _, _ = run(engine(ckpt), {f"r{i}": (p, params(i)) for i, p in enumerate(PROMPTS)})

    eng = engine(ckpt)
    marked = {"r1", "r4"}
    reqs = {f"r{i}": (p, params(i, explode=True) if f"r{i}" in marked else params(i))
            for i, p in enumerate(PROMPTS)}
    toks, reasons, errors = run(eng, reqs)
    for rid in reqs:
        if rid in marked:
            assert reasons[rid] == FinishReason.ERROR
            assert "faulty processor" in errors[rid]
            assert toks[rid] == []  # failed before any token
        else:
            assert reasons[rid] == FinishReason.LENGTH, errors[rid]
            assert toks[rid] == reference[rid]  # as if the marked ones had never been there
    assert eng.num_failed_requests == 2
    assert eng.kv_cache.num_used_blocks == 0

    # A marked request arriving mid-run (other rows decoding) fails alone too.
    eng.add_request(EngineCoreRequest("late-ok", PROMPTS[0], params(0), [], 0.0))
    eng.step()
    toks2, reasons2, _ = run(eng, {"late-bad": (PROMPTS[2], params(3, explode=True))})
    assert reasons2["late-bad"] == FinishReason.ERROR
    assert reasons2["late-ok"] == FinishReason.LENGTH and len(toks2["late-ok"]) == 11
    # Afterwards the engine serves exactly as a fresh one.
    again, reasons3, _ = run(eng, {f"r{i}": (p, params(i)) for i, p in enumerate(PROMPTS)})
    assert again == reference
    assert set(reasons3.values()) == {FinishReason.LENGTH}
    assert eng.kv_cache.num_used_blocks == 0


def test_validate_params_rejects_only_its_request(ckpt):
    eng = engine(ckpt)
    with pytest.raises(ValueError, match="extra_args.reject"):
        eng.add_request(EngineCoreRequest("bad", PROMPTS[0], params(1, reject=True), [], 0.0))
    toks, reasons, _ = run(eng, {"good": (PROMPTS[1], params(1))})
    assert reasons == {"good": FinishReason.LENGTH} and len(toks["good"]) == 12
    assert "bad" not in eng.scheduler.requests


def test_a_device_fault_still_ends_the_engine():
    from ladle.engine.core import is_device_fault

    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_device_fault(RuntimeError("faulty processor"))
    assert not is_device_fault(ValueError("CUDA error"))


def test_a_server_fault_is_a_500_and_a_bad_request_a_400(tmp_path, monkeypatch):
    """Through `ladle serve`: a request that crashes the engine's step (the faulty processor)
    gets a 500 server_error, in a stream an error event with the same shape; one the engine
    rejects (validate_params) gets a 400 naming the field; the server serves on."""
    import openai
    from test_server import API_KEY, RemoteServer

    (tmp_path / "ladle_faulty_proc.py").write_text(FAULTY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    server = RemoteServer("--dtype", "float32", "--max-model-len", "512", "--api-key", API_KEY,
                          "--logits-processors", "ladle_faulty_proc:Faulty")
    try:
        client = server.client()
        kw = dict(model="ladle-demo", prompt="Hello", max_tokens=4)
        with pytest.raises(openai.InternalServerError) as crashed:
            client.completions.create(**kw, extra_body={"vllm_xargs": {"explode": True}})
        assert crashed.value.status_code == 500
        assert crashed.value.body["type"] == "server_error"
        assert "faulty processor" in crashed.value.body["message"]
        with pytest.raises(openai.APIError) as in_stream:
            for _ in client.chat.completions.create(
                    model="ladle-demo", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4, stream=True, extra_body={"vllm_xargs": {"explode": True}}):
                pass
        assert in_stream.value.body["type"] == "server_error"
        with pytest.raises(openai.BadRequestError) as rejected:
            client.completions.create(**kw, extra_body={"vllm_xargs": {"reject": True}})
        assert "extra_args.reject" in rejected.value.body["message"]
        assert client.completions.create(**kw).choices[0].finish_reason == "length"
    finally:
        server.stop()


def test_the_offline_output_says_why_a_request_failed(ckpt):
    from ladle import LLM

    llm = LLM(str(ckpt), dtype="float32", kv_cache_memory="16MB",
              logits_processors=["ladle_faulty_proc:Faulty"])
    bad, good = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                             [params(1, explode=True), params(1)])
    assert bad.outputs[0].finish_reason == "error"
    assert "faulty processor" in bad.outputs[0].error
    assert good.outputs[0].finish_reason == "length" and good.outputs[0].error is None
