"""The Llama decoder, which Qwen2 and Qwen3 specialise with a few switches.

Tokens of all sequences in a step are flattened into one (T,) stream; attention splits them back
into sequences through the AttentionMetadata that the model runner builds once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ladle.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from ladle.runner.attention import AttentionMetadata, paged_attention
from ladle.runner.cpu_kernels import linear


@dataclass(slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v only
    o_bias: bool = False  # Llama's `attention_bias` also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalises each head of q and k before rotary

    @classmethod
    def from_hf(cls, hf: dict, **switches) -> DecoderConfig:
        """Read a published config.json. Older files carry rope_theta/rope_scaling at the top
        level; transformers 5 writes them inside rope_parameters. Both are accepted."""
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or rope or None
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if hf.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported by ladle")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **switches,
        )


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v share one matmul; the loader writes the three checkpoint tensors into slices.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, rotary, meta: AttentionMetadata, kv_cache):
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = rotary.with_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # (T, H, D)
        return linear(out.reshape(T, self.q_size), self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, x, residual, positions, rotary, meta, kv_cache):
        """Returns (this layer's MLP output, the residual stream before it). The residual add is
        deferred into the next norm, so each add and norm is one pass (same sums, same order as
        `x = x + f(norm(x))`)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    switches: dict = {}

    def __init__(self, hf_config: dict):
        super().__init__()
        if hf_config.get("mlp_bias") or hf_config.get("attention_bias"):
            switches = {**self.switches, "mlp_bias": bool(hf_config.get("mlp_bias"))}
            if hf_config.get("attention_bias"):
                switches.update(qkv_bias=True, o_bias=True)
        else:
            switches = dict(self.switches)
        cfg = self.config = DecoderConfig.from_hf(hf_config, **switches)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        if cfg.tie_word_embeddings:
            self.lm_head = None  # the embedding matrix doubles as the output projection
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, hidden)."""
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, meta, kv_cache)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) for the positions that sample; the head is the most expensive
        matmul, so it runs only on those rows, never on every prompt token."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)

    # Checkpoint names that map into a fused parameter: name fragment -> (fused, shard index).
    stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        return [cfg.intermediate_size] * 2
