"""Gemma 2 and Gemma 3 (text): one decoder, as transformers' modeling_gemma2.py and
modeling_gemma3.py compute it. Embeddings scaled by sqrt(hidden) (rounded to the model dtype),
(1 + w) RMSNorms in float32, four norms per layer around attention and the GeGLU MLP, sliding-
window attention on the layers `layer_types` names "sliding_attention", query scale
query_pre_attn_scalar ** -0.5, tied embeddings. Gemma 2 soft-caps attention scores and final
logits; Gemma 3 normalises q and k per head and gives sliding layers their own rope theta.

Tokens of all sequences in a step are one flat (T,) stream, as in llama.py; the window and the
soft-cap of each layer go to paged_attention, which applies them in the decode kernel and in the
prefill path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.models.layers import GatedMLP, GemmaRMSNorm, RotaryEmbedding
from ladle.models.llama import (
    LlamaForCausalLM,
    ShardLayout,
    shard_layout,
    stack_final_norm,
    stack_kernels,
    stack_linear,
    stack_row_limit,
    vocab_layers,
)
from ladle.runner.attention import AttentionMetadata, paged_attention
from ladle.runner.cpu_kernels import linear

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup

LAYER_TYPES = ("sliding_attention", "full_attention")
# HF's hidden_activation names -> GatedMLP's activations.
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


@dataclass(slots=True)
class Rope:
    theta: float
    scaling: dict | None  # HF rope_scaling (its rope_type and factors); None: plain


@dataclass(slots=True)
class GemmaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    activation: str  # GatedMLP's name for it
    query_pre_attn_scalar: float
    windows: tuple[int | None, ...]  # per layer: its sliding window, None on full-attention ones
    rope_full: Rope
    rope_sliding: Rope  # Gemma 3's local base frequency; Gemma 2: the same as rope_full
    attn_softcap: float | None  # None: off
    final_softcap: float | None
    qk_norm: bool


def read_config(hf: dict, family: type[GemmaForCausalLM]) -> GemmaConfig:
    """A published config.json, in either style: flat (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern) or transformers 5's (rope_parameters keyed by layer
    type, layer_types). Keys a file leaves out take transformers' defaults for the family."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true (embedding models) is "
                         "not supported by ladle")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # every pattern-th layer is global, the rest slide
        pattern = hf.get("sliding_window_pattern") or family.sliding_window_pattern
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config.json: layer_types must name {num_layers} layers, each one of "
                         f"{', '.join(LAYER_TYPES)}; got {types}")
    window = hf.get("sliding_window", hf.get("sliding_window_size", 4096))
    activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_activation {activation!r} is not supported; "
                         f"supported: {', '.join(ACTIVATIONS)}")
    full = _rope(hf, "full_attention", "rope_theta", family.default_theta, hf.get("rope_scaling"))
    sliding = _rope(hf, "sliding_attention", family.sliding_theta_key,
                    family.default_sliding_theta, None) if family.sliding_theta_key else full
    num_heads = hf["num_attention_heads"]
    return GemmaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or 256,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings",
                                       family.default_max_positions),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias")),
        activation=ACTIVATIONS[activation],
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        windows=tuple(window if t == "sliding_attention" else None for t in types),
        rope_full=full,
        rope_sliding=sliding,
        attn_softcap=(hf.get("attn_logit_softcapping", family.default_attn_softcap)
                      if family.honours_attn_softcap else None),
        final_softcap=hf.get("final_logit_softcapping", family.default_final_softcap),
        qk_norm=family.qk_norm,
    )


