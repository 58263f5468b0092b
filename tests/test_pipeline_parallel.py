"""Pipeline parallelism on CPU (gloo): -pp 2 (and -pp 2 -tp 2) against -pp 1, which the family
tests check against transformers. Each stage holds only its layers' weights and KV cache; the
engine process is the last stage and samples.

- Greedy tokens equal and per-step logits within 1e-5 of the largest |logit| (float32;
  measured equal to the bit on an AVX2 build; 2.7e-6 for Qwen3-MoE on an AVX-512 build, where
  the kernels sum a 1-2-row linear in another order than a larger one, and -pp 2 puts other
  rows beside a request than -pp 1 does), and seeded sampling with penalties, logit_bias, top-k/top-p, min_tokens and
  logprobs (within 1e-5) token-identical, for a dense family, Gemma 3 (sliding windows, its own
  embedding scale and rope per layer type), Qwen3-MoE (experts), OLMo 2 (no residual stream
  between layers) and a Qwen3.5 hybrid (linear-attention state slots), through 16-token prefill
  chunks and prefix-cache hits.
- A mixed batch (penalties, logit_bias, json_schema, logprobs, prompt logprobs, seeds) gives
  the same tokens as -pp 1, logprobs within 1e-5, with -pp 2 and -pp 2 -tp 2.
- A layer partition that does not fit is an error naming the flag; a killed stage worker ends
  `ladle serve` with no orphans within 10 s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from checkpoints import make_checkpoint, make_gemma_checkpoint
from test_dense_families import make_family_checkpoint
from test_engine_numerics import run
from test_hybrid import make_hybrid_checkpoint
from test_moe import make_moe_checkpoint
from test_server import API_KEY, MODEL, RemoteServer, child_pids, is_alive
from test_server_engine_death import kill_engine_while_serving
from test_tensor_parallel import assert_same_outputs, generate

from ladle.config import EngineConfig
from ladle.distributed.pipeline import stage_layers
from ladle.engine.core import EngineCore
from ladle.llm import LLM
from ladle.messages import EngineCoreRequest
from ladle.sampling_params import SamplingParams

_gen = torch.Generator().manual_seed(5)
# The third and fourth share a 40-token prefix with the first (prefix-cache hits on blocks of
# 16); every prompt is longer than one 16-token chunk.
_BASE = torch.randint(3, 500, (40,), generator=_gen).tolist()
PROMPTS = [_BASE, torch.randint(3, 500, (57,), generator=_gen).tolist(),
           _BASE + [7, 8, 9], _BASE + torch.randint(3, 500, (30,), generator=_gen).tolist()]
NUM_DECODE = 12
PP_TOL = 1e-5  # relative to the step's largest |logit|; see the module's first point


FAMILIES = {
    "qwen3": lambda p: make_checkpoint("qwen3", p, torch.float32),  # 2 layers: 1 + 1
    "gemma3": lambda p: make_gemma_checkpoint("gemma3", p, sliding_window=16, seed=1),
    "qwen3_moe": lambda p: make_moe_checkpoint("qwen3_moe-top4", p),  # 3 layers: 2 + 1
    "olmo2": lambda p: make_family_checkpoint("olmo2", p),
    "qwen3_5": lambda p: make_hybrid_checkpoint("qwen3_5", p),  # linear layers 0-2, full 3
}


def engine(path, pp: int, tp: int = 1, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="16MB",
                                   max_model_len=512, max_num_batched_tokens=16,
                                   pipeline_parallel_size=pp, tensor_parallel_size=tp, **kw),
                      keep_logits=True)


def run_staggered(eng: EngineCore) -> tuple[list, list]:
    """The first prompt alone until it is cached, then the rest together (16-token chunks,
    prefix hits for the prompts that share its blocks); greedy tokens and logits."""
    tok0, log0 = run(eng, PROMPTS[:1], max_tokens=NUM_DECODE)
    toks, logs = run(eng, PROMPTS[1:], max_tokens=NUM_DECODE, start=1)
    return tok0 + toks, log0 + logs


# Seeded sampling with penalties, logit_bias, top-k/top-p, min_tokens and logprobs, one per
# prompt, all in one batch (json_schema needs a tokenizer: the mixed-batch test below has it).
SAMPLED = [
    SamplingParams(temperature=0.9, seed=7, max_tokens=NUM_DECODE, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=11, max_tokens=NUM_DECODE, logit_bias={15: 5.0},
                   logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, max_tokens=NUM_DECODE, top_k=20, top_p=0.9,
                   min_tokens=NUM_DECODE, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=NUM_DECODE, logprobs=3, ignore_eos=True),
]


def run_sampled(eng: EngineCore) -> tuple[dict, dict]:
    """SAMPLED over PROMPTS as one batch: tokens and every logprob value by request."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, SAMPLED, strict=True)):
        eng.add_request(EngineCoreRequest(f"s{i}", prompt, params, [], 0.0))
    tokens: dict[str, list[int]] = {}
    values: dict[str, list[float]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.logprobs is not None:
                values.setdefault(o.req_id, []).extend(
                    [*o.logprobs.sampled_values, *(v for row in o.logprobs.values for v in row)])
    return tokens, values


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pp2_equals_pp1(family, tmp_path):
    FAMILIES[family](tmp_path)
    results = {}
    for pp in (1, 2):
        eng = engine(tmp_path, pp, enable_prefix_caching=True)
        try:
            results[pp] = (*run_staggered(eng), *run_sampled(eng))
            caches = eng.runner.kv_caches
            held = [c is not None for c in caches]
            if pp == 1:
                assert all(held)
            else:  # this process is the last stage: its layers only
                n = len(caches)
                assert held == [i >= n - n // 2 for i in range(n)], held
        finally:
            eng.close()
    (tok1, log1, sampled1, lp1), (tok2, log2, sampled2, lp2) = results[1], results[2]
    assert tok2 == tok1
    for a, b in zip(log1, log2, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= PP_TOL * max(1.0, a.abs().max().item())
    assert sampled2 == sampled1 and all(len(t) == NUM_DECODE for t in sampled1.values())
    assert lp2.keys() == lp1.keys() == {"s1", "s3"}
    for req_id, values in lp1.items():
        assert max(abs(a - b) for a, b in zip(values, lp2[req_id], strict=True)) <= 1e-5


@pytest.fixture(scope="module")
def pp1_outputs():
    llm = LLM(MODEL, dtype="float32", max_model_len=512)
    try:
        return generate(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
def test_mixed_batch_tokens_identical_to_pp1(pp1_outputs, pp, tp):
    llm = LLM(MODEL, dtype="float32", max_model_len=512, pipeline_parallel_size=pp,
              tensor_parallel_size=tp)
    try:
        ours = generate(llm)
    finally:
        llm.close()
    assert_same_outputs(ours, pp1_outputs, tol=1e-5)


def test_stage_layers_split_and_partition():
    assert stage_layers(7, 2) == [range(0, 4), range(4, 7)]
    assert stage_layers(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert stage_layers(6, 2, [1, 5]) == [range(0, 1), range(1, 6)]
    with pytest.raises(ValueError, match=r"pp_layer_partition: \[3, 4\] must give 2 stages .* "
                                         "summing to the model's 6 layers"):
        stage_layers(6, 2, [3, 4])
    with pytest.raises(ValueError, match="pipeline_parallel_size: 3 stages, but the model has "
                                         "only 2 layers"):
        stage_layers(2, 3)


def test_uneven_partition_matches(tmp_path):
    """--pp-layer-partition 1,3 on a 4-layer model: stage 0 holds one layer, this process
    three; same greedy tokens as -pp 1."""
    make_gemma_checkpoint("gemma3", tmp_path, sliding_window=16, seed=1)
    out = {}
    for pp, part in ((1, None), (2, [1, 3])):
        eng = engine(tmp_path, pp, pp_layer_partition=part)
        try:
            out[pp] = run_staggered(eng)[0]
            if pp == 2:
                assert [c is not None for c in eng.runner.kv_caches] == [False, True, True, True]
        finally:
            eng.close()
    assert out[2] == out[1]


@pytest.mark.parametrize("kw,message", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size: must be an integer >= 1"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=[4]),
     r"pp_layer_partition: \[4\]; accepted: one number of layers \(>= 1\) per pipeline stage"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=[0, 4]), "pp_layer_partition"),
])
def test_bad_pipeline_settings_name_the_parameter(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_bad_partition_flag_is_a_usage_error(capsys):
    from ladle.entrypoints.cli import parse_serve_args

    for argv, message in [(["-pp", "0"], "must be >= 1"),
                          (["--pp-layer-partition", "2,x"], "layers per stage as positive")]:
        with pytest.raises(SystemExit) as e:
            parse_serve_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_killed_stage_worker_ends_the_server():
    """SIGKILL of the first stage's worker mid-stream: requests fail within seconds, /health
    fails, and neither the engine nor a worker outlives it (10 s)."""
    server = RemoteServer("--api-key", API_KEY, "--max-model-len", "2048",
                          "--disable-access-log", "-pp", "2", "--distributed-timeout", "30")
    engine_pid = server.engine_pid()
    workers = child_pids(engine_pid)
    stage0 = [p for p in workers if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(stage0) == 1, server.log()
    kill_engine_while_serving(server, lambda: stage0[0])
    deadline = time.monotonic() + 10
    while any(is_alive(p) for p in [engine_pid, *workers]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in [engine_pid, *workers] if is_alive(p)], "orphans left"
