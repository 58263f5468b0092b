"""GGUF files of mixture-of-experts models (issue 25): Qwen3-MoE (`qwen3moe`) and Mixtral (llama.cpp's
`llama` with `expert_count`), tiny random checkpoints with 8 experts and top-2 routing converted by
llama.cpp's own converter. The file's stacked experts (ffn_{gate,up,down}_exps) come back as the
checkpoint's per-expert tensors; float32 files generate transformers' tokens through the fused
experts kernel; a Q8_0 file keeps every expert's blocks (its own rows of the stacked tensor) and
predicts like transformers on the same dequantized weights; K-quant experts (Q4_K, Q6_K) are
sliced by expert too; a file ladle cannot represent fails at start with the file and key named."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import gguf_convert
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf import random_rows
from test_moe import MIN_ROUTING_MARGIN, make_moe_checkpoint, routing_margin

from ladle import LLM, SamplingParams
from ladle.models.gguf import hf_config_from_gguf, iter_hf_tensors, open_gguf
from ladle.models.gguf.quantized import WIDENED
from ladle.models.loader import ModelLoadError, check_checkpoint, load_model, read_hf_config
from ladle.models.moe import SparseMoeBlock
from ladle.runner import cpu_kernels
from ladle.runner import quant as Q
from ladle.runner.quant import QuantWeight

T = gguf.GGMLQuantizationType
_gen = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (40, 77, 120)]
NUM_DECODE = 24
# What llama.cpp's graphs assume for both architectures: a softmax over every expert, the top k
# renormalised, every layer sparse. The checkpoints are made so (Qwen3-MoE's norm_topk_prob,
# which transformers defaults to false, set), so that transformers runs what the file means.
CHECKPOINTS = {
    "qwen3moe": ("qwen3_moe-gguf", dict(vocab_size=151936, num_experts_per_tok=2,
                                        norm_topk_prob=True)),
    "mixtral": ("mixtral-gguf", dict(vocab_size=32000, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (HF checkpoint dir, its GGUF by convert_hf_to_gguf.py): "qwen3moe" and
    "mixtral" as f32, "qwen3moe-q8_0" as Q8_0 (router and norms stay F32 there)."""
    root = tmp_path_factory.mktemp("gguf-moe")
    out = {}
    for arch, (name, fields) in CHECKPOINTS.items():
        path = root / arch
        path.mkdir()
        if arch == "qwen3moe":
            gguf_convert.add_qwen_tokenizer(path)
        else:
            gguf_convert.add_llama2_tokenizer(path)
        make_moe_checkpoint(name, path, **fields)
        out[arch] = path, gguf_convert.convert_cached(path, "f32")
    out["qwen3moe-q8_0"] = root / "qwen3moe", gguf_convert.convert_cached(root / "qwen3moe",
                                                                          "q8_0")
    return out


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stacked `...mlp.experts.{proj}.weight` (E, rows, cols) as the published per-expert
    tensors (`...mlp.experts.{e}.{proj}.weight`; Mixtral's checkpoints say block_sparse_moe and
    w1/w3/w2)."""
    out = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*)\.mlp\.experts\.(\w+)\.weight", name)
        if m is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            out[f"{m[1]}.mlp.experts.{e}.{m[2]}.weight"] = t[e]
    return out


def as_checkpoint_names(tensors: dict[str, torch.Tensor], mixtral: bool) -> dict:
    if not mixtral:
        return tensors
    renames = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
               (".down_proj.", ".w2."))
    out = {}
    for name, t in tensors.items():
        for old, new in renames:
            name = name.replace(old, new)
        out[name] = t
    return out


def hf_greedy(ref, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [ref.generate(torch.tensor([p]), max_new_tokens=NUM_DECODE, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def moe_blocks(llm: LLM) -> list[SparseMoeBlock]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]


# ---- the converted file is the checkpoint ----------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_converted_checkpoint_comes_back_exactly(converted, arch):
    """Config from the metadata (experts, top k, an expert's size; llama.cpp's fixed routing)
    and every tensor, the stacked experts split per expert, equal to the checkpoint's."""
    hf_dir, gguf_path = converted[arch]
    model = open_gguf(gguf_path)
    config = hf_config_from_gguf(model)
    hf = json.loads((hf_dir / "config.json").read_text())
    fields = ["architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "num_experts_per_tok",
              "intermediate_size"]
    if arch == "qwen3moe":
        fields += ["head_dim", "moe_intermediate_size", "norm_topk_prob",
                   "decoder_sparse_step", "mlp_only_layers"]
        # transformers 5 writes num_local_experts; published configs say num_experts.
        assert config["num_experts"] == hf.get("num_experts", hf.get("num_local_experts")) == 8
    else:
        assert model.architecture == "llama"
        assert config["num_local_experts"] == hf["num_local_experts"] == 8
    assert {k: config[k] for k in fields} == {k: hf[k] for k in fields}
    assert config["rope_theta"] == hf["rope_parameters"]["rope_theta"]
    assert config["rope_scaling"] is None and not config.get("sliding_window")

    expected = load_file(hf_dir / "model.safetensors")
    loaded = {name: load() for name, load in iter_hf_tensors(model, config)}
    assert loaded["model.layers.0.mlp.experts.gate_proj.weight"].shape == (8, 32, 64)
    assert loaded["model.layers.0.mlp.experts.down_proj.weight"].shape == (8, 64, 32)
    got = as_checkpoint_names(per_expert(loaded), arch == "mixtral")
    assert sorted(got) == sorted(expected)  # each once, none missing
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


