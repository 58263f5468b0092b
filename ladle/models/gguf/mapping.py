"""From a GGUF file back to the Hugging Face checkpoint it was converted from: `hf_config_from_gguf`
rebuilds config.json from the metadata, with the defaults llama.cpp applies where a key is absent;
`iter_hf_tensors` yields every tensor under its HF name, dequantized, with what llama.cpp's
converter (convert_hf_to_gguf.py) changed undone:

- llama: q_proj and k_proj rows (weights and biases) were permuted so that rotary pairs sit next
  to each other (ggml's interleaved rope); they are put back in HF's rotate-half order.
- gemma2, gemma3: every RMSNorm weight was stored as 1 + w (ggml's norm multiplies by w, HF's
  Gemma norm by 1 + w); w is the stored value minus 1 in float32, as transformers' GGUF loader
  computes it.
- llama with Llama 3 rope scaling: the parameters survive only as per-frequency factors (the
  `rope_freqs` tensor); rope_scaling is rebuilt from them and checked against them.
- qwen3moe, and llama with experts (Mixtral): each layer's experts were stacked into one tensor
  per projection (ffn_gate_exps, ffn_up_exps (E, I, H), ffn_down_exps (E, H, I)); they come back
  under `{layer}.mlp.experts.{gate,up,down}_proj.weight` stacked, and the MoE family's `unfused`
  (models/moe.py) splits them per expert, as it splits transformers 5's stacked experts. The
  routing is llama.cpp's for both: softmax, top k renormalised, every layer sparse.
- gpt-oss: the experts' interleaved gate_up_proj was split into ffn_gate_exps and ffn_up_exps
  (E, I, H), each with its bias (E, I), and down_proj transposed to ffn_down_exps (E, H, I); the
  published MXFP4 blocks were repacked to ggml's MXFP4 (kept 4-bit for the quantized kernels).
  They come back as `{layer}.mlp.experts.{gate,up,down}_proj.{weight,bias}`, which gpt_oss.py's
  `unfused` splits per expert. The per-head sinks were stored as `attn_sinks.weight`. What the
  file cannot hold is gpt-oss's fixed (transformers' defaults, llama.cpp's constants): the
  SwiGLU alpha 1.702 and limit 7.0, YaRN without truncation.

Three changes cannot be undone: gemma3's embedding rows past the tokenizer's vocabulary were
dropped (vocab_size is the rows kept), a bf16 checkpoint's norms had 1 added in bf16, and
Qwen3-MoE's norm_topk_prob is not stored (llama.cpp renormalises always; a checkpoint that did
not, transformers' default, runs as llama.cpp runs its file). A checkpoint with dense layers
(mlp_only_layers) converts to a file llama.cpp refuses, and so does ladle (no place for them).

HF names come from gguf-py's HF -> GGUF name map, inverted over the checkpoint tensor names of
ladle's own model class for the config (built on the meta device, so nothing is allocated): the
names its safetensors loader accepts, which are the names the converter read, save the experts,
named as the converter stacked them. (Not transformers' model classes: importing them costs
each process that maps a file ~190 MB resident.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from functools import lru_cache, partial
from typing import Any

import gguf
import torch

from ladle.models.gguf.reader import GGUFFile, GGUFTensor
from ladle.models.loader import ModelLoadError

# GGUF architecture -> (HF `architectures` entry, HF `model_type`); the reader's
# SUPPORTED_ARCHITECTURES, each with its HF class.
HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
}
# Qwen3.5's hybrids: Gated DeltaNet layers beside gated full attention (models/qwen3_next.py).
HYBRID = ("qwen35", "qwen35moe", "qwen3next")
# Those whose converter reorders every value-head axis from grouped by key head to tiled (for
# ggml's broadcast); Qwen3-Next's keeps HF's grouped order.
TILED_VALUE_HEADS = ("qwen35", "qwen35moe")
# MoE architectures whose files need no dense feed_forward_length.
_EXPERT_ARCHS = ("qwen3moe", "gpt-oss", "qwen35moe", "qwen3next")
# llama.cpp stores Mixtral as `llama` with `llama.expert_count` set.
MIXTRAL = ("MixtralForCausalLM", "mixtral")
GELU_TANH = "gelu_pytorch_tanh"  # Gemma's MLP activation (llama.cpp: LLM_FFN_GELU)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 rope factors: read into the config, not a weight
# Llama 3.x's published rope_scaling besides `factor`, the one set of values the factors in
# `rope_freqs` are checked against (the GGUF keeps only the factors they produce).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def hf_config_from_gguf(gguf_file: GGUFFile) -> dict[str, Any]:
    """config.json of the HF checkpoint, in the flat style of transformers 4.5x (top-level
    rope_theta, rope_scaling, rope_local_base_freq)."""
    arch, hp = gguf_file.architecture, _HParams(gguf_file)
    has_experts = arch in _EXPERT_ARCHS or \
        (arch == "llama" and hp.get("expert_count"))
    hf_class, model_type = MIXTRAL if arch == "llama" and has_experts else HF_ARCHITECTURES[arch]
    embedding = gguf_file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{gguf_file.path}: no token_embd.weight tensor")
    hidden = hp.require("embedding_length")
    num_heads = hp.uniform("attention.head_count")
    num_kv_heads = hp.uniform("attention.head_count_kv", num_heads)
    head_dim = (hp.get("attention.key_length") or hp.get("rope.dimension_count")
                or hidden // num_heads)
    theta = float(hp.get("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": embedding.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": _num_layers(gguf_file, hp),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": hp.require("attention.layer_norm_rms_epsilon"),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(gguf_file, hp, head_dim, theta),
        "max_position_embeddings": hp.require("context_length"),
        # llama.cpp ties the head to the embedding exactly when output.weight is absent.
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
    }
    # qwen3moe's dense MLP size is for layers without experts, which llama.cpp's qwen3moe does
    # not have: the key is optional there.
    if arch not in _EXPERT_ARCHS or \
            hp.get("feed_forward_length") is not None:
        config["intermediate_size"] = hp.uniform("feed_forward_length")
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        if (token_id := gguf_file.metadata.get(f"tokenizer.ggml.{gguf_key}")) is not None:
            config[key] = token_id
    if arch == "llama" and not has_experts:
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf_file.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in gguf_file.tensors
    elif arch in ("qwen3", "qwen3moe"):
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf_file.tensors
    elif arch in ("gemma2", "gemma3"):
        config.update(_gemma_fields(gguf_file, hp, config))
    elif arch == "gpt-oss":
        config.update(_gpt_oss_fields(gguf_file, hp, config))
    elif arch in HYBRID:
        config.update(_hybrid_fields(gguf_file, hp, config))
    if has_experts:
        config.update(_moe_fields(gguf_file, hp, config))
    return config


def hf_tensor_names(gguf_file: GGUFFile, hf_config: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> HF tensor name for every weight in the file (rope_freqs, which is
    configuration, excepted). Every tensor must have an HF counterpart of the same shape."""
    arch = gguf_file.architecture
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, hf_config["num_hidden_layers"])
    hf_shapes = _hf_parameter_shapes(json.dumps(hf_config, sort_keys=True), gguf_file.path)
    gguf_to_hf: dict[str, str] = {}
    for hf_name in hf_shapes:
        module, _, suffix = hf_name.rpartition(".")  # "weight" or "bias"
        if suffix == "dt_bias":  # Qwen3.5's: the converter renames it dt_proj.bias
            module, suffix = f"{module}.dt_proj", "bias"
        if (gguf_module := name_map.get_name(module)) is not None:
            gguf_to_hf[f"{gguf_module}.{suffix}"] = hf_name
        elif (gguf_module := name_map.get_name(hf_name)) is not None:
            # A bare parameter: the converter named gpt-oss's self_attn.sinks NAME.weight,
            # Qwen3.5's linear_attn.A_log NAME (ssm_a).
            gguf_to_hf[f"{gguf_module}.weight"] = gguf_to_hf[gguf_module] = hf_name
    hf_class = hf_config["architectures"][0]
    names: dict[str, str] = {}
    for gguf_name, tensor in gguf_file.tensors.items():
        if gguf_name == ROPE_FREQS or _is_next_token_layer(gguf_name, gguf_file, hf_config):
            continue
        hf_name = gguf_to_hf.get(gguf_name)
        if hf_name is None:
            raise ModelLoadError(f"{gguf_file.path}: tensor {gguf_name!r} has no counterpart "
                                 f"in {hf_class}; accepted: that model's tensors only")
        if tensor.shape != _as_stored(hf_name, hf_shapes[hf_name], arch):
            raise ModelLoadError(
                f"{gguf_file.path}: tensor {gguf_name!r} has shape {tensor.shape}; {hf_name} "
                f"of {hf_class} with this file's metadata has {hf_shapes[hf_name]}"
                f"{_metadata_behind(tensor.shape, hf_shapes[hf_name], hf_config, gguf_file)}")
        names[gguf_name] = hf_name
    return names