def _rope(hf: dict, layer_type: str, theta_key: str, default_theta: float,
          flat_scaling: dict | None) -> Rope:
    """The rope of one layer type: from rope_parameters (keyed by layer type, or one dict for
    all), else the flat keys."""
    params = hf.get("rope_parameters") or {}
    if any(t in params for t in LAYER_TYPES):
        params = params.get(layer_type) or {}
    params = dict(params)
    theta = params.pop("rope_theta", None) or hf.get(theta_key) or default_theta
    scaling = params or flat_scaling or None
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return Rope(float(theta), scaling)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig, window: int | None, layout: ShardLayout | None,
                 tp: TPGroup | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if layout is not None:  # column-parallel q/k/v: this rank's heads only
            self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.tp = tp
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        # q, k and v share one matmul; the loader writes the three checkpoint tensors into slices.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = window
        self.softcap = cfg.attn_softcap

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata, kv_cache):
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Gemma 3: (1 + w) RMSNorm of each head, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window,
                              self.softcap)  # (T, H, D)
        if self.tp is None:
            return linear(out.reshape(T, self.q_size), self.o_proj.weight, self.o_proj.bias)
        # Row-parallel: each rank's heads give a partial sum; the bias is added once, after it.
        y = self.tp.all_reduce(linear(out.reshape(T, self.q_size), self.o_proj.weight, None))
        return y if self.o_proj.bias is None else y + self.o_proj.bias


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: x + post_attn(attn(input(x))), then + post_ff(mlp(pre_ff(.)))."""

    def __init__(self, cfg: GemmaConfig, window: int | None, layout: ShardLayout | None,
                 tp: TPGroup | None):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, window, layout, tp)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        intermediate = cfg.intermediate_size if layout is None else layout.intermediate_size
        self.mlp = GatedMLP(cfg.hidden_size, intermediate, tp=tp, activation=cfg.activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, residual, positions, rotary, meta, kv_cache):
        """Returns (this layer's normed MLP output, the residual stream before it). As in
        llama.py, each residual add is deferred into the norm that reads the sum (the same sums
        in the same order as HF's `residual + h`)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rotary, meta, kv_cache))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(nn.Module):
    """The Gemma decoder; Gemma2ForCausalLM and Gemma3ForCausalLM set the family's switches and
    defaults below. With `tp`, this rank's shard (the same split as llama.py's ShardLayout)."""

    qk_norm = False
    honours_attn_softcap = True  # transformers' Gemma 3 never passes its softcap to attention
    sliding_window_pattern = 2  # when a config gives neither layer_types nor a pattern
    sliding_theta_key: str | None = None  # flat key of the sliding layers' own rope theta
    default_theta = 10000.0
    default_sliding_theta = 10000.0
    default_max_positions = 8192
    default_attn_softcap: float | None = 50.0
    default_final_softcap: float | None = 30.0

    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        super().__init__()
        cfg = self.config = read_config(hf_config, type(self))
        self.tp = tp
        self.layout = None if tp is None else shard_layout(cfg, tp.rank, tp.world_size)
        lay = self.layout
        # The heads this process's KV cache holds (the model runner sizes the cache with it).
        self.num_local_kv_heads = cfg.num_kv_heads if lay is None else lay.num_kv_heads
        self.embed_tokens, self.lm_head = vocab_layers(cfg, lay, tp)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, w, lay, tp) for w in cfg.windows)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_full.theta, cfg.rope_full.scaling)
        # Sliding layers rotate with their own tables when their rope differs (Gemma 3).
        self.rotary_sliding = None
        if cfg.rope_sliding != cfg.rope_full:
            self.rotary_sliding = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                                  cfg.rope_sliding.theta, cfg.rope_sliding.scaling)

    pp = LlamaForCausalLM.pp
    has_residual = True
    forward = LlamaForCausalLM.forward
    final_norm = LlamaForCausalLM.final_norm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        # HF multiplies by sqrt(hidden) held as a float32 tensor cast to the model dtype, so the
        # factor itself is rounded (to 8 bits in bfloat16) before the product.
        return x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)

    def run_layer(self, index: int, x, residual, positions, meta, kv_cache):
        layer = self.layers[index]
        # Sliding layers rotate with their own tables when their rope differs (Gemma 3).
        rotary = self.rotary if layer.self_attn.window is None else \
            (self.rotary_sliding or self.rotary)
        return layer(x, residual, positions, rotary, meta, kv_cache)

    _decode_stack = None  # llama.py's decode_stack: built on the first all-decode step

    def build_decode_stack(self):
        """(DecodeStack, rope tables, dtype, row limit) running these layers as
        GemmaDecoderLayer.forward does (llama.py: decode_stack): the (1 + w) norms as their
        float32 scales, Gemma 3's per-head norms then rotary, each layer's rope table, window
        and soft-cap; or None when it cannot."""
        layers, cfg = self.layers, self.config
        if type(self).run_layer is not GemmaForCausalLM.run_layer or \
                any(type(layer) is not GemmaDecoderLayer for layer in layers):
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        rotaries = [self.rotary] + ([self.rotary_sliding] if self.rotary_sliding else [])
        kernels = stack_kernels(self, dtype, rotaries)
        if kernels is None:
            return None
        activation = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
        stack = kernels.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.rms_norm_eps, layers[0].self_attn.scale)
        specs = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_attention_layernorm, layer.post_feedforward_layernorm]
            if attn.q_norm is not None:
                norms += [attn.q_norm, attn.k_norm]
            if (type(attn) is not GemmaAttention or type(mlp) is not GatedMLP
                    or mlp.tp is not None or attn.scale != layers[0].self_attn.scale
                    or (attn.num_heads, attn.num_kv_heads) != (cfg.num_heads, cfg.num_kv_heads)
                    or any(type(n) is not GemmaRMSNorm or n.eps != cfg.rms_norm_eps
                           or n.weight.device.type != "cpu" for n in norms)):
                return None
            linears = [stack_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj,
                                                        mlp.gate_up_proj, mlp.down_proj)]
            if any(s is None for s in linears):
                return None
            specs += linears
            scales = [n.scale() for n in norms]  # 1 + w in float32, as gemma_rms_norm takes
            sliding = attn.window is not None and self.rotary_sliding is not None
            stack.add_layer(scales[0], scales[1], scales[2], scales[3],
                            *(scales[4:] or (None, None)), False, 1 if sliding else 0,
                            attn.window or 0, attn.softcap or 0.0, activation[mlp.activation],
                            *linears, None)
        stack_final_norm(self, stack, GemmaRMSNorm, self.norm.scale())
        tables = [t for r in rotaries for t in (r.cos, r.sin)]
        return stack, tables, dtype, stack_row_limit(specs, dtype)

    def compute_logits(self, hidden: torch.Tensor,
                       indices: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits (N, vocab) at rows `indices` of hidden (T, hidden), or at every row, soft-capped
        when the config says so. Tensor-parallel: rank 0 gets the joined vocabulary (the cap
        applies there), other ranks None."""
        if indices is not None:
            hidden = hidden[indices]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        cap = self.config.final_softcap
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # Checkpoint names, fused parameters and the tensor-parallel split are Llama's: the modules
    # carry the same names and split the same way.
    stacked = LlamaForCausalLM.stacked
    shard_sizes = LlamaForCausalLM.shard_sizes
    checkpoint_slice = LlamaForCausalLM.checkpoint_slice


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: soft-capped attention scores (attn_logit_softcapping) and final logits
    (final_logit_softcapping); one rope for every layer; every second layer global."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 (text): per-head q/k norms, every sixth layer global (or layer_types), local
    rope base rope_local_base_freq on sliding layers. transformers keeps the soft-cap keys in
    the config but applies only the final one (neither is set in Google's checkpoints)."""

    qk_norm = True
    honours_attn_softcap = False
    sliding_window_pattern = 6
    sliding_theta_key = "rope_local_base_freq"
    default_theta = 1_000_000.0
    default_sliding_theta = 10000.0
    default_max_positions = 131072
    default_attn_softcap = None
    default_final_softcap = None
