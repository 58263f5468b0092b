"""gpt-oss (issue 25) against transformers on a random-weight float32 checkpoint: attention sinks,
alternating sliding (12-token window) and full layers with prompts of 40-120 tokens, YaRN rope
past its original context, q/k/v/o biases, 8 experts top-2 with a router bias and expert biases,
the interleaved and clamped SwiGLU. Greedy tokens equal to `generate` and logits within float32
rounding, plain, in 16-token prefill chunks with prefix-cache hits, and with `-tp 2`."""

from __future__ import annotations

import pytest
import torch
from test_engine_numerics import reference_logits, run
from test_moe import FP32_TOL, NUM_DECODE, PROMPTS, assert_matches, engine, generate

from ladle.config import EngineConfig
from ladle.engine.core import EngineCore
from ladle.models.loader import ModelLoadError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Weights: N(0, 0.15) matrices, N(0, 0.5) embeddings, N(0, 0.1) biases; sinks N(0, 1) so
    they take a visible share of each softmax; router rows N(0, 2), router bias N(0, 1), so
    routing has margins far above float32 rounding (test_moe measures them the same way); SwiGLU
    limit 1.5, so the clamps bite."""
    import transformers as tf

    path = tmp_path_factory.mktemp("gpt_oss")
    cfg = tf.GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=12, max_position_embeddings=512,
        swiglu_limit=1.5, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = init_weights(tf.GptOssForCausalLM(cfg)).eval()
    model.save_pretrained(path)
    return path, model


def init_weights(model):
    """The fixture's weight spread (see `checkpoint`), in the model's parameter order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "router.bias")):
                p.normal_(0, 1.0)
            elif name.endswith("router.weight"):
                p.normal_(0, 2.0)
            elif "norm" in name:
                continue
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.5 if "embed" in name else 0.15)
    return model


@pytest.fixture(scope="module")
def expected(checkpoint):
    _, ref = checkpoint
    return [generate(ref, p) for p in PROMPTS]


def test_greedy_and_logits_match_transformers(checkpoint, expected):
    path, ref = checkpoint
    toks, logs = run(engine(path), PROMPTS, max_tokens=NUM_DECODE)
    assert_matches(ref, PROMPTS, toks, logs, expected)
    assert all(len(set(t)) > 4 for t in toks)  # tokens vary, so equality means something


# 16-token chunks with sinks and windows round further from transformers' one-pass prefill:
# measured up to 1.9e-4 with the torch decode path and 2.5e-4 with the C++ kernel, on logits
# of up to |5| (5e-5 relative; unchunked, both stay under 1e-4).
CHUNKED_TOL = 4e-4


def test_chunked_prefill_and_prefix_cache_hits(checkpoint, expected):
    path, ref = checkpoint
    eng = engine(path, max_num_batched_tokens=16)
    toks, logs = run(eng, PROMPTS, max_tokens=NUM_DECODE)
    assert_matches(ref, PROMPTS, toks, logs, expected, CHUNKED_TOL)
    hits_before = eng.kv_cache.num_prefix_hits
    toks, logs = run(eng, PROMPTS, max_tokens=NUM_DECODE, start=100)
    assert eng.kv_cache.num_prefix_hits - hits_before >= 16 * (2 + 3 + 5 + 7)
    assert_matches(ref, PROMPTS, toks, logs, expected, CHUNKED_TOL)


def test_tp2_equals_transformers(checkpoint, expected):
    path, ref = checkpoint
    eng = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                  max_model_len=256, tensor_parallel_size=2), keep_logits=True)
    try:
        toks, logs = run(eng, PROMPTS[:2], max_tokens=NUM_DECODE)
    finally:
        eng.close()
    assert_matches(ref, PROMPTS[:2], toks, logs, expected[:2])


def test_sinks_matter(checkpoint):
    """The sinks are read and used: zeroing them in the reference moves its logits far beyond
    the tolerance ladle is held to."""
    _, ref = checkpoint
    import copy

    plain = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.endswith("sinks"):
                p.fill_(-1e4)  # exp(-1e4) = 0: no sink
    prompt, tokens = PROMPTS[0], [5, 6, 7]
    diff = (reference_logits(ref, prompt, tokens) - reference_logits(plain, prompt, tokens))
    assert diff.abs().max().item() > 100 * FP32_TOL


