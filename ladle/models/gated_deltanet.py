"""Gated DeltaNet linear attention, the recurrent layer of the Qwen3-Next and Qwen3.5 hybrid
models, over the engine's flat token stream: each sequence keeps a fixed-size state (a short
convolution window and a (head_k_dim, head_v_dim) matrix per value head) in a slot instead of
a KV cache that grows with its length.

Per token t of a sequence, for each value head (transformers' semantics, float32):

    q, k, v   = SiLU(causal depthwise conv1d over the last conv_kernel projected inputs)
    q, k      = l2-normalised per head; q *= head_k_dim ** -0.5
    beta      = sigmoid(b)                                 how much of the error is written
    g         = -exp(A_log) * softplus(a + dt_bias)        log of the state's decay, <= 0
    S         = exp(g) * S
    S         = S + k (beta * (v - S^T k))^T              the delta rule: write the error
    o         = S^T q
    out       = out_proj(RMSNorm(o) * norm.weight * SiLU(z))

With num_v_heads = r * num_k_heads, value head h reads query/key head h // r.

The two families share that arithmetic and differ in the input projection only:

- Qwen3-Next (`in_proj_qkvz`, `in_proj_ba`): two fused matrices whose output rows are grouped
  by key head. Row block j of in_proj_qkvz holds [q_j (head_k_dim) | k_j (head_k_dim) |
  v of value heads j*r .. j*r+r-1 (r*head_v_dim) | z of the same heads (r*head_v_dim)], and
  block j of in_proj_ba holds [b of those r heads | a of those r heads].
- Qwen3.5 and Qwen3.5-MoE (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`): four
  matrices, each in plain order; in_proj_qkv's rows are [all q | all k | all v], the channel
  order of the conv, so no regrouping is needed.
- Qwen3-Next as llama.cpp's converter stores it in a GGUF file (layout "qwen3_next_gguf"):
  in_proj_qkvz split into in_proj_qkv and in_proj_z in Qwen3.5's plain order, in_proj_ba kept
  fused and grouped by key head (an hf_config key from models/gguf/mapping.py picks it).

Everything else is the same in transformers 5: conv1d.weight (conv_dim, 1, conv_kernel) without
bias, dt_bias and A_log (num_v_heads,), the gated norm's weight of head_v_dim initialised to
ones and used as is (not the (1 + w) of the models' other RMSNorms), out_proj, and the
activation from `hidden_act` (SiLU). transformers' cache keeps the last conv_kernel projected
inputs (one more than the next step reads) in the model's dtype, and the recurrent state in
float32 whatever the model's dtype. Here both live in float32, and the conv window keeps the
conv_kernel - 1 inputs the next step reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ladle.runner.cpu_kernels import (
    batch_invariant,
    copy_rows,
    gated_delta_step,
    kernels_for,
    linear,
)

# The prefill form's chunk length (transformers' default): long enough for matmuls to pay,
# short enough that the (chunk, chunk) triangular solve stays cheap.
CHUNK_SIZE = 64

# config.json model_type -> projection layout; a multimodal Qwen3.5 file carries its text
# model's fields under text_config.
LAYOUTS = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
}
# The hf_config key that overrides the layout: models/gguf/mapping.py sets it for a Qwen3-Next
# GGUF file, whose converter split one projection and not the other.
LAYOUT_KEY = "linear_attn_layout"


@dataclass(frozen=True, slots=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_k_heads: int  # query/key heads (linear_num_key_heads)
    num_v_heads: int  # value heads, a multiple of num_k_heads (linear_num_value_heads)
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # taps of the causal conv (linear_conv_kernel_dim)
    eps: float  # the gated RMSNorm's epsilon (rms_norm_eps)
    # fused qkvz/ba, split qkv/z/b/a, or split qkv/z with fused ba (a Qwen3-Next GGUF file)
    layout: Literal["qwen3_next", "qwen3_5", "qwen3_next_gguf"]

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, hf: dict) -> GatedDeltaNetConfig:
        """Read a published config.json of Qwen3-Next, Qwen3.5 or Qwen3.5-MoE (the text model's
        fields, or a multimodal file's text_config). Missing keys take transformers' defaults."""
        model_type = hf.get("model_type")
        if model_type not in LAYOUTS:
            raise ValueError(f"config.json: model_type {model_type!r} has no Gated DeltaNet "
                             f"layers; accepted: {', '.join(LAYOUTS)}")
        text = hf.get("text_config") or hf
        activation = text.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"config.json: hidden_act {activation!r} is not supported by the "
                             "Gated DeltaNet layers; accepted: 'silu'")
        cfg = cls(
            hidden_size=text["hidden_size"],
            num_k_heads=text.get("linear_num_key_heads", 16),
            num_v_heads=text.get("linear_num_value_heads", 32),
            head_k_dim=text.get("linear_key_head_dim", 128),
            head_v_dim=text.get("linear_value_head_dim", 128),
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            eps=text.get("rms_norm_eps", 1e-6),
            layout=hf.get(LAYOUT_KEY, LAYOUTS[model_type]),
        )
        if cfg.layout not in ("qwen3_next", "qwen3_5", "qwen3_next_gguf"):
            raise ValueError(f"config: {LAYOUT_KEY} {cfg.layout!r}; accepted: qwen3_next, "
                             "qwen3_5, qwen3_next_gguf")
        if cfg.num_k_heads < 1 or cfg.num_v_heads % cfg.num_k_heads:
            raise ValueError(f"config.json: linear_num_value_heads ({cfg.num_v_heads}) must be "
                             "a multiple of linear_num_key_heads "
                             f"({cfg.num_k_heads}), which must be at least 1")
        if cfg.conv_kernel < 2:
            raise ValueError(f"config.json: linear_conv_kernel_dim ({cfg.conv_kernel}) must be "
                             "at least 2")
        return cfg


def state_bytes_per_slot(cfg: GatedDeltaNetConfig) -> int:
    """Bytes one sequence's state takes in one layer (conv window and recurrent matrix, float32)."""
    conv = cfg.conv_dim * (cfg.conv_kernel - 1)
    recurrent = cfg.num_v_heads * cfg.head_k_dim * cfg.head_v_dim
    return 4 * (conv + recurrent)


@dataclass(slots=True)
class GatedDeltaNetState:
    """One layer's state for `num_slots` sequences; a sequence owns one slot index while it
    runs, and the forward reads that row of both tensors and writes its new value.

    With `pending` a list (the engine's states), the new values wait there until `commit()`:
    a step that raises after some layers ran (a request's logits processor, say) leaves every
    slot as it was, so the step can run again. With `pending` None they land at once."""

    # (S, conv_dim, conv_kernel - 1) float32: the last projected q|k|v inputs, oldest first
    conv: torch.Tensor
    recurrent: torch.Tensor  # (S, num_v_heads, head_k_dim, head_v_dim) float32: S in o = S^T q
    pending: list | None = None  # (slots, conv, recurrent) writes not yet applied
    # Speculative rows' states after each of their positions, from committed steps:
    # (slots (D,), conv (D, L, ...), recurrent (D, L, ...)); settle() keeps one per slot.
    drafted: list = field(default_factory=list)

    @classmethod
    def allocate(cls, cfg: GatedDeltaNetConfig, num_slots: int,
                 device: torch.device | str | None = None,
                 deferred: bool = False) -> GatedDeltaNetState:
        conv = torch.zeros(num_slots, cfg.conv_dim, cfg.conv_kernel - 1,
                           dtype=torch.float32, device=device)
        recurrent = torch.zeros(num_slots, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim,
                                dtype=torch.float32, device=device)
        return cls(conv, recurrent, [] if deferred else None)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]

    def write(self, slots, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The new state of `slots` (an index or a (D,) tensor of them)."""
        if self.pending is None:
            self._put(slots, conv, recurrent)
        else:
            self.pending.append((slots, conv, recurrent))

    def _put(self, slots, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        copy_rows(self.conv, slots, conv)
        copy_rows(self.recurrent, slots, recurrent)

    def write_positions(self, slots: torch.Tensor, conv: torch.Tensor,
                        recurrent: torch.Tensor) -> None:
        """The states of `slots` (D,) after each position of a speculative step (conv
        (D, L, C, K - 1), recurrent (D, L, H, dk, dv)): which one holds is known only once the
        drafts are verified (settle)."""
        entry = (slots, conv, recurrent, True)
        if self.pending is None:
            self.drafted.append(entry[:3])
        else:
            self.pending.append(entry)

    def commit(self) -> None:
        """Apply the writes of the step that just succeeded (speculative rows' candidates wait
        for settle)."""
        for slots, conv, recurrent, *positions in self.pending or ():
            if positions:
                self.drafted.append((slots, conv, recurrent))
            else:
                self._put(slots, conv, recurrent)
        self.discard()

    def settle(self, kept: dict[int, int]) -> None:
        """Speculative rows: slot -> how many of its step's tokens were kept (its last token
        and the accepted drafts); the slot takes its state after the last kept one. Slots not
        named (finished requests) keep what they had."""
        for slots, conv, recurrent in self.drafted:
            pick = [(i, kept[s] - 1) for i, s in enumerate(slots.tolist()) if s in kept]
            if pick:
                rows = torch.tensor([i for i, _ in pick], device=conv.device)
                at = torch.tensor([j for _, j in pick], device=conv.device)
                self.conv[slots[rows]] = conv[rows, at]
                self.recurrent[slots[rows]] = recurrent[rows, at]
        self.drafted.clear()

    def discard(self) -> None:
        """Drop the writes of a step that failed: every slot keeps its state from before it.
        (Verified candidates, `drafted`, belong to a step that succeeded: settle takes them.)"""
        if self.pending:
            self.pending.clear()

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s state (a request forked from another)."""
        self.conv[dst] = self.conv[src]
        self.recurrent[dst] = self.recurrent[src]