def _is_next_token_layer(gguf_name: str, gguf_file: GGUFFile, hf_config: dict[str, Any]) -> bool:
    """A tensor of the multi-token-prediction layers the converter appends after the model's
    own (blocks num_hidden_layers .. block_count - 1, `nextn_predict_layers` of them: Qwen3.5's
    MTP head), which ladle does not run (as its safetensors loader skips `mtp.*`)."""
    if not gguf_name.startswith("blk."):
        return False
    block = gguf_name.split(".", 2)[1]
    blocks = gguf_file.metadata.get(f"{gguf_file.architecture}.block_count", 0)
    return block.isdecimal() and hf_config["num_hidden_layers"] <= int(block) < blocks


def _as_stored(hf_name: str, shape: tuple[int, ...], arch: str) -> tuple[int, ...]:
    """An HF tensor's shape as the converter stores it: Qwen3.5's depthwise conv weight
    (channels, 1, kernel) squeezed to (channels, kernel)."""
    if arch in HYBRID and hf_name.endswith("linear_attn.conv1d.weight"):
        return (shape[0], shape[2])
    return shape


# config.json fields (as loader.size_fields names them) and the GGUF metadata keys they come from.
_METADATA_KEYS = {"hidden_size": ("embedding_length",),
                  "intermediate_size": ("feed_forward_length",),
                  "head_dim": ("attention.key_length",),
                  "num_attention_heads x head_dim": ("attention.head_count",
                                                     "attention.key_length"),
                  "num_key_value_heads x head_dim": ("attention.head_count_kv",
                                                     "attention.key_length"),
                  "moe_intermediate_size": ("expert_feed_forward_length",),
                  "num_experts": ("expert_count",), "num_local_experts": ("expert_count",)}
