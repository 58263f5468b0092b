"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next GGUF files (llama.cpp's qwen35 / qwen35moe /
qwen3next): small random checkpoints converted by llama.cpp's own converter
(tests/gguf_convert.py), with the multi-token-prediction layer it appends by default, come back
as exactly the checkpoint's tensors (the converter's value-head reordering, A = -exp(A_log),
the 1 + w norms and the squeezed conv undone; Qwen3-Next's in_proj_qkvz as the in_proj_qkv and
in_proj_z it was split into), generate the checkpoint's greedy tokens, and as Q8_0 keep their
blocks with the value-head rows moved back and out_proj's input put in the file's column
order."""

from __future__ import annotations

import json
from pathlib import Path

import gguf_convert
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hybrid import random_model

from ladle import LLM, SamplingParams
from ladle.models.gguf import hf_config_from_gguf, iter_hf_tensors, open_gguf
from ladle.models.gguf.quantized import _tiled_value_order
from ladle.models.loader import ModelLoadError, load_model, read_hf_config
from ladle.runner import quant as Q

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Fewer key heads than value heads, as every published Qwen3.5: the converter reorders the
# value heads, which the load must undo.
DIMS = dict(vocab_size=151936, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
            tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
PROMPTS = [[1000 + 7 * i for i in range(n)] for n in (5, 40)]


def make_checkpoint(arch: str, path: Path) -> None:
    """A 4-layer model (3 linear-attention layers, then full attention) with Qwen's tokenizer,
    plus an MTP head as published checkpoints carry it (`mtp.*`, mtp_num_hidden_layers 1:
    the converter appends it as a fifth block, which ladle skips)."""
    import transformers as tf

    if arch == "qwen3_5":
        cfg, cls = tf.Qwen3_5TextConfig(**DIMS, intermediate_size=96), tf.Qwen3_5ForCausalLM
    elif arch == "qwen3_next":  # every layer sparse, as every published Qwen3-Next
        cfg = tf.Qwen3NextConfig(**DIMS, **EXPERTS, intermediate_size=96)
        cls = tf.Qwen3NextForCausalLM
    else:
        cfg, cls = tf.Qwen3_5MoeTextConfig(**DIMS, **EXPERTS), tf.Qwen3_5MoeForCausalLM
    random_model(cls, cfg).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    mtp = {f"mtp.layers.0.{name.removeprefix('model.layers.3.')}": t.clone()
           for name, t in tensors.items() if name.startswith("model.layers.3.")}
    hidden = DIMS["hidden_size"]
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.1
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    gguf_convert.add_qwen_tokenizer(path)


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory) -> tuple[str, Path, Path, Path]:
    """(arch, checkpoint dir, its f32 GGUF, its Q8_0 GGUF)."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return (request.param, path, gguf_convert.convert_cached(path, "f32"),
            gguf_convert.convert_cached(path, "q8_0"))


def stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert tensors stacked per layer and projection, as the GGUF
    mapping yields them."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            stem, rest = name.split(".mlp.experts.")
            index, proj = rest.split(".", 1)
            experts.setdefault(f"{stem}.mlp.experts.{proj}", {})[int(index)] = t
        else:
            out[name] = t
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[i] for i in sorted(by_index)])
    return out


