"""Mixture-of-experts families (issue 25): Qwen3-MoE (norm_topk_prob both ways) and Mixtral
against transformers on random-weight float32 checkpoints with 8 experts: greedy tokens equal
to `generate` and logits within float32 rounding, plain, in 16-token prefill chunks, through
prefix-cache hits and with `-tp 2` (the experts' intermediate dimension split across ranks).
The fused experts kernel (runner/csrc/moe.cpp) is what those engines run; it equals its twin,
the per-expert loop, bit for bit. `--quantization int8` keeps the router dense."""

from __future__ import annotations

import pytest
import torch
from test_engine_numerics import reference_logits, run

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.models.moe import MoeConfig, SparseMoeBlock
from ladle.runner import cpu_kernels
from ladle.runner.quant import QuantWeight

# Qwen3-MoE top-4 without norm_topk_prob (transformers' default) and a dense first layer
# (mlp_only_layers), then every second layer sparse (decoder_sparse_step 2: layer 1 only, so
# layer 2 is dense too); Qwen3-MoE top-2 with norm_topk_prob, every layer sparse; Mixtral
# top-2, renormalised (always), with a sliding window of 12 tokens, shorter than every prompt.
CHECKPOINTS = {
    "qwen3_moe-top4": dict(num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[0],
                           decoder_sparse_step=2),
    "qwen3_moe-top2-norm": dict(num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral-top2-window": dict(num_experts_per_tok=2, sliding_window=12),
}
_gen = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (40, 63, 88, 120)]
NUM_DECODE = 32
FP32_TOL = 2e-4  # as tests/test_engine_numerics.py: float32 agrees to rounding
MIN_ROUTING_MARGIN = 1e-3  # router logits: far above their float32 rounding (~1e-6)


def make_moe_checkpoint(name: str, path, **fields):
    """A 3-layer model with 8 experts (`name`: "qwen3_moe-..." or "mixtral-...", with its
    CHECKPOINTS fields; `fields` override them). Weights: N(0, 0.15) matrices and N(0, 0.5)
    embeddings as tests/checkpoints.py, and router rows N(0, 2): router logits far apart, so
    that float32 rounding cannot change which experts a token gets (the test measures the
    margin)."""
    import transformers as tf

    kind, *_ = name.split("-")
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    common.update(CHECKPOINTS.get(name, {}), **fields)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96,
                                moe_intermediate_size=32, num_experts=8, rope_theta=1e6)
        cls = tf.Qwen3MoeForCausalLM
    else:
        cfg = tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=8)
        cls = tf.MixtralForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".gate.weight" in pname and p.shape[0] == 8:  # the router
                p.normal_(0, 2.0)
            elif "experts" in pname or p.dim() == 2:
                p.normal_(0, 0.5 if "embed" in pname else 0.15)
    model = model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, make_moe_checkpoint(request.param, path)


def generate(ref, prompt) -> list[int]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    try:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        torch.set_num_threads(threads)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(checkpoint):
    _, ref = checkpoint
    return [generate(ref, p) for p in PROMPTS]


def engine(path, **kw) -> EngineCore:
    kw.setdefault("kv_cache_memory", "16MB")
    return EngineCore(EngineConfig(model=str(path), dtype="float32", **kw), keep_logits=True)


def assert_matches(ref, prompts, toks, logs, want_toks, tol=FP32_TOL):
    for p, t, ours, want in zip(prompts, toks, logs, want_toks, strict=True):
        assert t == want
        err = (ours - reference_logits(ref, p, t)).abs().max().item()
        assert err <= tol, err


def routing_margin(ref, prompts, outputs) -> float:
    """The smallest gap, over every token of prompt + output and every sparse layer, between
    the k-th and the (k+1)-th router logit in transformers' forward (the softmax keeps their
    order, so this is the margin by which each token's experts are chosen)."""
    gaps = []

    def hook(module, args, out):
        logits = out[0].float().sort(dim=-1, descending=True).values
        gaps.append((logits[:, module.top_k - 1] - logits[:, module.top_k]).min().item())

    routers = [m for n, m in ref.named_modules() if n.endswith("mlp.gate")]
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        for p, t in zip(prompts, outputs, strict=True):
            with torch.no_grad():
                ref(torch.tensor([p + t]))
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


def moe_blocks(eng: EngineCore) -> list[SparseMoeBlock]:
    return [m for m in eng.runner.model.modules() if isinstance(m, SparseMoeBlock)]


def test_greedy_and_logits_match_transformers(checkpoint, expected):
    path, ref = checkpoint
    eng = engine(path)
    blocks = moe_blocks(eng)
    assert blocks and all(b.stacked is not None for b in blocks)  # the fused kernel runs
    toks, logs = run(eng, PROMPTS, max_tokens=NUM_DECODE)
    assert_matches(ref, PROMPTS, toks, logs, expected)
    assert all(len(set(t)) > 4 for t in toks)  # tokens vary, so equality means something
    assert routing_margin(ref, PROMPTS, toks) > MIN_ROUTING_MARGIN


