"""Phi-3 and Phi-4 (Phi3ForCausalLM), as transformers' modeling_phi3.py computes them: the
Llama decoder over checkpoints that store q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj`, rotary on the first `partial_rotary_factor` of each head's dims, LongRoPE
(`rope_scaling` type "longrope"; "su" and "yarn" are its old names), and `sliding_window` on
every layer when set.

LongRoPE has two factor sets. transformers' `generate` rotates a sequence wholly with
short_factor while it is at most original_max_position_embeddings long, and wholly with
long_factor once it is longer: at the step that crosses that length, Phi3ForCausalLM's
prepare_inputs_for_generation drops the KV cache and recomputes every earlier token with the
long factors. A paged server cannot follow that per request (the crossing would re-prefill the
request, and cached prefix blocks would need a key per factor set), so ladle does what vLLM
does: one factor set for the whole engine, long_factor when the served context
(max_model_len; the checkpoint's max_position_embeddings when not given) exceeds
original_max_position_embeddings, short_factor otherwise. That equals transformers for every
sequence when max_model_len <= original_max_position_embeddings, and, with a longer
max_model_len, for every prompt longer than the original length. With a longer max_model_len,
a sequence that stays within the original length gets the long factors here and the short
ones in transformers, and one that crosses it while generating differs in the tokens before
the crossing. Both scale cos/sin by the same attention factor for either set. The engine
passes max_model_len in the config dict (registry.SERVED_LEN_KEY); "auto" counts as the
checkpoint's maximum."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ladle.models.layers import PartialRotaryEmbedding, RotaryEmbedding
from ladle.models.llama import DecoderConfig, LlamaForCausalLM
from ladle.models.registry import SERVED_LEN_KEY

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup

ROPE_TYPES = ("default", "longrope")
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LongRope:
    factors: tuple[float, ...]  # the chosen set, one per rotated frequency (rotary_dim / 2)
    is_long: bool  # long_factor (the served context exceeds the original length) or short
    original_max_positions: int
    attention_factor: float  # cos and sin are scaled by it (for either set)


@dataclass(frozen=True, slots=True)
class Phi3Rope:
    theta: float
    rotary_dim: int  # int(head_dim * partial_rotary_factor)
    longrope: LongRope | None


def read_rope(hf: dict, head_dim: int) -> Phi3Rope:
    """Phi-3's rope from config.json as transformers' Phi3Config reads it: `rope_scaling` (older
    files) or else `rope_parameters`; rope_theta and partial_rotary_factor inside it or at the
    top level; the top-level original_max_position_embeddings (default 4096) wins over one
    inside the dict. The LongRoPE factor set is chosen by the served context, which the engine
    puts under SERVED_LEN_KEY (the module docstring says why)."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("su", "yarn"):
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json: rope type {kind!r} is not supported for Phi3ForCausalLM; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"config.json: partial_rotary_factor {partial} gives {rotary_dim} "
                         f"rotated dims of {head_dim}; accepted: an even number from 2 to "
                         "head_dim")
    if kind == "default":
        return Phi3Rope(theta, rotary_dim, None)
    original = int(hf.get("original_max_position_embeddings", 4096))
    max_positions = hf.get("max_position_embeddings", 4096)
    served = hf.get(SERVED_LEN_KEY)
    if not isinstance(served, int) or served < 1:  # not given, or "auto": up to the maximum
        served = max_positions
    is_long = served > original
    name = "long_factor" if is_long else "short_factor"
    factors = tuple(float(f) for f in params[name])
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"config.json: rope {name} has {len(factors)} entries; accepted: "
                         f"{rotary_dim // 2} (half the rotated dims)")
    factor = params.get("factor")
    if factor is None:  # Phi-3: the ratio of the served to the pretraining length
        factor = max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else \
            math.sqrt(1 + math.log(factor) / math.log(original))
    return Phi3Rope(theta, rotary_dim, LongRope(factors, is_long, original,
                                                float(attention_factor)))


class LongRopeEmbedding(PartialRotaryEmbedding):
    """Rotary with one LongRoPE factor set: inverse frequencies divided by the factors and
    cos/sin scaled by the attention factor, in float32 as transformers'
    _compute_longrope_parameters computes them."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, longrope: LongRope):
        self.longrope = longrope  # read by rebuild(), which the base __init__ calls
        super().__init__(rotary_dim, max_positions, theta, None)

    def rebuild(self, device: torch.device | None = None) -> None:
        lr, dim = self.longrope, self.head_dim
        if device is not None and lr.is_long:  # the load's rebuild, on the real device
            logger.info("Phi-3 LongRoPE: long factors at every position, as max_model_len is "
                        "above original_max_position_embeddings (%d); a max_model_len of at "
                        "most that uses the short ones, as transformers does for sequences "
                        "that short", lr.original_max_positions)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (torch.tensor(lr.factors, dtype=torch.float32) * self.theta ** exponents)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * lr.attention_factor, freqs.sin() * lr.attention_factor
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint stores each fused parameter whole: one checkpoint tensor, shard 0 of 1.
    stacked = {"qkv_proj": ("qkv_proj", 0), "gate_up_proj": ("gate_up_proj", 0)}

    def __init__(self, hf_config: dict, tp: TPGroup | None = None):
        super().__init__(hf_config, tp)
        cfg = self.config
        rope = read_rope(hf_config, cfg.head_dim)
        if rope.longrope is not None:
            self.rotary = LongRopeEmbedding(rope.rotary_dim, cfg.max_position_embeddings,
                                            rope.theta, rope.longrope)
        elif rope.rotary_dim < cfg.head_dim:
            self.rotary = PartialRotaryEmbedding(rope.rotary_dim, cfg.max_position_embeddings,
                                                 rope.theta, None)
        else:
            self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                          rope.theta, None)

    @classmethod
    def read_config(cls, hf_config: dict, switches: dict) -> DecoderConfig:
        # transformers' Phi3Config defaults for keys a file leaves out.
        hf = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, **hf_config}
        cfg = DecoderConfig.from_hf(hf, **switches, sliding_window=hf.get("sliding_window"))
        cfg.rope_scaling = None  # Phi-3's rope (partial, LongRoPE): read_rope, in __init__
        return cfg

    def shard_sizes(self, module: str) -> list[int]:
        """One checkpoint tensor fills each fused parameter (this rank's rows of it)."""
        return [sum(super().shard_sizes(module))]

    def checkpoint_slice(self, pname: str, shard: int | None):
        """With tensor parallelism, this rank's q, k and v rows (or gate and up rows) of the
        fused checkpoint tensor, as parts the loader joins in that order."""
        lay, cfg = self.layout, self.config
        module = pname.rsplit(".", 2)[-2]
        if lay is None or module not in ("qkv_proj", "gate_up_proj"):
            return super().checkpoint_slice(pname, shard)
        if module == "gate_up_proj":
            n = lay.intermediate_size
            return [(0, lay.rank * n, n), (0, cfg.intermediate_size + lay.rank * n, n)]
        d = cfg.head_dim
        q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
        kv_start, kv_len = lay.kv_head_start * d, lay.num_kv_heads * d
        return [(0, lay.rank * lay.num_heads * d, lay.num_heads * d),
                (0, q_rows + kv_start, kv_len),
                (0, q_rows + kv_rows + kv_start, kv_len)]