# ---- generation ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_f32_gguf_generates_the_checkpoints_tokens(converted, arch):
    """ladle on the f32 file (float32; the experts stacked after load for the fused kernel)
    against transformers' greedy decoding of the checkpoint it was converted from."""
    from transformers import AutoModelForCausalLM

    hf_dir, gguf_path = converted[arch]
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    want = hf_greedy(ref, PROMPTS)
    llm = LLM(str(gguf_path), dtype="float32", max_num_seqs=4, kv_cache_memory="32MB")
    try:
        blocks = moe_blocks(llm)
        assert len(blocks) == 3 and all(b.stacked is not None for b in blocks)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=NUM_DECODE, ignore_eos=True))
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.close()
    assert got == want
    assert all(len(set(t)) > 4 for t in got)  # tokens vary, so equality means something
    assert routing_margin(ref, PROMPTS, got) > MIN_ROUTING_MARGIN


def dequantized_reference(gguf_path: Path, hf_dir: Path, out_dir: Path):
    """transformers' model of the file's weights, dequantized (float32): the checkpoint's config
    with the GGUF's tensors, saved per expert as published and loaded back."""
    from transformers import AutoModelForCausalLM

    model = open_gguf(gguf_path)
    tensors = per_expert({name: load() for name, load in
                          iter_hf_tensors(model, hf_config_from_gguf(model))})
    out_dir.mkdir()
    shutil.copy(hf_dir / "config.json", out_dir / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def test_q8_0_experts_run_their_blocks(converted, tmp_path):
    """The Q8_0 file served as users run it (blocks kept): every expert's gate|up and down are
    QuantWeights of its own Q8_0 rows (views of the layer's stacked blocks, which one
    quant.cpp call per layer runs); the router stays a dense float32 parameter. Teacher-forced over 120 tokens against
    transformers' float32 run of the same dequantized weights, as test_gguf.py's Q8_0 files:
    the logits differ only by the activations' int8 rounding; an expert given another's rows,
    or gate and up swapped, would differ by the logits' whole size."""
    from prompt_logits import logit_agreement, prompt_logits

    hf_dir, gguf_path = converted["qwen3moe-q8_0"]
    ref = dequantized_reference(gguf_path, hf_dir, tmp_path / "dequantized")
    ids = PROMPTS[2]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(gguf_path), dtype="float32", enable_prefix_caching=False,
              kv_cache_memory="32MB")
    try:
        blocks = moe_blocks(llm)
        assert len(blocks) == 3
        for b in blocks:
            assert b.stacked is None and b.quant_stacked is not None
            assert isinstance(b.gate.weight, torch.nn.Parameter)
            assert b.gate.weight.dtype == torch.float32
            for e in b.experts:
                for w in (e.gate_up_proj.weight, e.down_proj.weight):
                    assert isinstance(w, QuantWeight)
                    assert {p.name() for p in w.parts} == {"Q8_0"}
        got = prompt_logits(llm, ids)
    finally:
        llm.close()
    diff, agree = logit_agreement(got, want)
    assert diff < 0.05 and agree > 0.9


