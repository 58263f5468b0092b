"""Paged attention over a block-structured KV cache, built from torch ops so it runs on any device.

The cache of one layer is a pair of tensors (num_slots, KVH, D) where slot = block * block_size +
offset. Each step writes the new keys/values into their slots, then gathers every sequence's slots
into a padded (B, L) layout and calls scaled_dot_product_attention with a mask. Sequences are
split into a decode group (one query each) and a prefill group, so one long prompt chunk does not
pad the queries of every decoding sequence to its length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttnGroup:
    """Sequences attended together in one padded SDPA call."""

    q_index: torch.Tensor  # (B, Qmax) rows of the flat token stream; padding repeats a valid row
    q_valid: torch.Tensor  # (B, Qmax) bool, False on padding
    kv_slots: torch.Tensor  # (B, L) cache slots of each sequence's context, padding points at 0
    mask: torch.Tensor | None  # (B, 1, Qmax, L) bool, True = may attend; None = attend to all L
    is_causal_fresh: bool  # one sequence, no cached context: attend to k/v directly, causally


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot written by each token of the step
    groups: list[AttnGroup]


def build_group(
    q_starts: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    slot_rows: list[list[int]] | torch.Tensor,
    device: torch.device,
) -> AttnGroup:
    """Padded layout for a set of sequences. ctx_lens count cached tokens plus this step's
    queries; slot_rows[i] lists the first ctx_lens[i] slots of sequence i."""
    B, Qmax, L = len(q_lens), max(q_lens), max(ctx_lens)
    q_lens_t = torch.tensor(q_lens)
    ctx_t = torch.tensor(ctx_lens)
    offs = torch.arange(Qmax)
    q_valid = offs[None, :] < q_lens_t[:, None]  # (B, Qmax)
    q_index = torch.tensor(q_starts)[:, None] + torch.minimum(offs[None, :], q_lens_t[:, None] - 1)
    if isinstance(slot_rows, torch.Tensor):
        kv_slots = slot_rows
    else:
        kv_slots = torch.zeros(B, L, dtype=torch.long)
        for i, row in enumerate(slot_rows):
            kv_slots[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    is_causal_fresh = B == 1 and q_lens[0] == ctx_lens[0] and q_lens[0] > 1
    mask = None
    if not is_causal_fresh and not (Qmax == 1 and min(ctx_lens) == L):
        kv_pos = torch.arange(L)
        # A query at offset j of sequence i sits at absolute position ctx - q_len + j.
        q_pos = (ctx_t - q_lens_t)[:, None] + offs[None, :]  # (B, Qmax)
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < ctx_t[:, None, None])
        mask |= ~q_valid[:, :, None] & (kv_pos[None, None, :] == 0)  # keep padded rows finite
        mask = mask.unsqueeze(1).to(device)
    return AttnGroup(
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        kv_slots=kv_slots.to(device),
        mask=mask,
        is_causal_fresh=is_causal_fresh,
    )


def paged_attention(q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (k_cache, v_cache) each (num_slots, KVH, D).
    Returns (T, H, D)."""
    k_cache, v_cache = kv_cache
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if len(meta.groups) == 1 and meta.groups[0].is_causal_fresh:
        # A single fresh prompt: no gather, no mask.
        o = _sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, scale, causal=True)
        return o[0]
    out = torch.empty_like(q)
    for g in meta.groups:
        if g.is_causal_fresh:
            rows = g.q_index[0]
            out[rows] = _sdpa(q[rows][None], k[rows][None], v[rows][None], None, scale, True)[0]
            continue
        qg = q[g.q_index]  # (B, Qmax, H, D)
        kg = k_cache[g.kv_slots]  # (B, L, KVH, D)
        vg = v_cache[g.kv_slots]
        o = _sdpa(qg, kg, vg, g.mask, scale, causal=False)  # (B, Qmax, H, D)
        if g.q_index.shape[1] == 1:
            out[g.q_index[:, 0]] = o[:, 0]
        else:
            out[g.q_index[g.q_valid]] = o[g.q_valid]
    return out


def _sdpa(q, k, v, mask, scale, causal):
    """(B, Q, H, D) x (B, L, KVH, D) -> (B, Q, H, D), grouped-query heads shared."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)
