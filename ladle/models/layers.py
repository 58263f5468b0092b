"""Layers shared by the decoder architectures: RMSNorm (and Gemma's (1 + w) variant), rotary
embedding (with HF rope scaling), the gated MLP (SiLU or GELU). Paged attention lives in
runner/attention.py because it depends on the KV cache. The arithmetic goes through runner/cpu_kernels.py, which uses the fused CPU kernels where they
apply and their pure-torch twins elsewhere."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ladle.runner import cpu_kernels

if TYPE_CHECKING:
    from ladle.distributed.group import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with a residual, returns (RMSNorm(residual + x), residual + x), the sum
        formed in one pass with the norm (the kernel updates `residual` in place)."""
        if residual is None:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w, the scale is (1 + w), and the whole product is
    formed in float32 and cast once (HF: `(x.float() * rsqrt(...)) * (1 + w.float())`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self._scale: tuple[int, torch.Tensor] | None = None  # (weight version, 1 + w float32)

    def scale(self) -> torch.Tensor:
        """1 + w in float32, computed once per value of the weight (a load or any in-place
        change bumps the tensor's version, so a stale scale is never used)."""
        version = self.weight._version
        if self._scale is None or self._scale[0] != version:
            self._scale = (version, self.weight.detach().float() + 1)
        return self._scale[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As RMSNorm.forward: with a residual, (norm(residual + x), residual + x)."""
        return cpu_kernels.gemma_rms_norm(x, self.weight, self.eps, residual, scale=self.scale())


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for rotary embedding, with HF's `rope_scaling` types applied.

    Returns (inv_freq, attention_factor). Supported types: default, linear, llama3, yarn."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float(), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, blended, scaled).float(), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3, yarn"
    )


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict
          ) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): frequencies that turn fewer than
    beta_slow times over the original context are interpolated by `factor`, those that turn more
    than beta_fast times are kept, a linear ramp between; cos/sin scaled by the attention factor
    (0.1 ln(factor) + 1, or mscale / mscale_all_dim's ratio)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    return (inv_freq / factor * (1 - keep) + inv_freq * keep).float(), float(attention)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (the rotate-half layout HF Llama/Qwen use)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = \
            head_dim, max_positions, theta, scaling
        if torch.get_default_device().type == "meta":  # the loader's build: rebuilt after it
            # (The tables' arithmetic on meta runs torch._refs kernels, which import
            # torch._dynamo: 1.1 s of the engine's start; see llama.vocab_layers.)
            self.register_buffer("cos", torch.empty(max_positions, head_dim // 2),
                                 persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim // 2),
                                 persistent=False)
        else:
            self.rebuild()

    def rebuild(self, device: torch.device | None = None) -> None:
        """(Re)compute the float32 cos/sin tables on the default device, then move them to
        `device`: the loader calls this after building the model on the meta device."""
        inv_freq, attn_factor = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        cos, sin = freqs.cos() * attn_factor, freqs.sin() * attn_factor
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: (T, H, D), k: (T, KVH, D); positions: (T,). The kernel rotates in place.
        return cpu_kernels.rotary(positions, q, k, self.cos, self.sin)

    def with_qk_norm(self, positions, q, k, q_norm: RMSNorm, k_norm: RMSNorm):
        """Qwen3: RMSNorm of every q and k head, then rotary, as one op where the kernel runs."""
        return cpu_kernels.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight,
                                          q_norm.eps, self.cos, self.sin)


class PartialRotaryEmbedding(RotaryEmbedding):
    """Neox rotary on the first `rotary_dim` dims of each head only, the rest passed through
    (Phi-3's partial_rotary_factor). The tables span rotary_dim; the rotated dims are copied
    out, rotated by the same kernel and copied back, so RotaryEmbedding's own path (every
    other family) is untouched."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict | None):
        super().__init__(rotary_dim, max_positions, theta, scaling)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        rd = self.head_dim  # the rotated dims (RotaryEmbedding's tables are built for them)
        if rd == q.shape[-1]:
            return super().forward(positions, q, k)
        q_rot, k_rot = cpu_kernels.rotary(positions, q[..., :rd].contiguous(),
                                          k[..., :rd].contiguous(), self.cos, self.sin)
        q[..., :rd] = q_rot  # q, k: views of this step's qkv output, written in place
        k[..., :rd] = k_rot
        return q, k


class GatedMLP(nn.Module):
    """Gated MLP with gate and up projections fused into one matmul: SwiGLU by default, GeGLU
    with `activation` "gelu_tanh" (Gemma's gelu_pytorch_tanh) or "gelu" (exact erf)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 tp: TPGroup | None = None, activation: str = "silu"):
        """Tensor-parallel: `intermediate` is this rank's slice (gate/up column-parallel, down
        row-parallel, one all-reduce)."""
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.tp = tp
        if activation not in ("silu", "gelu_tanh", "gelu"):
            raise ValueError(f"MLP activation {activation!r} is not supported; supported: "
                             "silu, gelu_tanh, gelu")
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.gate_up_proj
        gate_up = cpu_kernels.linear(x, p.weight, p.bias)
        if self.activation == "silu":
            h = cpu_kernels.silu_mul(gate_up)
        else:
            h = cpu_kernels.gelu_mul(gate_up, "tanh" if self.activation == "gelu_tanh" else "none")
        if self.tp is None:
            return cpu_kernels.linear(h, self.down_proj.weight, self.down_proj.bias)
        y = self.tp.all_reduce(cpu_kernels.linear(h, self.down_proj.weight, None))
        return y if self.down_proj.bias is None else y + self.down_proj.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + num_local) of the (padded) embedding matrix. A token outside the
    slice looks up zeros here, so the all-reduce sum is exactly the one rank's row."""

    def __init__(self, num_local: int, hidden: int, start: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local, hidden))
        self.num_local, self.start, self.tp = num_local, start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))