# ---- files written here: K-quant experts, and what is refused ---------------------------------

HIDDEN, EXPERT_SIZE, NUM_EXPERTS = 64, 32, 4


def write_qwen3moe(path: Path, *, hidden: int = HIDDEN, expert_size: int = EXPERT_SIZE,
                   types: dict[str, T] | None = None, drop_keys: tuple[str, ...] = (),
                   metadata: dict[str, int] | None = None,
                   shapes: dict[str, tuple | None] | None = None) -> Path:
    """A one-layer qwen3moe GGUF written from scratch, as llama.cpp's qwen3moe loader wants it:
    2 heads of hidden / 2, NUM_EXPERTS experts, top 2. `types`: tensor -> ggml type (random
    valid blocks; F32 otherwise); `shapes` overrides a tensor's shape (None drops it)."""
    head_dim = hidden // 2
    keys = {"block_count": 1, "context_length": 256, "embedding_length": hidden,
            "attention.head_count": 2, "attention.head_count_kv": 2,
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "expert_count": NUM_EXPERTS, "expert_used_count": 2,
            "expert_feed_forward_length": expert_size, **(metadata or {})}
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in keys.items():
        if key not in drop_keys:
            writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    tensors = {"token_embd.weight": (32, hidden), "output_norm.weight": (hidden,),
               "blk.0.attn_norm.weight": (hidden,), "blk.0.attn_q.weight": (hidden, hidden),
               "blk.0.attn_k.weight": (hidden, hidden), "blk.0.attn_v.weight": (hidden, hidden),
               "blk.0.attn_output.weight": (hidden, hidden),
               "blk.0.attn_q_norm.weight": (head_dim,), "blk.0.attn_k_norm.weight": (head_dim,),
               "blk.0.ffn_norm.weight": (hidden,),
               "blk.0.ffn_gate_inp.weight": (NUM_EXPERTS, hidden),
               "blk.0.ffn_gate_exps.weight": (NUM_EXPERTS, expert_size, hidden),
               "blk.0.ffn_up_exps.weight": (NUM_EXPERTS, expert_size, hidden),
               "blk.0.ffn_down_exps.weight": (NUM_EXPERTS, hidden, expert_size),
               **(shapes or {})}
    rng = np.random.default_rng(5)
    for name, shape in tensors.items():
        if shape is None:
            continue
        ggml_type = (types or {}).get(name, T.F32)
        if ggml_type == T.F32:
            writer.add_tensor(name, rng.normal(0, 0.1, shape).astype(np.float32))
            continue
        block_size = gguf.GGML_QUANT_SIZES[ggml_type][0]
        rows = random_rows(ggml_type, int(np.prod(shape[:-1])), shape[-1] // block_size, rng)
        writer.add_tensor(name, rows.reshape(*shape[:-1], -1), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("k4", [T.Q4_K, T.Q5_K, T.Q3_K, T.IQ4_XS, T.Q2_K, T.IQ2_XXS, T.IQ3_XXS,
                                T.IQ3_S, T.IQ2_XS, T.IQ2_S],
                         ids=lambda t: t.name)
def test_k_quant_experts_keep_each_experts_rows(tmp_path, k4):
    """A Q4_K_M-style layer (gate and up Q4_K, down Q6_K, rows of 256 values so the K-quant
    super-blocks fit; a Q8_0 router), a Q5_K_M-style one (Q5_K gate and up, and Q5_K
    attention, the type a Q4_K_M file gives an 8-expert model's attn_output) and a Q3_K_M-style
    one (Q3_K gate, up and attention), an
    IQ4_XS one (kept as blocks of 32 with a float32 scale each), a Q2_K one, and IQ2_XXS,
    IQ3_XXS, IQ3_S, IQ2_XS and IQ2_S ones (as blocks of 32, a float32 scale each): each expert's
    linears hold exactly its rows of the stacked tensors, in their blocks, and so do the
    attention's; the router is dequantized, since its logits choose the experts."""
    types = {"blk.0.ffn_gate_exps.weight": k4, "blk.0.ffn_up_exps.weight": k4,
             "blk.0.ffn_down_exps.weight": T.Q6_K, "blk.0.ffn_gate_inp.weight": T.Q8_0}
    attention = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                 "blk.0.attn_output.weight"]
    if k4 != T.Q4_K:
        types.update(dict.fromkeys(attention, k4))
    kept_as = Q.BLOCK_TYPES[kernel_kind(k4)]
    path = write_qwen3moe(tmp_path / "k.gguf", hidden=256, expert_size=256, types=types)
    model = load_model(path, read_hf_config(path), torch.float32, torch.device("cpu"))
    stored = {name: t.dequantize() for name, t in open_gguf(path).tensors.items()}
    (block,) = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert block.stacked is None
    assert isinstance(block.gate.weight, torch.nn.Parameter)
    assert torch.equal(block.gate.weight, stored["blk.0.ffn_gate_inp.weight"])
    for e, expert in enumerate(block.experts):
        gate_up, down = expert.gate_up_proj.weight, expert.down_proj.weight
        assert [p.name() for p in gate_up.parts] == [kept_as, kept_as]
        assert [p.name() for p in down.parts] == ["Q6_K"]
        assert torch.equal(gate_up.parts[0].dequantize(256), stored["blk.0.ffn_gate_exps.weight"][e])
        assert torch.equal(gate_up.parts[1].dequantize(256), stored["blk.0.ffn_up_exps.weight"][e])
        assert torch.equal(down.parts[0].dequantize(256), stored["blk.0.ffn_down_exps.weight"][e])
    if k4 != T.Q4_K:
        (attn,) = [m for m in model.modules() if hasattr(m, "qkv_proj")]
        qkv, o = attn.qkv_proj.weight, attn.o_proj.weight
        assert [p.name() for p in qkv.parts] == [kept_as] * 3 and o.describe() == kept_as
        assert torch.equal(qkv.dequantize(), torch.cat([stored[n] for n in attention[:3]]))
        assert torch.equal(o.dequantize(), stored[attention[3]])


def test_types_without_a_kernel_are_dequantized_where_they_fit(tmp_path, monkeypatch):
    """An IQ2_XXS file's mix with the 1-bit and ternary types no kernel runs (IQ1_S, IQ1_M: the
    bulk of IQ1 files; TQ1_0, TQ2_0; NVFP4): those tensors are dequantized at load to exactly
    gguf-py's values beside the parts kept in their blocks (IQ2_XXS, IQ2_S, IQ3_S). Where they
    would not fit dequantized in the memory available, loading is an error naming the file,
    the types, the size and the kernel types, before anything is dequantized."""
    import ladle.models.gguf.quantized as quantized

    attention = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                 "blk.0.attn_output.weight"]
    types = {"blk.0.ffn_gate_exps.weight": T.IQ2_XXS, "blk.0.ffn_up_exps.weight": T.IQ1_M,
             "blk.0.ffn_down_exps.weight": T.IQ1_S, "blk.0.ffn_gate_inp.weight": T.Q8_0,
             "blk.0.attn_q.weight": T.IQ2_S, "blk.0.attn_k.weight": T.TQ1_0,
             "blk.0.attn_v.weight": T.TQ2_0, "blk.0.attn_output.weight": T.NVFP4}
    path = write_qwen3moe(tmp_path / "iq.gguf", hidden=256, expert_size=256, types=types)
    model = load_model(path, read_hf_config(path), torch.float32, torch.device("cpu"))
    stored = {name: t.dequantize() for name, t in open_gguf(path).tensors.items()}
    (attn,) = [m for m in model.modules() if hasattr(m, "qkv_proj")]
    qkv = attn.qkv_proj.weight
    assert [p.name() for p in qkv.parts] == ["IQ2_S", "float32", "float32"]
    assert torch.equal(qkv.dequantize(), torch.cat([stored[n] for n in attention[:3]]))
    assert isinstance(attn.o_proj.weight, torch.nn.Parameter)  # NVFP4 alone: dense
    assert torch.equal(attn.o_proj.weight, stored[attention[3]])
    (block,) = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for e, expert in enumerate(block.experts):
        gate_up, down = expert.gate_up_proj.weight, expert.down_proj.weight
        assert [p.name() for p in gate_up.parts] == ["IQ2_XXS", "float32"]
        assert torch.equal(gate_up.parts[1].dequantize(256), stored["blk.0.ffn_up_exps.weight"][e])
        assert isinstance(down, torch.nn.Parameter), type(down)  # a tensor with no kernel type
        assert torch.equal(down, stored["blk.0.ffn_down_exps.weight"][e])
    monkeypatch.setattr(quantized, "free_memory", lambda device: 1 << 16)
    with pytest.raises(ModelLoadError) as info:
        load_model(path, read_hf_config(path), torch.float32, torch.device("cpu"))
    message = str(info.value)
    for fragment in (str(path), "5 IQ1_M/IQ1_S/NVFP4/TQ1_0/TQ2_0 tensors have no quantized kernel",
                     "dequantized to float32, more than the 0.0 GiB", "IQ2_S", "IQ3_XXS"):
        assert fragment in message, message