# HF model_type -> the GGUF architecture whose metadata keys describe it.
_GGUF_ARCH = {model_type: arch for arch, (_, model_type) in HF_ARCHITECTURES.items()} | {
    MIXTRAL[1]: "llama"}


def gguf_field_names(names: list[str], hf_config: dict[str, Any]) -> list[str]:
    """config.json field names as the GGUF metadata keys they were read from, for errors."""
    arch = _GGUF_ARCH.get(hf_config.get("model_type"), hf_config.get("model_type"))
    return [" x ".join(f"{arch}.{key}" for key in _METADATA_KEYS[n]) if n in _METADATA_KEYS
            else "token_embd.weight's rows" if n == "vocab_size" else n for n in names]


def _metadata_behind(shape: tuple, expected: tuple, hf_config: dict[str, Any],
                     gguf_file: GGUFFile) -> str:
    """' (<metadata key> is N)' for the dimensions that differ, when a key gives them."""
    from ladle.models.loader import size_fields

    if len(shape) != len(expected):
        return ""
    fields = [f"{k} is {want}" for got, want in zip(shape, expected, strict=True) if got != want
              for k in size_fields(want, hf_config, gguf_file.path)]
    return f" ({', '.join(dict.fromkeys(fields))})" if fields else ""


def iter_hf_tensors(gguf_file: GGUFFile, hf_config: dict[str, Any]
                    ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF name, load) for each weight, in file order; `load()` dequantizes it to float32 and
    undoes the converter's change, so it equals the HF checkpoint's tensor (a layer's experts:
    stacked, one tensor per projection). Names and shapes are all checked before the first is
    yielded."""
    names = hf_tensor_names(gguf_file, hf_config)
    for gguf_name, hf_name in names.items():
        yield hf_name, partial(_load, gguf_file.tensors[gguf_name], gguf_file.architecture,
                               hf_config)


def _load(tensor: GGUFTensor, arch: str, hf_config: dict[str, Any]) -> torch.Tensor:
    values = tensor.dequantize()
    name = tensor.name
    if arch == "llama" and name.startswith("blk."):
        if ".attn_q." in name:
            values = _unpermute_rotary(values, hf_config["num_attention_heads"])
        elif ".attn_k." in name:
            values = _unpermute_rotary(values, hf_config["num_key_value_heads"])
    elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        values = values - 1.0  # float32, as transformers' Gemma2TensorProcessor
    elif arch in HYBRID:
        values = _hybrid_tensor(values, name, arch, hf_config)
    return values


def _hybrid_tensor(values: torch.Tensor, name: str, arch: str,
                   hf_config: dict[str, Any]) -> torch.Tensor:
    """Undo what the converter does to a Qwen3.5 or Qwen3-Next tensor (conversion/qwen.py):
    the (1 + w) norms stored as 1 + w, except the gated norm of the linear layers; A_log stored
    as A = -exp(A_log); the conv weight squeezed; and for Qwen3.5 (TILED_VALUE_HEADS), where the
    linear layers have fewer key heads than value heads, every value-head axis reordered from
    grouped by key head to tiled (for ggml's broadcast): in_proj_qkv's v rows, in_proj_z's,
    in_proj_a's and in_proj_b's rows, A_log, dt_bias, the conv's v channels and out_proj's
    columns. (Qwen3-Next's in_proj_qkvz comes as in_proj_qkv and in_proj_z in that plain order,
    which the "qwen3_next_gguf" layout of models/gated_deltanet.py reads as they are.)"""
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        return values - 1.0  # float32
    if not name.startswith("blk."):
        return values
    kind = name.split(".", 2)[2]
    if arch in TILED_VALUE_HEADS:
        values = untile_value_rows(values, kind, hf_config)
    if kind == "ssm_out.weight" and arch in TILED_VALUE_HEADS:
        values = untile_value_heads(values, 1, hf_config["linear_num_key_heads"],
                                    hf_config["linear_num_value_heads"],
                                    hf_config["linear_value_head_dim"])
    if kind == "ssm_a":
        return torch.log(-values)  # float32: exp of it gives A back within an ulp
    if kind == "ssm_conv1d.weight":
        return values.unsqueeze(1)
    return values


def untile_value_rows(t: torch.Tensor, kind: str, hf_config: dict[str, Any]) -> torch.Tensor:
    """The rows (dim 0: values, or whole rows of blocks) of a Qwen3.5 linear layer's tensor
    `kind` (its GGUF name after blk.N.) with their value heads back in HF's order: in_proj_qkv's
    and the conv's v rows after q and k, in_proj_z's, in_proj_a's and in_proj_b's rows, A and
    dt_bias. Other tensors as they are."""
    nk, nv = hf_config["linear_num_key_heads"], hf_config["linear_num_value_heads"]
    dv = hf_config["linear_value_head_dim"]
    if kind in ("attn_qkv.weight", "ssm_conv1d.weight"):  # rows / channels [q | k | v]
        qk = 2 * nk * hf_config["linear_key_head_dim"]
        return torch.cat([t[:qk], untile_value_heads(t[qk:], 0, nk, nv, dv)])
    if kind == "attn_gate.weight":
        return untile_value_heads(t, 0, nk, nv, dv).contiguous()
    if kind in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias"):
        return untile_value_heads(t, 0, nk, nv, 1).contiguous()
    return t


def untile_value_heads(t: torch.Tensor, dim: int, nk: int, nv: int,
                       head_dim: int) -> torch.Tensor:
    """Axis `dim` of nv heads of head_dim (or of whole rows of blocks) from the converter's
    tiled order (value head j of every key head, then j + 1: [k0v0, k1v0, ..., k0v1, ...]) back
    to HF's grouped order ([k0v0, k0v1, ..., k1v0, ...]); the identity when nk == nv."""
    if nk == nv:
        return t
    shape = list(t.shape)
    tiled = t.reshape(*shape[:dim], nv // nk, nk, head_dim, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def _unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of the converter's LlamaModel.permute: within each head, rows were reordered from
    (pair half, i) to (i, pair half); put them back. Works for weights and biases."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _HParams:
    """`{arch}.KEY` from the metadata; a missing required key names the file and the key."""

    def __init__(self, gguf_file: GGUFFile):
        self.path = gguf_file.path
        self.arch = gguf_file.architecture
        self.metadata = gguf_file.metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        if (value := self.get(key)) is None:
            raise ModelLoadError(f"{self.path}: metadata {self.arch}.{key} is missing")
        return value

    def uniform(self, key: str, default: Any = None) -> int:
        """A per-layer value that may be stored as one number or one per layer (equal here)."""
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelLoadError(f"{self.path}: {self.arch}.{key} differs between layers "
                                     f"({value}); ladle needs one value for all of them")
            value = value[0]
        return value


def _rope_scaling(gguf_file: GGUFFile, hp: _HParams, head_dim: int,
                  theta: float) -> dict[str, Any] | None:
    """HF rope_scaling from the rope.scaling.* keys (llama.cpp reads a factor with no type as
    linear), or for Llama 3 from the rope_freqs factors."""
    if ROPE_FREQS in gguf_file.tensors:
        return _llama3_rope_scaling(gguf_file, head_dim, theta)
    kind = hp.get("rope.scaling.type", "linear")
    factor = hp.get("rope.scaling.factor") or hp.get("rope.scale_linear") or 1.0
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings":
                       hp.get("rope.scaling.original_context_length") or
                       hp.require("context_length")}
        for hf_key, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                            ("attention_factor", "yarn_attn_factor")):
            if (value := hp.get(f"rope.scaling.{key}")) is not None:
                scaling[hf_key] = value
        return scaling
    raise ModelLoadError(f"{gguf_file.path}: rope scaling type {kind!r} is not supported; "
                         "supported: none, linear, yarn, and Llama 3's rope_freqs")


