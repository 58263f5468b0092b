"""Granite (GraniteForCausalLM, IBM Granite 3.x dense): the Llama decoder with four scalars, as
transformers' modeling_granite.py applies them: embeddings times `embedding_multiplier`, each
attention and MLP output times `residual_multiplier` before its residual add, attention scores
scaled by `attention_multiplier` (instead of head_dim ** -0.5) and the logits divided by
`logits_scaling`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.models.llama import DecoderConfig, DecoderLayer, LlamaForCausalLM, ShardLayout

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg: DecoderConfig, layout: ShardLayout | None, tp: TPGroup | None,
                 attention_multiplier: float, residual_multiplier: float):
        super().__init__(cfg, layout, tp)
        self.self_attn.scale = attention_multiplier
        self.residual_multiplier = residual_multiplier

    def forward(self, x, residual, positions, rotary, meta, kv_cache):
        """As DecoderLayer.forward (the residual add deferred into the next norm), with each
        block's output scaled before it is added: HF's `residual + h * residual_multiplier`."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, meta, kv_cache).mul_(self.residual_multiplier)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h).mul_(self.residual_multiplier), residual


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        super().__init__(hf_config, tp)
        # transformers' GraniteConfig defaults are 1.0 for all four.
        self.embedding_multiplier = float(hf_config.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(hf_config.get("logits_scaling", 1.0))
        attn = float(hf_config.get("attention_multiplier", 1.0))
        resid = float(hf_config.get("residual_multiplier", 1.0))
        self.layers = nn.ModuleList(GraniteDecoderLayer(self.config, self.layout, tp, attn, resid)
                                    for _ in range(self.config.num_layers))

    @classmethod
    def read_config(cls, hf_config: dict, switches: dict) -> DecoderConfig:
        return DecoderConfig.from_hf({"max_position_embeddings": 2048, **hf_config}, **switches)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor,
                       indices: torch.Tensor | None = None) -> torch.Tensor | None:
        logits = super().compute_logits(hidden, indices)
        # Divided, as HF does (not multiplied by the reciprocal, which rounds differently).
        return None if logits is None else logits / self.logits_scaling