# (tokens, ggml types of gate, up, down): one token (decode tiles), a few, enough that every
# expert gets several rows (prefill tiles) and threads share experts, and enough that experts
# get 12 or more rows (the panels of AVX-512 VNNI builds); a Q4_K_M layer, Q5_K_M ones, a Q8_0
# one, mixed 32-value types (Q5_1 and Q4_1: the fallbacks of Q5_K_M files and of 8-expert
# Q4_0 files, with a min per block), a Q3_K_M one (a scale per 16 values, as Q6_K), IQ4 ones
# (IQ4_XS in blocks of 32, IQ4_NL: table values), Q2_K ones (a min per 16 values), and
# grid ones (IQ2_XXS, IQ3_XXS, IQ3_S: grid magnitudes and sign bits; IQ2_XS, IQ2_S: a scale
# per 16 values too).
QUANT_CASES = [(1, (T.Q4_K, T.Q4_K, T.Q6_K)), (3, (T.Q4_K, T.Q4_K, T.Q6_K)),
               (37, (T.Q4_K, T.Q4_K, T.Q6_K)), (1, (T.Q5_K, T.Q5_K, T.Q6_K)),
               (37, (T.Q5_K, T.Q5_K, T.Q5_K)), (1, (T.Q8_0, T.Q8_0, T.Q8_0)),
               (37, (T.Q8_0, T.Q8_0, T.Q8_0)), (9, (T.Q4_0, T.Q5_0, T.MXFP4)),
               (96, (T.Q4_K, T.Q4_K, T.Q6_K)), (96, (T.Q4_0, T.Q5_0, T.MXFP4)),
               (37, (T.Q5_1, T.Q5_1, T.Q4_1)), (1, (T.Q3_K, T.Q3_K, T.Q4_K)),
               (37, (T.Q3_K, T.Q3_K, T.Q4_K)), (1, (T.IQ4_XS, T.IQ4_XS, T.IQ4_NL)),
               (37, (T.IQ4_XS, T.IQ4_NL, T.IQ4_XS)), (1, (T.Q2_K, T.Q2_K, T.Q3_K)),
               (37, (T.Q2_K, T.Q2_K, T.Q4_K)), (1, (T.IQ2_XXS, T.IQ2_XXS, T.IQ3_XXS)),
               (37, (T.IQ3_XXS, T.IQ2_XXS, T.IQ3_XXS)), (37, (T.IQ3_S, T.IQ3_S, T.IQ2_XXS)),
               (1, (T.IQ2_XS, T.IQ2_S, T.IQ2_XS)), (37, (T.IQ2_S, T.IQ2_XS, T.IQ2_S))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"{c[0]}-" + "-".join(
    t.name for t in c[1]))
