"""Tensor parallelism on CPU (gloo): -tp 2 against -tp 1, which is itself checked against
transformers in test_engine_numerics.py. Logits of prefill + 16 decode steps within 2e-6 of their
largest magnitude (float32 rounding of a sum split in two; the portable AVX2 kernels reach about
1e-6 of it at |logit| 12), the
same tokens for a mixed batch (penalties, logit_bias, json_schema, logprobs, seeds), half the KV
bytes per rank, a clear error for a split that does not divide, a padded vocabulary, KV-head
replication, the Ray backend, and a killed worker ending `ladle serve` with no orphans left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from checkpoints import ARCHS, make_checkpoint
from test_engine_numerics import run
from test_server import API_KEY, MODEL, RemoteServer, child_pids, is_alive
from test_server_engine_death import kill_engine_while_serving

from ladle.config import EngineConfig
from ladle.distributed.group import WorkerGroupError
from ladle.engine.core import EngineCore
from ladle.llm import LLM
from ladle.messages import EngineCoreRequest
from ladle.models.llama import DecoderConfig, shard_layout
from ladle.sampling_params import SamplingParams, StructuredOutputsParams

PROMPTS = [[5, 6, 7], list(range(10, 47)), [300, 2, 300, 2, 9]]
NUM_DECODE = 16
TOL = 2e-6  # relative to the row set's largest |logit|


def engine(path, tp: int, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                   max_model_len=256, tensor_parallel_size=tp, **kw),
                      keep_logits=True)


def greedy(eng: EngineCore, prompts):
    """Greedy-decode the prompts as one batch; tokens and per-step logits by request."""
    return run(eng, prompts, max_tokens=NUM_DECODE)


def kv_bytes(eng: EngineCore) -> int:
    return sum(k.nbytes + v.nbytes for k, v in eng.runner.kv_caches)


@pytest.mark.parametrize("arch,vocab", [*((a, 512) for a in ARCHS), ("llama", 511)])
def test_tp2_logits_tokens_and_kv_bytes_equal_tp1(arch, vocab, tmp_path):
    """vocab 511 does not split in two: the last rank's slice is zero-padded and the padded
    logit never reaches the sampler (the gathered logits are exactly vocab wide)."""
    make_checkpoint(arch, tmp_path, torch.float32, vocab_size=vocab, tie=(arch == "qwen2"))
    results = {}
    for tp in (1, 2):
        eng = engine(tmp_path, tp)
        try:
            results[tp] = (*greedy(eng, PROMPTS), kv_bytes(eng), eng.kv_cache.num_blocks)
            if tp == 2 and vocab == 511:
                assert_idle_engine_notices_a_dead_worker(eng)
        finally:
            eng.close()
    (tok1, log1, kv1, blocks1), (tok2, log2, kv2, blocks2) = results[1], results[2]
    assert tok2 == tok1
    for a, b in zip(log1, log2, strict=True):
        assert a.shape == b.shape == (NUM_DECODE, vocab)
        assert (a - b).abs().max().item() <= TOL * max(1.0, a.abs().max().item())
    assert blocks2 == blocks1 and kv2 * 2 == kv1


def assert_idle_engine_notices_a_dead_worker(eng: EngineCore):
    """The core loop calls check_health while idle; a step after the death fails as a device
    fault (no bisecting), not as a request's error."""
    eng.check_health()
    (_, proc), = eng.model_group._launcher.procs
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    with pytest.raises(WorkerGroupError, match="rank.*1.*exited"):
        eng.check_health()
    eng.add_request(EngineCoreRequest("late", [1, 2, 3], SamplingParams(max_tokens=2), [], 0.0))
    with pytest.raises(WorkerGroupError):
        eng.step()


def test_split_that_does_not_divide_is_a_clear_startup_error(tmp_path):
    make_checkpoint("llama", tmp_path, torch.float32)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 .*num_attention_heads"):
        engine(tmp_path, 3)
    # 6 heads over 3 ranks divide, 4 KV heads neither divide by 3 nor replicate onto 3 ranks.
    cfg = DecoderConfig(512, 96, 2, 6, 4, 16, 96, 1e-6, 1e4, None, 512, False)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 .*num_key_value_heads"):
        shard_layout(cfg, 0, 3)
    # 4 ranks, 2 KV heads: each KV head is held by two consecutive ranks (vLLM's replication).
    cfg = DecoderConfig(512, 64, 2, 4, 2, 16, 128, 1e-6, 1e4, None, 512, False)
    assert [(lay.num_kv_heads, lay.kv_head_start) for lay in
            (shard_layout(cfg, r, 4) for r in range(4))] == [(1, 0), (1, 0), (1, 1), (1, 1)]


def test_tp4_replicates_kv_heads(tmp_path):
    """4 ranks, 2 KV heads: every rank holds one KV head, replicated twice; same tokens."""
    make_checkpoint("qwen3", tmp_path, torch.float32)
    out = {}
    for tp in (1, 4):
        eng = engine(tmp_path, tp)
        try:
            out[tp] = greedy(eng, PROMPTS[:2])
        finally:
            eng.close()
    assert out[4][0] == out[1][0]
    for a, b in zip(out[1][1], out[4][1], strict=True):
        assert (a - b).abs().max().item() <= TOL * max(1.0, a.abs().max().item())


