"""OLMo 2 (Olmo2ForCausalLM), as transformers' modeling_olmo2.py computes it: no norm before
attention or the MLP; instead `post_attention_layernorm` normalises the attention output and
`post_feedforward_layernorm` the MLP output, each before its residual add; q_norm and k_norm
are RMSNorms over the whole q and k projections (all heads at once, before rotary), not per
head.

Under tensor parallelism each rank holds some heads, so those two norms span ranks: each rank
sums the squares of its part and one all-reduce (q's and k's sums together) gives every rank
the whole projection's mean square."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.models.layers import GatedMLP, RMSNorm
from ladle.models.llama import Attention, DecoderConfig, LlamaForCausalLM, ShardLayout
from ladle.runner.attention import AttentionMetadata, paged_attention
from ladle.runner.cpu_kernels import linear, rms_norm

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup


class Olmo2Attention(Attention):
    def __init__(self, cfg: DecoderConfig, layout: ShardLayout | None, tp: TPGroup | None):
        super().__init__(cfg, layout, tp)
        # This rank's part of the norms over the whole projections.
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.world_size = 1 if tp is None else tp.world_size

    def forward(self, x, positions, rotary, meta: AttentionMetadata, kv_cache):
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)  # (T, H*D), (T, KVH*D)
        q = q.view(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)  # (T, H, D)
        if self.tp is None:
            return linear(out.reshape(T, self.q_size), self.o_proj.weight, self.o_proj.bias)
        y = self.tp.all_reduce(linear(out.reshape(T, self.q_size), self.o_proj.weight, None))
        return y if self.o_proj.bias is None else y + self.o_proj.bias

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        if self.tp is None:
            return (rms_norm(q, self.q_norm.weight, self.q_norm.eps),
                    rms_norm(k, self.k_norm.weight, self.k_norm.eps))
        q32, k32 = q.float(), k.float()
        sums = torch.cat([q32.square().sum(-1, keepdim=True),
                          k32.square().sum(-1, keepdim=True)], dim=-1)  # (T, 2)
        self.tp.all_reduce(sums)
        # Every rank holds as many dims of each projection as the others (KV heads replicated
        # onto several ranks count once per rank in the sum and in the divisor alike).
        sizes = torch.tensor([self.q_size, self.kv_size], dtype=torch.float32,
                             device=sums.device) * self.world_size
        inv = torch.rsqrt(sums / sizes + self.q_norm.eps)  # (T, 2)
        # HF's Olmo2RMSNorm: the weight multiplies in float32, the product is rounded once.
        return ((self.q_norm.weight * (q32 * inv[:, :1])).to(q.dtype),
                (self.k_norm.weight * (k32 * inv[:, 1:])).to(k.dtype))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layout: ShardLayout | None, tp: TPGroup | None):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layout, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        intermediate = cfg.intermediate_size if layout is None else layout.intermediate_size
        self.mlp = GatedMLP(cfg.hidden_size, intermediate, bias=cfg.mlp_bias, tp=tp)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, meta, kv_cache):
        """x: the residual stream (T, hidden); returns it after this layer."""
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, rotary, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        super().__init__(hf_config, tp)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(self.config, self.layout, tp)
                                    for _ in range(self.config.num_layers))

    @classmethod
    def read_config(cls, hf_config: dict, switches: dict) -> DecoderConfig:
        # transformers' Olmo2Config defaults for keys a file leaves out.
        hf = {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, **hf_config}
        return DecoderConfig.from_hf(hf, **switches)

    has_residual = False  # each layer adds its own outputs (norms after attention and MLP)

    def run_layer(self, index: int, x, residual, positions, meta, kv_cache):
        return self.layers[index](x, positions, self.rotary, meta, kv_cache), None

    def final_norm(self, x: torch.Tensor, residual: None) -> torch.Tensor:
        return self.norm(x)

    def checkpoint_slice(self, pname: str, shard: int | None):
        """q_norm and k_norm weights follow their projection's split: this rank's heads."""
        lay, d = self.layout, self.config.head_dim
        module = pname.rsplit(".", 2)[-2]
        if lay is not None and module == "q_norm":
            return 0, lay.rank * lay.num_heads * d, lay.num_heads * d
        if lay is not None and module == "k_norm":
            return 0, lay.kv_head_start * d, lay.num_kv_heads * d
        return super().checkpoint_slice(pname, shard)