def test_quantized_experts_kernel_equals_the_per_expert_loop(tmp_path, case, dtype):
    """One quant.cpp call per layer (moe_quant_swiglu over the stacked blocks) gives the bits of
    the per-expert loop of quantized linears, its twin; each expert's QuantWeights are views of
    the stacks (no byte held twice). Compared under batch-invariant mode: without it the loop's
    linears run an expert of enough bfloat16 rows (8-20 by type) dequantized on AMX-BF16 (where the CPU has
    it), while the fused kernel keeps the integer path at every row count."""
    tokens, (gate, up, down) = case
    types = {"blk.0.ffn_gate_exps.weight": gate, "blk.0.ffn_up_exps.weight": up,
             "blk.0.ffn_down_exps.weight": down}
    path = write_qwen3moe(tmp_path / "q.gguf", hidden=256, expert_size=256, types=types)
    model = load_model(path, read_hf_config(path), dtype, torch.device("cpu"))
    (block,) = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert block.quant_stacked is not None
    # AVX-512 VNNI builds stack Q4_K, Q5_K, Q6_K and Q8_0 experts repacked by 16 rows, and Q5_0
    # where AMX-BF16 does not take its blocks as they are (quant.py's _repacks).
    r16 = Q._r16_kernels()
    kinds = [kernel_kind(t) for t in (gate, up, down)]
    assert list(block.quant_stacked[1::2]) == [
        Q.R16_OF[k] if r16 and k in Q.R16_OF and Q._repacks(k) else k for k in kinds]
    stacked_gate = block.quant_stacked[0]
    for e, expert in enumerate(block.experts):
        part = expert.gate_up_proj.weight.parts[0].data
        assert part.data_ptr() == stacked_gate[e].data_ptr()
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 256).to(dtype)
    was = cpu_kernels.batch_invariant()
    cpu_kernels.set_batch_invariant(True)
    try:
        with torch.inference_mode():
            weights, ids = block.route(x)
            want = block.expert_loop(x, weights, ids)
            got = block.fused(x, weights, ids)
    finally:
        cpu_kernels.set_batch_invariant(was)
    assert got is not None and torch.equal(got, want)
    assert want.abs().max() > 0