def mixed_batch() -> list[tuple[str, SamplingParams]]:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                                "age": {"type": "integer"}},
              "required": ["name", "age"]}
    return [
        ("Once upon a time", SamplingParams(temperature=0, max_tokens=24, logprobs=3)),
        ("The capital of", SamplingParams(temperature=0.9, seed=7, max_tokens=24,
                                          presence_penalty=0.5, frequency_penalty=0.3,
                                          repetition_penalty=1.2)),
        ("Numbers:", SamplingParams(temperature=0.7, seed=11, max_tokens=24,
                                    logit_bias={15: 5.0, 16: 3.0}, logprobs=2)),
        ("Give JSON:", SamplingParams(temperature=0.8, seed=3, max_tokens=48,
                                      structured_outputs=StructuredOutputsParams(json=schema))),
        ("Hello", SamplingParams(temperature=1.0, seed=5, max_tokens=24, top_k=20, top_p=0.9,
                                 prompt_logprobs=2)),
    ]


def generate(llm: LLM):
    prompts, params = zip(*mixed_batch(), strict=True)
    outs = llm.generate(list(prompts), list(params))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


@pytest.fixture(scope="module")
def tp1_outputs():
    llm = LLM(MODEL, dtype="float32", max_model_len=512, tensor_parallel_size=1)
    return generate(llm)


def assert_same_outputs(ours, ref, tol: float = 1e-4):
    for (toks, lps, plps), (ref_toks, ref_lps, ref_plps) in zip(ours, ref, strict=True):
        assert list(toks) == list(ref_toks)
        for a, b in ((lps, ref_lps), (plps, ref_plps)):
            assert (a is None) == (b is None)
            for pos_a, pos_b in zip(a or [], b or [], strict=True):
                if pos_a is None:
                    assert pos_b is None
                    continue
                assert pos_a.keys() == pos_b.keys()
                for t in pos_a:
                    assert abs(pos_a[t].logprob - pos_b[t].logprob) <= tol


def test_mixed_batch_tokens_identical_to_tp1(tp1_outputs):
    llm = LLM(MODEL, dtype="float32", max_model_len=512, tensor_parallel_size=2)
    try:
        ours = generate(llm)
    finally:
        llm.close()
    assert_same_outputs(ours, tp1_outputs)


def test_ray_backend_shuts_down_the_ray_it_started():
    """With no Ray of the caller's, the engine starts a local instance and shuts it down when it
    stops: `ladle serve`'s engine ends without the interpreter's teardown
    (lifetime.end_process), so ray's atexit hook never runs there. (Before local_ray below,
    whose ray.init is the caller's and is left alone.)"""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized(), "runs before the module's local_ray fixture"
    llm = LLM(MODEL, dtype="float32", max_model_len=512, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert ray.is_initialized()
        out = llm.generate(["The capital of France is"],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)  # the actors get PYTHONPATH from the engine
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_ray_backend_gives_the_same_tokens_as_mp(local_ray, tp1_outputs, tp, pp):
    """mp -tp 2 equals -tp 1 (above); ray -tp 2, and -pp 2 with the first stage a Ray actor,
    must equal the same outputs."""
    llm = LLM(MODEL, dtype="float32", max_model_len=512, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, distributed_executor_backend="ray")
    try:
        ours = generate(llm)
    finally:
        llm.close()
    assert_same_outputs(ours, tp1_outputs)


def test_killed_worker_fails_requests_and_ends_the_server():
    """SIGKILL of rank 1 mid-stream: the same checks as an engine's death (errors within
    seconds, /health fails, non-zero exit), and neither the engine nor a worker outlives it."""
    server = RemoteServer("--api-key", API_KEY, "--max-model-len", "2048",
                          "--disable-access-log", "-tp", "2", "--distributed-timeout", "30")
    engine_pid = server.engine_pid()
    workers = child_pids(engine_pid)  # rank 1 (plus the spawn resource tracker)
    rank1 = [p for p in workers if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(rank1) == 1, server.log()
    kill_engine_while_serving(server, lambda: rank1[0])
    deadline = time.monotonic() + 10
    while any(is_alive(p) for p in [engine_pid, *workers]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in [engine_pid, *workers] if is_alive(p)], "orphans left"


@pytest.mark.parametrize("kw,message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size: must be an integer >= 1"),
    (dict(tensor_parallel_size=1.5), "tensor_parallel_size: must be an integer >= 1"),
    (dict(distributed_executor_backend="mpi"), "distributed_executor_backend: 'mpi'; accepted"),
    (dict(distributed_timeout=0), "distributed_timeout: must be a positive number"),
    (dict(distributed_timeout=float("inf")), "distributed_timeout: must be a positive number"),
])
def test_bad_distributed_settings_are_errors_naming_the_parameter(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_bad_distributed_flags_are_usage_errors(capsys):
    from ladle.entrypoints.cli import parse_serve_args

    for argv, message in [(["-tp", "0"], "must be >= 1"),
                          (["--distributed-executor-backend", "mpi"], "invalid choice: 'mpi'"),
                          (["--distributed-timeout", "-1"], "distributed_timeout: must be a "
                                                             "positive number of seconds")]:
        with pytest.raises(SystemExit) as e:
            parse_serve_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