def _llama3_rope_scaling(gguf_file: GGUFFile, head_dim: int, theta: float) -> dict[str, Any]:
    """The factors divide each rotary frequency: 1 for short wavelengths, `factor` for long
    ones, a blend between. Rebuilt with Llama 3's published band (LLAMA3_ROPE) and checked by
    recomputing every factor, so a file with another band fails here instead of drifting."""
    stored = gguf_file.tensors[ROPE_FREQS].dequantize().double()
    if stored.shape != (head_dim // 2,):
        raise ModelLoadError(f"{gguf_file.path}: {ROPE_FREQS} has shape {tuple(stored.shape)}, "
                             f"expected ({head_dim // 2},) for head_dim {head_dim}")
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), **LLAMA3_ROPE}
    recomputed = _llama3_factors(head_dim, theta, scaling)
    if not torch.allclose(recomputed, stored, rtol=1e-5, atol=0):
        raise ModelLoadError(
            f"{gguf_file.path}: {ROPE_FREQS} holds Llama 3 rope factors that Llama 3's band "
            f"({LLAMA3_ROPE}) with factor {scaling['factor']} does not reproduce; ladle cannot "
            "rebuild this model's rope_scaling")
    return scaling


def _llama3_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """What the converter stores per frequency: 1 / (how much HF's llama3 rope scales it)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (old_len / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old_len / high, 1.0,
                       torch.where(wavelen > old_len / low, factor, blended))


def _moe_fields(gguf_file: GGUFFile, hp: _HParams, config: dict[str, Any]) -> dict[str, Any]:
    """The experts' block as llama.cpp runs qwen3moe and llama with experts (build_moe_ffn):
    every layer sparse; a softmax over all experts, the top k kept and always renormalised
    (its norm_w is true for both, whatever the checkpoint's norm_topk_prob was), no scale.
    Mixtral's expert size is feed_forward_length; qwen3moe's expert_feed_forward_length, or
    llama.cpp's fallback feed_forward_length / expert_used_count."""
    arch = gguf_file.architecture
    num_experts = hp.uniform("expert_count")
    top_k = hp.uniform("expert_used_count")
    if num_experts < 1:
        raise ModelLoadError(f"{gguf_file.path}: {arch}.expert_count is {num_experts}; an MoE "
                             "model needs at least one expert")
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(f"{gguf_file.path}: {arch}.expert_used_count is {top_k}; accepted: "
                             f"1 to {arch}.expert_count ({num_experts})")
    if arch == "llama":
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k}
    if arch == "gpt-oss":  # top k by logit, then a softmax over those k: gpt-oss's own routing
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k,
                "intermediate_size": hp.uniform("expert_feed_forward_length")}
    if arch in ("qwen35moe", "qwen3next"):  # every layer sparse, with a shared expert; top k
        # renormalised (llama.cpp's qwen3next as its qwen35moe)
        return {"num_experts": num_experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": hp.uniform("expert_feed_forward_length"),
                "shared_expert_intermediate_size":
                    hp.uniform("expert_shared_feed_forward_length"),
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if hp.get("expert_feed_forward_length") is None and "intermediate_size" in config:
        expert_size = config["intermediate_size"] // top_k
    else:
        expert_size = hp.uniform("expert_feed_forward_length")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": expert_size, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _gpt_oss_fields(gguf_file: GGUFFile, hp: _HParams, config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's attention as llama.cpp's loader reads it: q/k/v/o biases, the sliding window
    on every other layer from the first (its swa pattern 2, or the per-layer list when the file
    has one), YaRN without truncation (gpt-oss's rope; the file keeps factor and betas)."""
    num_layers = config["num_hidden_layers"]
    window = hp.require("attention.sliding_window")
    pattern = hp.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern[:num_layers]]
    else:
        sliding = [i % pattern < pattern - 1 for i in range(num_layers)]
    fields: dict[str, Any] = {
        "attention_bias": True, "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
    if config["rope_scaling"] is not None and config["rope_scaling"]["rope_type"] == "yarn":
        fields["rope_scaling"] = {**config["rope_scaling"], "truncate": False}
    return fields


def _num_layers(gguf_file: GGUFFile, hp: _HParams) -> int:
    """The model's own layers: block_count less the multi-token-prediction layers the converter
    appends (`nextn_predict_layers`, Qwen3.5's MTP head; not run)."""
    blocks = hp.require("block_count")
    extra = hp.get("nextn_predict_layers", 0)
    if not isinstance(extra, int) or not 0 <= extra < blocks:
        raise ModelLoadError(f"{gguf_file.path}: {gguf_file.architecture}.nextn_predict_layers is "
                             f"{extra!r}; accepted: 0 to block_count - 1 ({blocks - 1})")
    return blocks - extra


def _hybrid_fields(gguf_file: GGUFFile, hp: _HParams, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's linear-attention layers and layer pattern, as llama.cpp's qwen35 loaders read
    them: ssm.group_count key heads of ssm.state_size, ssm.time_step_rank value heads sharing
    ssm.inner_size, the conv's kernel; attention.recurrent_layers (else every
    full_attention_interval-th layer full); rotary on rope.dimension_count of each head (its
    multimodal sections give text positions exactly that)."""
    arch, n = gguf_file.architecture, config["num_hidden_layers"]
    nk, nv = hp.require("ssm.group_count"), hp.require("ssm.time_step_rank")
    inner = hp.require("ssm.inner_size")
    if nk < 1 or nv < nk or nv % nk or inner % nv:
        raise ModelLoadError(f"{gguf_file.path}: {arch}.ssm.group_count {nk}, "
                             f"ssm.time_step_rank {nv}, ssm.inner_size {inner}: the value heads "
                             "must be a multiple of the key heads and divide inner_size")
    recurrent = hp.get("attention.recurrent_layers")
    if recurrent is None:
        interval = hp.get("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    elif not isinstance(recurrent, list) or len(recurrent) < n:
        raise ModelLoadError(f"{gguf_file.path}: {arch}.attention.recurrent_layers must list "
                             f"the {n} layers")
    rotary = hp.get("rope.dimension_count", config["head_dim"] // 4)
    factor = rotary / config["head_dim"]
    from ladle.models.gated_deltanet import LAYOUT_KEY

    fields = {} if arch != "qwen3next" else {LAYOUT_KEY: "qwen3_next_gguf"}
    return fields | {"linear_num_key_heads": nk, "linear_num_value_heads": nv,
            "linear_key_head_dim": hp.require("ssm.state_size"),
            "linear_value_head_dim": inner // nv,
            "linear_conv_kernel_dim": hp.require("ssm.conv_kernel"),
            "layer_types": ["linear_attention" if r else "full_attention"
                            for r in recurrent[:n]],
            "partial_rotary_factor": factor,
            "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"],
                                "partial_rotary_factor": factor}}


def _gemma_fields(gguf_file: GGUFFile, hp: _HParams, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma's attention layout, as llama.cpp's gemma2/gemma3 loaders decide it."""
    is_gemma3 = gguf_file.architecture == "gemma3"
    num_layers = config["num_hidden_layers"]
    # Sliding window: gemma3 has none when the key is absent or 0; gemma2 defaults to 4096.
    window = hp.get("attention.sliding_window", None if is_gemma3 else 4096) or None
    # Which layers slide: a per-layer list, or every n-th layer is full (gemma3 6, gemma2 2).
    pattern = hp.get("attention.sliding_window_pattern", 6 if is_gemma3 else 2)
    if window is None:
        sliding = [False] * num_layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern[:num_layers]]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    # Gemma's 27B models scale queries by hidden / heads, the others by head_dim; GGUF does not
    # store it, and llama.cpp tells the 27B models by their layer count (62 gemma3, 46 gemma2).
    is_27b = num_layers == (62 if is_gemma3 else 46)
    fields: dict[str, Any] = {
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                  if is_27b else config["head_dim"]),
        "hidden_activation": GELU_TANH,
        "final_logit_softcapping": hp.get("final_logit_softcapping",
                                          None if is_gemma3 else 30.0),
    }
    if is_gemma3:
        # Local (sliding) layers use their own rope base: llama.cpp's default is 10000.
        fields["rope_local_base_freq"] = float(hp.get("rope.freq_base_swa", 10000.0))
        fields["attn_logit_softcapping"] = None
    else:
        local_theta = hp.get("rope.freq_base_swa")
        if local_theta is not None and float(local_theta) != config["rope_theta"]:
            raise ModelLoadError(f"{gguf_file.path}: gemma2.rope.freq_base_swa ({local_theta}) "
                                 "differs from rope.freq_base; Gemma2 has one rope base")
        fields["attn_logit_softcapping"] = hp.get("attn_logit_softcapping", 50.0)
    return fields