def kernel_kind(ggml_type: T) -> int:
    """The kernel kind a file type's blocks are held as (a rewritten type's, or its own)."""
    return WIDENED[int(ggml_type)][0] if int(ggml_type) in WIDENED else int(ggml_type)


def refused_at_start(path: Path, *fragments: str) -> None:
    """What `ladle serve` runs before it starts a process (the config, then every tensor's name
    and shape) raises a ModelLoadError naming the file and each fragment."""
    with pytest.raises(ModelLoadError) as info:
        check_checkpoint(path, read_hf_config(path))
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_what_ladle_cannot_represent_is_refused(tmp_path):
    ok = write_qwen3moe(tmp_path / "ok.gguf")
    check_checkpoint(ok, read_hf_config(ok))  # the file the others are broken from
    up = "blk.0.ffn_up_exps.weight"
    refused_at_start(write_qwen3moe(tmp_path / "up.gguf", shapes={up: (4, 48, HIDDEN)}),
                     f"tensor '{up}' has shape (4, 48, 64)",
                     "qwen3moe.expert_feed_forward_length is 32")
    refused_at_start(write_qwen3moe(tmp_path / "experts.gguf", shapes={up: (5, 32, HIDDEN)}),
                     f"tensor '{up}' has shape (5, 32, 64)", "qwen3moe.expert_count is 4")
    refused_at_start(write_qwen3moe(tmp_path / "count.gguf", drop_keys=("expert_count",)),
                     "metadata qwen3moe.expert_count is missing")
    refused_at_start(write_qwen3moe(tmp_path / "size.gguf",
                                    drop_keys=("expert_feed_forward_length",)),
                     "metadata qwen3moe.expert_feed_forward_length is missing")
    refused_at_start(write_qwen3moe(tmp_path / "topk.gguf", metadata={"expert_used_count": 5}),
                     "qwen3moe.expert_used_count is 5; accepted: 1 to qwen3moe.expert_count (4)")
    # A dense MLP beside the experts (a checkpoint with mlp_only_layers): llama.cpp's qwen3moe
    # has none, and neither does the model ladle builds from the file.
    refused_at_start(write_qwen3moe(tmp_path / "dense.gguf",
                                    shapes={"blk.0.ffn_up.weight": (96, HIDDEN)}),
                     "tensor 'blk.0.ffn_up.weight' has no counterpart in Qwen3MoeForCausalLM")
    refused_at_start(write_qwen3moe(tmp_path / "nodown.gguf",
                                    shapes={"blk.0.ffn_down_exps.weight": None}),
                     "missing tensor(s) model.layers.0.mlp.experts.0.down_proj.weight")
    # llama.cpp's fallback for a file without the expert size: feed_forward_length / top k.
    fallback = write_qwen3moe(tmp_path / "ff.gguf", drop_keys=("expert_feed_forward_length",),
                              metadata={"feed_forward_length": 64})
    assert read_hf_config(fallback)["moe_intermediate_size"] == 32
    check_checkpoint(fallback, read_hf_config(fallback))