class Segment(NamedTuple):
    """One sequence's contiguous run of tokens in a step's flat stream."""

    start: int  # index of its first token in the stream
    length: int  # number of tokens, at least 1
    slot: int  # the state slot it reads and updates
    fresh: bool  # True: the state starts from zero (its prompt's first chunk), not from the slot
    # Prefix caching: the state after the segment's first snap_len tokens (a block boundary)
    # is also written to slot snap_slot (0: no snapshot).
    snap_len: int = 0
    snap_slot: int = -1


def check_segments(segments: list[Segment], num_tokens: int, num_slots: int) -> None:
    """The segments must tile the stream [0, num_tokens) and name distinct slots in range."""
    end = 0
    for seg in sorted(segments, key=lambda s: s.start):
        if seg.start != end or seg.length < 1:
            raise ValueError(f"segments: {seg} does not continue the stream at token {end} with "
                             "at least one token; the segments must tile the step's tokens")
        if not 0 <= seg.slot < num_slots:
            raise ValueError(f"segments: {seg} names slot {seg.slot}; slots are 0..{num_slots - 1}")
        if seg.snap_len and not (0 < seg.snap_len <= seg.length and seg.length > 1
                                 and 0 <= seg.snap_slot < num_slots
                                 and seg.snap_slot != seg.slot):
            raise ValueError(f"segments: {seg} asks for a snapshot after {seg.snap_len} tokens "
                             f"in slot {seg.snap_slot}; a snapshot needs a segment of two or "
                             "more tokens, 1..length tokens and another slot in range")
        end += seg.length
    if end != num_tokens:
        raise ValueError(f"segments: cover {end} tokens of the step's {num_tokens}")
    if len({seg.slot for seg in segments}) != len(segments):
        raise ValueError("segments: two sequences share a slot; each needs its own")