def to_mxfp4(w: torch.Tensor):
    """Round w (E, out, in) to MXFP4 as the published files hold it: per 32 inputs a power-of-two
    scale 2^(s - 127) that brings the block within +-6, each value to the nearest e2m1 value.
    Returns (blocks (E, out, in / 32, 16) uint8, low nibble first; scales (E, out, in / 32)
    uint8; the float values those encode)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    E, R, C = w.shape
    g = w.float().reshape(E, R, C // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    scaled = g / torch.exp2(exp)[..., None]
    idx = (scaled.abs()[..., None] - grid).abs().argmin(-1)
    negative = scaled < 0
    code = (idx + 8 * negative).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    values = torch.where(negative, -grid[idx], grid[idx]) * torch.exp2(exp)[..., None]
    return blocks, (exp + 127).to(torch.uint8), values.reshape(E, R, C)


def mxfp4_tensors(flat: dict) -> tuple[dict, dict]:
    """A checkpoint's tensors with the experts rounded to MXFP4: (as the published files store
    them, `*_blocks` and `*_scales`; the same with the float values those blocks encode)."""
    mxfp4, dense = dict(flat), dict(flat)
    for name, t in flat.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, values = to_mxfp4(t.transpose(1, 2))  # stored (E, in, out)
            del mxfp4[name]
            mxfp4[name + "_blocks"], mxfp4[name + "_scales"] = blocks, scales
            dense[name] = values.transpose(1, 2).contiguous()
    return mxfp4, dense


def test_mxfp4_experts_load_as_the_values_they_encode(checkpoint, tmp_path):
    """The published files' MXFP4 experts (config.json with their quantization_config, as
    published). Dequantized at load (`--quantization none`), a checkpoint holding them as blocks
    and scales runs exactly (bit for bit) as one holding the float values those blocks encode.
    By default they stay 4-bit: every expert's gate|up and down are QuantWeights of MXFP4 rows
    repacked from the checkpoint's, and predict as the dense values do up to the activations'
    int8 rounding (gate and up, or two experts, swapped would not)."""
    import json
    import shutil

    from prompt_logits import logit_agreement
    from safetensors.torch import load_file, save_file

    from ladle.models.gpt_oss import GptOssMoe
    from ladle.runner.quant import QuantWeight

    path, _ = checkpoint
    mxfp4, dense = mxfp4_tensors(load_file(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    published = {**config, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}}
    runs = []
    for kind, tensors, cfg in (("mxfp4", mxfp4, published), ("dense", dense, config)):
        (tmp_path / kind).mkdir()
        save_file(tensors, tmp_path / kind / "model.safetensors")
        (tmp_path / kind / "config.json").write_text(json.dumps(cfg))
        runs.append(run(engine(tmp_path / kind, quantization="none"), PROMPTS[:2],
                        max_tokens=16))
    (tok_q, log_q), (tok_d, log_d) = runs
    assert tok_q == tok_d
    assert all(torch.equal(a, b) for a, b in zip(log_q, log_d, strict=True))

    # Kept 4-bit: ladle's logits at each greedy step against transformers teacher-forced on
    # the same tokens with the dense values, over 4 prompts x 16 steps.
    from transformers import AutoModelForCausalLM

    dense_ref = AutoModelForCausalLM.from_pretrained(tmp_path / "dense",
                                                     dtype=torch.float32).eval()
    eng = engine(tmp_path / "mxfp4")
    blocks = [m for m in eng.runner.model.modules() if isinstance(m, GptOssMoe)]
    assert len(blocks) == 4
    for b in blocks:
        for e in b.experts:
            for w in (e.gate_up_proj.weight, e.down_proj.weight):
                assert isinstance(w, QuantWeight)
                assert {p.name() for p in w.parts} == {"MXFP4"}
    toks, logs = run(eng, PROMPTS, max_tokens=16)
    got = torch.cat(logs)
    want = torch.cat([reference_logits(dense_ref, p, t)
                      for p, t in zip(PROMPTS, toks, strict=True)])
    diff, agree = logit_agreement(got, want)
    assert diff < 0.12 and agree >= 0.85

    # Scales that do not match their blocks: a startup error naming the file and the tensor,
    # whether the blocks are kept or dequantized.
    name = next(n for n in mxfp4 if n.endswith("down_proj_scales"))
    mxfp4[name] = mxfp4[name][..., :-1].contiguous()
    (tmp_path / "broken").mkdir()
    save_file(mxfp4, tmp_path / "broken" / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path / "broken" / "config.json")
    for quantization in (None, "none"):
        with pytest.raises(ModelLoadError) as err:
            engine(tmp_path / "broken", quantization=quantization)
        assert str(tmp_path / "broken") in str(err.value)
        assert name.removesuffix("_scales") in str(err.value) and "accepted" in str(err.value)