def split_qkvz(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz (rows grouped by key head: [q_j | k_j | v_j | z_j]) as the
    converter splits it: in_proj_qkv [all q | all k | all v] and in_proj_z."""
    nk, dk = DIMS["linear_num_key_heads"], DIMS["linear_key_head_dim"]
    rv = DIMS["linear_num_value_heads"] // nk * DIMS["linear_value_head_dim"]
    out = {}
    for name, t in tensors.items():
        if not name.endswith("in_proj_qkvz.weight"):
            out[name] = t
            continue
        q, k, v, z = t.reshape(nk, 2 * dk + 2 * rv, -1).split([dk, dk, rv, rv], dim=1)
        stem = name.removesuffix("in_proj_qkvz.weight")
        out[f"{stem}in_proj_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
        out[f"{stem}in_proj_z.weight"] = z.reshape(-1, t.shape[1])
    return out


def test_the_checkpoint_comes_back(converted):
    """The config (the linear layers' heads and pattern, partial rotary, experts and shared
    expert, the MTP block not counted) and every tensor: exactly, but the 1 + w norms, whose
    float32 w + 1 - 1 rounds (within 1e-7); the MTP block's tensors are skipped."""
    arch, path, f32, _ = converted
    g = open_gguf(f32)
    assert g.metadata[f"{g.architecture}.nextn_predict_layers"] == 1
    assert any(name.startswith("blk.4.") for name in g.tensors)  # the MTP block, appended
    config = hf_config_from_gguf(g)
    want = json.loads((path / "config.json").read_text())
    for key in ("num_hidden_layers", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "layer_types", "head_dim", "intermediate_size", *EXPERTS):
        if key in want:
            assert config[key] == want[key], key
    assert config["partial_rotary_factor"] == want["rope_parameters"]["partial_rotary_factor"]
    expected = split_qkvz(stacked_experts({
        n: t for n, t in load_file(path / "model.safetensors").items()
        if not n.startswith("mtp.")}))
    got = {name: load() for name, load in iter_hf_tensors(g, config)}
    assert set(got) == set(expected)
    for name, t in got.items():
        assert t.shape == expected[name].shape, name
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            torch.testing.assert_close(t, expected[name], rtol=0, atol=1e-7)
        else:
            assert torch.equal(t, expected[name]), name


def greedy(path: Path, **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MB", **kw)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    finally:
        llm.close()


def test_the_gguf_generates_the_checkpoints_tokens(converted):
    arch, path, f32, _ = converted
    tokens = greedy(path)
    assert greedy(f32) == tokens
    if arch == "qwen3_next":  # its mixed layout's rows as each rank's share (checkpoint_slice)
        assert greedy(f32, tensor_parallel_size=2) == tokens


def test_q8_0_blocks_keep_the_value_heads_in_order(converted):
    """A Q8_0 file: every linear keeps its blocks; the linear layers' input projections hold
    their rows in HF's order (each equal to the same file dequantized and reordered by the
    dense load), out_proj keeps the file's column order and its input is gathered into it
    (the dense weight's columns in that order are the blocks'); and the model's next-token
    log-probabilities stay within int8 activations' error of the dense load's: a mean
    |difference| of 0.05 (Qwen3.5) and 0.24 (Qwen3.5-MoE, whose routing int8 activations flip
    at some positions; Qwen3-Next 0.23) where out_proj's gather or the rows' reordering left
    out gives 1.0-1.2. (Qwen3-Next's converter reorders no value heads: its blocks stay in the
    file's order, out_proj's columns too.)"""
    arch, _, _, q8 = converted
    config = read_hf_config(q8)
    kept = load_model(q8, config, torch.float32, torch.device("cpu"))
    dense = load_model(q8, config, torch.float32, torch.device("cpu"), quantization="none")
    dense_params = dict(dense.named_parameters())
    tiled = arch != "qwen3_next"
    order = _tiled_value_order(config) if tiled else None
    projections = ("in_proj_qkv", "in_proj_z") + (
        ("in_proj_b", "in_proj_a") if tiled else ("in_proj_ba",))
    checked = 0
    for name, module in kept.named_modules():
        if not name.endswith("linear_attn"):
            continue
        for proj in projections:
            w = getattr(module, proj).weight
            assert isinstance(w, Q.QuantWeight) and w.describe().startswith("Q8_0"), proj
            assert torch.equal(w.dequantize(), dense_params[f"{name}.{proj}.weight"]), proj
        out = module.out_proj.weight
        assert isinstance(out, Q.QuantWeight)
        if not tiled:
            assert module.out_columns is None
            assert torch.equal(out.dequantize(), dense_params[f"{name}.out_proj.weight"])
            checked += 1
            continue
        assert torch.equal(module.out_columns, order)
        assert torch.equal(out.dequantize(),
                           dense_params[f"{name}.out_proj.weight"].index_select(1, order))
        checked += 1
    assert checked == 3
    prompt = {"prompt_token_ids": PROMPTS[1]}
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs = {}
    for q in ("gguf", "none"):
        llm = LLM(str(q8), dtype="float32", kv_cache_memory="64MB", quantization=q)
        try:
            logprobs[q] = llm.generate([prompt], sp)[0].prompt_logprobs
        finally:
            llm.close()
    ids = PROMPTS[1]
    diffs = [abs(logprobs["gguf"][i][ids[i]].logprob - logprobs["none"][i][ids[i]].logprob)
             for i in range(1, len(ids))]
    assert sum(diffs) / len(diffs) < 0.5, diffs


@pytest.mark.parametrize("change, fragments", [
    ({"ssm.time_step_rank": 3}, ("ssm.group_count 2, ssm.time_step_rank 3",
                                 "a multiple of the key heads")),
    ({"ssm.inner_size": None}, ("metadata {arch}", ".ssm.inner_size is missing")),
    ({"attention.recurrent_layers": [True, False]}, ("recurrent_layers must list the 4 layers",)),
    ({"nextn_predict_layers": 5}, ("nextn_predict_layers is 5", "0 to block_count - 1 (4)")),
], ids=["heads", "missing", "layers", "nextn"])
def test_metadata_that_does_not_describe_the_model_is_refused(converted, change, fragments):
    """A file whose linear-layer metadata cannot be a Qwen3.5 or Qwen3-Next is a
    ModelLoadError naming the file and the key, not a model built wrong."""
    _, _, f32, _ = converted
    g = open_gguf(f32)
    for key, value in change.items():
        if value is None:
            del g.metadata[f"{g.architecture}.{key}"]
        else:
            g.metadata[f"{g.architecture}.{key}"] = value
    with pytest.raises(ModelLoadError) as e:
        hf_config_from_gguf(g)
    assert str(f32) in str(e.value)
    for fragment in fragments:
        assert fragment.format(arch=g.architecture) in str(e.value)