@dataclass(slots=True)
class SegmentPlan:
    """A step's segments, checked and turned into index tensors once, for every linear layer
    of the step: the one-token segments (decode) as (D,) tensors, the longer ones as a list."""

    num_tokens: int
    decode_rows: torch.Tensor | None  # (D,) stream index of each one-token segment
    decode_slots: torch.Tensor | None  # (D,) its slot
    decode_keep: torch.Tensor | None  # (D,) bool: continues its slot (False: fresh)
    prefills: list[Segment]  # segments of two or more tokens
    # Speculative rows (a last token and its drafts): run a token at a time as decodes, their
    # state kept after every position until verification says which one holds.
    drafted: list[Segment] = field(default_factory=list)
    rows_in_order: bool = True  # decode_rows ascending (from_arrays: always)

    @property
    def decode_only(self) -> bool:
        """Every token of the step is a decode row, in stream order (decode_rows = 0 .. T-1)."""
        return self.decode_rows is not None and len(self.decode_rows) == self.num_tokens \
            and self.rows_in_order

    @classmethod
    def build(cls, segments: list[Segment], num_tokens: int, num_slots: int,
              device: torch.device | str | None = None) -> SegmentPlan:
        check_segments(segments, num_tokens, num_slots)
        decodes = [seg for seg in segments if seg.length == 1]
        rows = slots = keep = None
        if decodes:
            rows = torch.tensor([seg.start for seg in decodes], device=device)
            slots = torch.tensor([seg.slot for seg in decodes], device=device)
            keep = torch.tensor([not seg.fresh for seg in decodes], device=device)
        starts = [seg.start for seg in decodes]
        return cls(num_tokens, rows, slots, keep, [seg for seg in segments if seg.length > 1],
                   rows_in_order=starts == sorted(starts))

    @classmethod
    def from_arrays(cls, starts, lengths, slots, fresh, drafted=None,
                    device: torch.device | str | None = None, snap_lens=None,
                    snap_slots=None) -> SegmentPlan:
        """From numpy arrays (one entry per sequence, in stream order) that tile the stream by
        construction, as the model runner builds them: no per-sequence loop for decodes.
        `drafted` (bool, optional): the sequences verifying drafts this step; `snap_lens` and
        `snap_slots` (optional): the prefix-cache snapshot of each (see Segment)."""
        one = lengths == 1
        rows = keep = decode_slots = None
        if one.any():
            rows = torch.from_numpy(starts[one]).to(device)
            decode_slots = torch.from_numpy(slots[one]).to(device)
            keep = torch.from_numpy(~fresh[one]).to(device)

        if snap_lens is None:
            snap_lens = np.zeros(len(lengths), dtype=np.int64)
            snap_slots = np.full(len(lengths), -1, dtype=np.int64)

        def segments(which):
            return [Segment(int(s), int(n), int(slot), bool(f), int(sn), int(ss))
                    for s, n, slot, f, sn, ss in zip(starts[which], lengths[which],
                                                     slots[which], fresh[which],
                                                     snap_lens[which], snap_slots[which],
                                                     strict=True)]

        longer = ~one if drafted is None else ~one & ~drafted
        spec = [] if drafted is None else segments(~one & drafted)
        plan = cls(int(lengths.sum()), rows, decode_slots, keep, segments(longer), spec)
        return plan


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's form)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """The same rule over L tokens of one sequence, a chunk at a time: q, k (L, H, dk),
    v (L, H, dv), g, beta (L, H), state (H, dk, dv), all float32. Returns (o (L, H, dv), the
    state after the last token). Equal to L recurrent steps up to float32 rounding.

    Within a chunk whose tokens start from state S0, with G_t the cumulative sum of g from the
    chunk's start through t, the state after t is

        S_t = e^G_t S0 + sum_{s<=t} e^(G_t - G_s) k_s u_s^T

    where u_s (the delta of token s) solves the unit lower-triangular system
    (I + A) U = beta V - beta e^G K S0, A[t, s] = beta_t e^(G_t - G_s) k_t.k_s for s < t.
    So U = W_v - W_k S0 with W_v, W_k solved once for all chunks; only the hand-over of S
    from chunk to chunk is sequential."""
    num_tokens, num_heads, dv = v.shape
    dk = k.shape[-1]
    size = min(chunk_size, num_tokens)
    pad = -num_tokens % size  # zero-padded tokens (k = v = beta = g = 0) leave S unchanged
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # (H, L', d)
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # (H, L')
    q, k, v = (x.reshape(num_heads, -1, size, x.shape[-1]) for x in (q, k, v))  # (H, N, c, d)
    g, beta = (x.reshape(num_heads, -1, size) for x in (g, beta))  # (H, N, c)

    decay = g.cumsum(-1)  # (H, N, c): G_t
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # e^(G_t - G_s) for s <= t, else 0 (masked before exp: the exponent is > 0 there)
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, -torch.inf).exp()
    a = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * pair_decay).tril(-1)  # (H, N, c, c)
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * decay.exp()).unsqueeze(-1) * k], dim=-1)
    # unitriangular: the solver takes the diagonal as ones and reads only A's lower part
    w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    w_v, w_k = w.split([dv, dk], dim=-1)  # (H, N, c, dv), (H, N, c, dk)
    scores = (q @ k.transpose(-1, -2)) * pair_decay  # (H, N, c, c): within-chunk q.k, causal
    q_from_start = q * decay.exp().unsqueeze(-1)  # reads S0 decayed to t
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)  # writes decayed to chunk end
    chunk_decay = decay[..., -1].exp()[..., None, None]  # (H, N, 1, 1)

    out = torch.empty_like(v)
    for n in range(v.shape[1]):
        u = w_v[:, n] - w_k[:, n] @ state  # (H, c, dv)
        out[:, n] = q_from_start[:, n] @ state + scores[:, n] @ u
        state = state * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ u
    out = out.reshape(num_heads, -1, dv)[:, :num_tokens].transpose(0, 1)  # (L, H, dv)
    return out, state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, scaled by `weight` and gated by SiLU(z). The norm and
    gate run in float32; the normalised value is cast back to the input's dtype before the
    weight multiplies it (transformers' order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate (..., dim) -> (..., dim) in x's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer with the checkpoint's parameter names and shapes (the `layout`
    of the config picks the projections), run over a flat stream of many sequences."""

    def __init__(self, cfg: GatedDeltaNetConfig, tp=None):
        super().__init__()
        self.cfg = cfg  # with tensor parallelism, this rank's heads (out_proj row-parallel)
        self.tp = tp
        hidden, nv = cfg.hidden_size, cfg.num_v_heads
        if cfg.layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden, cfg.conv_dim + cfg.value_dim, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, cfg.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, cfg.value_dim, bias=False)
        if cfg.layout == "qwen3_5":
            self.in_proj_b = nn.Linear(hidden, nv, bias=False)
            self.in_proj_a = nn.Linear(hidden, nv, bias=False)
        else:
            self.in_proj_ba = nn.Linear(hidden, 2 * nv, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel,
                                groups=cfg.conv_dim, bias=False)  # only its weight is used
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = GatedRMSNorm(cfg.head_v_dim, cfg.eps)
        self.out_proj = nn.Linear(cfg.value_dim, hidden, bias=False)
        self.in_proj: torch.Tensor | None = None  # the input projections stacked (after_load)
        # Where out_proj's columns are held in another order than the values' (a GGUF file's
        # quantized blocks keep llama.cpp's tiled value heads: models/gguf/quantized.py), the
        # value channel each column multiplies: out_proj's input is gathered into that order.
        self.out_columns: torch.Tensor | None = None

    def _input_projections(self) -> list[nn.Linear]:
        if self.cfg.layout == "qwen3_5":
            return [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        if self.cfg.layout == "qwen3_next_gguf":
            return [self.in_proj_qkv, self.in_proj_z, self.in_proj_ba]
        return [self.in_proj_qkvz, self.in_proj_ba]

    def after_load(self) -> None:
        """One matmul instead of four (or two) per step: the input projections' weights are
        stacked once loaded, each parameter becoming a view of the stack (no second copy).
        Quantized weights keep their own matmuls."""
        weights = [m.weight for m in self._input_projections()]
        if not all(isinstance(w, nn.Parameter) and w.device.type != "meta"
                   and w.dtype == weights[0].dtype and w.is_floating_point() for w in weights):
            return
        stacked = torch.cat([w.data for w in weights])
        start = 0
        for w in weights:
            w.data = stacked[start:start + w.shape[0]]
            start += w.shape[0]
        self.in_proj = stacked

    def forward(self, x: torch.Tensor, segments: list[Segment] | SegmentPlan,
                state: GatedDeltaNetState) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). Each segment's tokens continue its slot's state (or
        start from zero when fresh), and the slot holds the state after its last token once
        written (see GatedDeltaNetState.pending). One-token segments (decode) run as one
        batched recurrent step; longer ones run the chunked form, one sequence at a time."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        plan = segments if isinstance(segments, SegmentPlan) else \
            SegmentPlan.build(segments, num_tokens, state.num_slots, x.device)
        if plan.num_tokens != num_tokens:
            raise ValueError(f"segments: cover {plan.num_tokens} tokens of the step's "
                             f"{num_tokens}")
        qkv, z, b, a = self._project(x)
        z = z.reshape(num_tokens, cfg.value_dim)
        if plan.decode_only:  # the step's rows are its decodes', in order
            return self._output(self._decode(qkv, z, b, a, plan, state))
        out = torch.empty(num_tokens, cfg.value_dim, dtype=x.dtype, device=x.device)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(qkv, z, b, a, plan, state)
        if batch_invariant() and plan.prefills:
            # A token's numbers must not depend on how its prompt was chunked: prefill chunks
            # run a token at a time through the decode step, as if decoded.
            self._by_position(qkv, z, b, a, plan.prefills, state, out)
        else:
            for seg in plan.prefills:
                self._prefill(qkv, z, b, a, seg, state, out)
        if plan.drafted:
            self._by_position(qkv, z, b, a, plan.drafted, state, out, drafted=True)
        return self._output(out)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The normalised, gated values (T, value_dim) through out_proj."""
        if self.out_columns is not None:
            out = out.index_select(-1, self.out_columns)
        out = linear(out, self.out_proj.weight)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _project(self, x: torch.Tensor):
        """x (T, hidden) -> q|k|v (T, conv_dim) in the conv's channel order, z (T, nv, dv),
        b and a (T, nv)."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        mods = self._input_projections()
        if self.in_proj is not None:
            outs = linear(x, self.in_proj).split([m.weight.shape[0] for m in mods], dim=-1)
        else:
            outs = [linear(x, m.weight) for m in mods]
        nk, r = cfg.num_k_heads, cfg.num_v_heads // cfg.num_k_heads
        if cfg.layout == "qwen3_5":
            qkv, z, b, a = outs
        elif cfg.layout == "qwen3_next_gguf":
            qkv, z = outs[:2]
        else:  # rows grouped by key head: regroup into [all q | all k | all v], z
            dk, dv = cfg.head_k_dim, cfg.head_v_dim
            qkvz = outs[0].reshape(num_tokens, nk, 2 * dk + 2 * r * dv)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
            qkv = torch.cat([t.reshape(num_tokens, -1) for t in (q, k, v)], dim=-1)
        if cfg.layout != "qwen3_5":  # in_proj_ba: [b | a] of each key head's r value heads
            ba = outs[-1].reshape(num_tokens, nk, 2 * r)
            b, a = (t.reshape(num_tokens, -1) for t in ba.split([r, r], dim=-1))
        return qkv, z.reshape(num_tokens, cfg.num_v_heads, cfg.head_v_dim), b, a

    def _heads(self, mixed: torch.Tensor, dtype: torch.dtype | None):
        """Conv output (..., conv_dim) float32 -> q, k (..., nv, dk) normalised, q scaled, each
        key head repeated for its value heads; v (..., nv, dv); all float32 after a round trip
        through the model's dtype (transformers' conv returns that dtype). dtype None: mixed
        comes from a kernel that made the round trip and the norms already."""
        cfg = self.cfg
        if dtype is not None:
            mixed = mixed.to(dtype).float()
        q, k, v = mixed.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        lead = mixed.shape[:-1]
        r = cfg.num_v_heads // cfg.num_k_heads
        q = q.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim)
        k = k.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim)
        if dtype is not None:
            q, k = l2_normalize(q) * cfg.head_k_dim**-0.5, l2_normalize(k)
        if r > 1:
            q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
        return q, k, v.reshape(*lead, cfg.num_v_heads, cfg.head_v_dim)

    def _gates(self, b: torch.Tensor, a: torch.Tensor):
        """beta = sigmoid(b) in the model's dtype (as in transformers) and the log decay
        g = -exp(A_log) * softplus(a + dt_bias) in float32, (L, nv) each."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return b.sigmoid(), g

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The rule's output core (L, nv, dv) float32, normalised and gated by z (L,
        value_dim): (L, value_dim) in z's dtype, out_proj's input."""
        cfg, n = self.cfg, core.shape[0]
        gate = z.reshape(n, cfg.num_v_heads, cfg.head_v_dim)
        return self.norm(core.to(z.dtype), gate).reshape(n, cfg.value_dim)

    def _step(self, conv_state, recurrent, at, keep, qkv, z, b, a):
        """One token of D sequences: conv windows (D, C, K - 1) float32, recurrent states
        `recurrent` (N, H, dk, dv) float32 of which sequence i reads row at[i] (zeros where
        keep[i] is False), the token's projections qkv (D, C), z (D, value_dim), b and a (D, H).
        Returns (the outputs (D, value_dim), normalised and gated, in qkv's dtype; the new
        windows; the new recurrent states (D, H, dk, dv)). One C++ call where the kernels run
        (gated_delta_decode); _step_torch, the layer's torch ops, is its twin. Every token that
        runs a step at a time (decodes, drafted rows, batch-invariant prompts) comes here, so
        its numbers do not depend on what else its step holds."""
        cfg = self.cfg
        kern = kernels_for(qkv, z, b, a, self.norm.weight)
        if kern is not None and recurrent.is_contiguous():
            weight = self.conv1d.weight.squeeze(1).float().contiguous()  # (C, K)
            return kern.gated_delta_decode(
                conv_state.contiguous(), weight, qkv, z, b, a, self.A_log, self.dt_bias,
                self.norm.weight, self.norm.eps, recurrent, at, keep, cfg.num_k_heads,
                cfg.head_k_dim)
        return self._step_torch(conv_state, recurrent, at, keep, qkv, z, b, a)

    def _step_torch(self, conv_state, recurrent, at, keep, qkv, z, b, a):
        beta, g = self._gates(b, a)
        weight = self.conv1d.weight.squeeze(1).float()  # (C, K)
        window = torch.cat([conv_state, qkv.float().unsqueeze(-1)], dim=-1)  # (D, C, K)
        mixed = F.silu((window * weight).sum(-1))  # (D, C): the conv's output for the new token
        q, k, v = self._heads(mixed, qkv.dtype)
        out, recurrent = gated_delta_step(q, k, v, g, beta.float(), recurrent, at, keep)
        return self._gated_norm(out, z), window[..., 1:], recurrent

    def _decode(self, qkv, z, b, a, plan: SegmentPlan, state: GatedDeltaNetState):
        """One token for each of D sequences, read from their slots: their outputs (D,
        value_dim)."""
        rows, slots, keep = plan.decode_rows, plan.decode_slots, plan.decode_keep
        if not plan.decode_only:
            qkv, z, b, a = qkv[rows], z[rows], b[rows], a[rows]
        conv_state = state.conv[slots]  # (D, C, K - 1)
        if not bool(keep.all()):  # a one-token prompt starts from zeros
            conv_state = torch.where(keep[:, None, None], conv_state, 0)
        y, conv, recurrent = self._step(conv_state, state.recurrent, slots, keep, qkv, z, b, a)
        state.write(slots, conv, recurrent)
        return y

    def _by_position(self, qkv, z, b, a, segments: list[Segment], state: GatedDeltaNetState,
                     out, drafted: bool = False):
        """Segments run position by position, each position a decode step over the rows that
        reach it: the arithmetic of decoding those tokens one step at a time. Speculative rows
        (`drafted`) keep the state after every position until verification says which one
        holds; other segments keep their last (and their prefix-cache snapshot)."""
        device = qkv.device
        slots = torch.tensor([seg.slot for seg in segments], device=device)
        starts = torch.tensor([seg.start for seg in segments], device=device)
        lengths = torch.tensor([seg.length for seg in segments], device=device)
        conv_state, recurrent = state.conv[slots], state.recurrent[slots]
        for j, seg in enumerate(segments):
            if seg.fresh:
                conv_state[j], recurrent[j] = 0, 0
        num = max(seg.length for seg in segments)
        if drafted:
            convs = conv_state.new_zeros(len(segments), num, *conv_state.shape[1:])
            recurrents = recurrent.new_zeros(len(segments), num, *recurrent.shape[1:])
        snap_positions = {seg.snap_len - 1 for seg in segments if seg.snap_len}
        keep = torch.ones(len(segments), dtype=torch.bool, device=device)
        for i in range(num):
            live = torch.nonzero(lengths > i).squeeze(1)  # rows with an i-th token
            rows = starts[live] + i
            out[rows], conv, rec = self._step(conv_state[live], recurrent, live,
                                              keep[:len(live)], qkv[rows], z[rows], b[rows],
                                              a[rows])
            conv_state[live], recurrent[live] = conv, rec
            if drafted:
                convs[live, i], recurrents[live, i] = conv, rec
            if i in snap_positions:
                for j, seg in enumerate(segments):
                    if seg.snap_len == i + 1:
                        state.write(seg.snap_slot, conv_state[j].clone(), recurrent[j].clone())
        if drafted:
            state.write_positions(slots, convs, recurrents)
        else:
            state.write(slots, conv_state, recurrent)

    def _prefill(self, qkv, z, b, a, seg: Segment, state: GatedDeltaNetState, out):
        """A run of seg.length > 1 tokens of one sequence. With a snapshot (prefix caching),
        the rule runs in two parts split after seg.snap_len tokens, and the state between them
        is written to seg.snap_slot as well."""
        rows = slice(seg.start, seg.start + seg.length)
        conv_state, recurrent = state.conv[seg.slot], state.recurrent[seg.slot]
        if seg.fresh:
            conv_state, recurrent = torch.zeros_like(conv_state), torch.zeros_like(recurrent)
        x = qkv[rows]
        q, k, v, last = self._conv_prompt(conv_state, x)  # (L, nv, d)
        beta, g = self._gates(b[rows], a[rows])
        beta = beta.float()
        core = torch.empty(seg.length, *v.shape[1:], dtype=torch.float32, device=v.device)
        keep = self.cfg.conv_kernel - 1
        cuts = [0, seg.snap_len, seg.length] if 0 < seg.snap_len < seg.length else \
            [0, seg.length]
        for lo, hi in itertools.pairwise(cuts):
            core[lo:hi], recurrent = chunked_gated_delta_rule(
                q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], recurrent)
            if hi == seg.snap_len:  # the window after token hi: its last K - 1 inputs
                before = torch.cat([conv_state, x[max(0, hi - keep):hi].float().T], dim=-1)
                state.write(seg.snap_slot, before[:, -keep:].clone(), recurrent)
        state.write(seg.slot, last, recurrent)
        out[rows] = self._gated_norm(core, z[rows])

    def _conv_prompt(self, conv_state: torch.Tensor, x: torch.Tensor):
        """A prompt's conv part: conv_state (C, K - 1) float32 (the inputs kept before it) and
        x (L, C) its projected q|k|v -> _heads' q, k, v (L, nv, d) and the window after its
        last token. One C++ call where the kernels run (gated_delta_conv_prefill: the conv, SiLU,
        the round trip through the model's dtype and the q/k norms, reading x as it lies);
        _conv_prompt_torch is its twin."""
        cfg = self.cfg
        kern = kernels_for(x)
        if kern is not None:
            weight = self.conv1d.weight.squeeze(1).float().contiguous()  # (C, K)
            mixed, last = kern.gated_delta_conv_prefill(conv_state.contiguous(), weight, x,
                                                        cfg.num_k_heads, cfg.head_k_dim)
            return (*self._heads(mixed, None), last)
        return self._conv_prompt_torch(conv_state, x)

    def _conv_prompt_torch(self, conv_state: torch.Tensor, x: torch.Tensor):
        window = torch.cat([conv_state, x.float().T], dim=-1)  # (C, K - 1 + L)
        mixed = F.conv1d(window.unsqueeze(0), self.conv1d.weight.float(),
                         groups=self.cfg.conv_dim)  # (1, C, L): one output per new token
        return (*self._heads(F.silu(mixed[0].T), x.dtype), window[:, 1 - self.cfg.conv_kernel:])