def test_chunked_prefill_and_prefix_cache_hits(checkpoint, expected):
    """16-token prefill chunks, then the same prompts again (hitting the prefix cache) beside a
    prompt that shares 70 tokens with one of them."""
    path, ref = checkpoint
    eng = engine(path, max_num_batched_tokens=16)
    toks, logs = run(eng, PROMPTS, max_tokens=NUM_DECODE)
    assert eng.num_steps >= 26
    assert_matches(ref, PROMPTS, toks, logs, expected)
    hits_before = eng.kv_cache.num_prefix_hits
    shared = PROMPTS[3][:70] + [11, 12, 13, 14, 15]
    toks, logs = run(eng, PROMPTS + [shared], max_tokens=NUM_DECODE, start=100)
    assert eng.kv_cache.num_prefix_hits - hits_before >= 16 * (2 + 3 + 5 + 7 + 4)
    assert_matches(ref, PROMPTS + [shared], toks, logs, expected + [generate(ref, shared)])


def test_tp2_equals_transformers(checkpoint, expected):
    path, ref = checkpoint
    eng = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                  max_model_len=256, tensor_parallel_size=2), keep_logits=True)
    try:
        toks, logs = run(eng, PROMPTS[:2], max_tokens=NUM_DECODE)
    finally:
        eng.close()
    assert_matches(ref, PROMPTS[:2], toks, logs, expected[:2])


def test_stacked_expert_tensors_load_as_per_expert_ones(checkpoint, expected, tmp_path):
    """A checkpoint that stores each layer's experts stacked (transformers 5's in-memory
    layout: experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)) serves the same
    tokens, alone and split over two ranks."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    path, ref = checkpoint
    flat = load_file(path / "model.safetensors")
    stacked, experts = {}, {}
    for name, t in flat.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            stacked[name] = t
    assert experts
    for stem, projs in experts.items():
        stem = stem.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's in-memory name
        gate = projs.get("gate_proj") or projs["w1"]
        up = projs.get("up_proj") or projs["w3"]
        down = projs.get("down_proj") or projs["w2"]
        stacked[f"{stem}.gate_up_proj"] = torch.stack(
            [torch.cat([gate[e], up[e]]) for e in sorted(gate)])
        stacked[f"{stem}.down_proj"] = torch.stack([down[e] for e in sorted(down)])
    save_file(stacked, tmp_path / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    toks, logs = run(engine(tmp_path), PROMPTS[:2], max_tokens=NUM_DECODE)
    assert_matches(ref, PROMPTS[:2], toks, logs, expected[:2])
    eng = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64,
                                  max_model_len=256, tensor_parallel_size=2), keep_logits=True)
    try:
        assert run(eng, PROMPTS[:1], max_tokens=8)[0] == [expected[0][:8]]
    finally:
        eng.close()


# (tokens, experts, top k): one token; a few; enough that the kernel's threads share the
# experts' columns and the combine's tokens; enough rows per expert (> MAX_LINEAR_ROWS) that
# those experts run torch's GEMM, and (> AMX_LINEAR_ROWS) that they do so in bfloat16 on a CPU
# whose kernel runs AMX tiles.
FUSED_CASES = [(1, 8, 2), (3, 64, 8), (40, 64, 8), (40, 8, 2), (300, 8, 2), (90, 16, 4),
               (600, 4, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_experts_equal_the_per_expert_loop(case, dtype, invariant):
    """The kernel and its twin (one GatedMLP call per expert, then the weighted sum in expert
    order) give the same bits, for float32 and bfloat16 routing weights (Mixtral, Qwen3-MoE)."""
    if cpu_kernels.load_cpu_kernels() is None:
        pytest.skip("the CPU kernels are not built here")
    tokens, num_experts, k = case
    torch.manual_seed(tokens * 100 + num_experts + k)
    moe = MoeConfig(num_experts=num_experts, top_k=k, intermediate_size=96, norm_topk_prob=True,
                    float32_weights=dtype == torch.float32, sparse_layers=frozenset([0]))
    block = SparseMoeBlock(128, moe, 96, None).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(tokens, 128).to(dtype)
    before = cpu_kernels.batch_invariant()
    cpu_kernels.set_batch_invariant(invariant)
    try:
        weights, ids = block.route(x)
        want = block.expert_loop(x, weights, ids)
        block.after_load()
        assert block.stacked is not None
        got = block(x)
    finally:
        cpu_kernels.set_batch_invariant(before)
    assert torch.equal(got, want)


def test_int8_keeps_the_router_dense(checkpoint):
    """--quantization int8: the experts' linears are int8, the router stays in the model dtype
    (as published quantized MoE checkpoints keep it), and the experts run the per-expert loop
    over the quantized kernels; the logits stay near the float32 model's."""
    path, _ = checkpoint
    eng = engine(path, quantization="int8")
    blocks = moe_blocks(eng)
    assert blocks
    for b in blocks:
        assert not isinstance(b.gate.weight, QuantWeight)
        assert b.gate.weight.dtype == torch.float32
        assert all(isinstance(e.gate_up_proj.weight, QuantWeight)
                   and isinstance(e.down_proj.weight, QuantWeight) for e in b.experts)
        assert b.stacked is None
    _, logs = run(eng, PROMPTS, max_tokens=4)
    _, ref_logs = run(engine(path), PROMPTS, max_tokens=4)
    # W8A8 moves the first step's logits (measured: 1-7% of their spread on these random
    # weights, whose 0.15-scale matrices amplify rounding, and up to 29% on a prompt where the
    # rounding flips a near-tie of the dense router to another expert); a broken expert path
    # would move them by the whole spread on every prompt. So: the median prompt within 10%.
    moved = sorted(((ours[0] - theirs[0]).abs().max() / (theirs[0].max() - theirs[0].min())).item()
                   for ours, theirs in zip(logs, ref_logs, strict=True))
    assert moved[len(moved) // 2] < 0.1, moved