@lru_cache(maxsize=4)
def _hf_parameter_shapes(config_json: str, path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint `path` was converted from, as ladle's
    own model class (built on the meta device: no memory, no init) names what its loader
    accepts, with the converter's layout of experts: a layer's stacked in one tensor per
    projection (`{layer}.mlp.experts.gate_proj.weight` (E, I, H), `down_proj` (E, H, I),
    gpt-oss's biases (E, out)), which moe.py's `unfused` splits again. A tied head's
    `lm_head.weight` is listed as the embedding (a file may hold the copy; the loader skips
    it). Transformers' model classes name the same tensors, at ~190 MB of imports (its
    modeling, torch._dynamo, triton) in each process that maps a file. Cached by the config
    (as JSON): the engine maps a file twice in one load (the blocks it keeps, the tensors it
    dequantizes), and building ladle's class with every expert a module takes seconds for the
    largest MoE files (4 s for a Qwen3-Next-80B config). Callers must not modify the result."""
    from ladle.models.loader import _renamed, checkpoint_shapes, meta_model

    model = meta_model(json.loads(config_json), path)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in checkpoint_shapes(model).items():
        name = _renamed(name, model)  # Mixtral's w1/w2/w3 as gate/down/up_proj
        stem, experts, rest = name.partition(".experts.")
        expert, _, tail = rest.partition(".")
        if experts and expert.isdecimal():
            stacked = f"{stem}.experts.{tail}"
            shapes[stacked] = (shapes.get(stacked, (0,))[0] + 1, *shape)
        else:
            shapes[name] = shape
    if getattr(model, "lm_head", True) is None:
        shapes["lm_head.weight"] = next(
            shape for name, shape in shapes.items() if name.endswith("embed_tokens.weight"))
    return shapes
