"""Paged attention over a block-structured KV cache.

The cache of one layer is a pair of tensors (num_blocks, KVH, block_size, D): one block of one
head is contiguous, so reading a sequence's context is a walk over its block table. Each step
writes the new keys/values into their slots, then:
  - decode rows (one query each) go to the fused CPU kernel, which reads the blocks in place;
    elsewhere (or without a compiler) they take the torch path below;
  - prefill chunks run one scaled_dot_product_attention call each: a fresh prompt attends to its
    own keys causally, a chunk with cached context gathers its blocks and uses a bottom-right
    causal mask. One padded call for all chunks would be a single op, but on CPU the masked,
    padded kernel costs more than the whole forward of a chunk; a step has few prefill chunks.
  - decode rows also use a padded masked call when the fused kernel is unavailable."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ladle.runner import cpu_kernels


@dataclass(slots=True)
class DecodeBatch:
    """Every sequence with exactly one query this step, attended in one call."""

    rows: torch.Tensor  # (B,) rows of the flat token stream
    block_table: torch.Tensor  # (B, n) int64 blocks holding each sequence's context
    ctx_lens: torch.Tensor  # (B,) int64 cached tokens plus the query


@dataclass(slots=True)
class PrefillChunk:
    """One sequence with several queries this step."""

    q_start: int  # first row in the flat token stream
    q_len: int
    ctx_len: int  # cached tokens plus this chunk
    block_table: torch.Tensor | None  # (n,) its blocks; None for a fresh prompt (no context)
    mask: torch.Tensor | None  # (1, 1, q_len, n * bs) bottom-right causal; None when fresh


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # (T,) block written by each token of the step
    slot_offsets: torch.Tensor  # (T,) offset inside that block
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]


def build_prefill(q_start: int, q_len: int, ctx_len: int, blocks: torch.Tensor,
                  block_size: int, device) -> PrefillChunk:
    if q_len == ctx_len:
        return PrefillChunk(q_start, q_len, ctx_len, None, None)
    L = blocks.shape[0] * block_size
    kv_pos = torch.arange(L)
    q_pos = ctx_len - q_len + torch.arange(q_len)
    mask = (kv_pos[None, :] <= q_pos[:, None])[None, None].to(device)
    return PrefillChunk(q_start, q_len, ctx_len, blocks.to(device), mask)


def paged_attention(q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (k_cache, v_cache) each
    (num_blocks, KVH, block_size, D). Returns (T, H, D)."""
    k_cache, v_cache = kv_cache
    cpu_kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
    d = meta.decode
    if d is not None and not meta.prefills and d.rows.shape[0] == q.shape[0]:
        return decode_attention(q, k_cache, v_cache, d, scale)  # every row decodes, in order
    out = torch.empty_like(q)
    if d is not None:
        out[d.rows] = decode_attention(q[d.rows], k_cache, v_cache, d, scale)
    for c in meta.prefills:
        rows = slice(c.q_start, c.q_start + c.q_len)
        if c.block_table is None:  # fresh prompt: its own keys, causal
            kk, vv = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            out[rows] = _sdpa(q[rows][None], kk, vv, None, scale, causal=True)[0]
        else:
            kk = _gather(k_cache, c.block_table[None])
            vv = _gather(v_cache, c.block_table[None])
            out[rows] = _sdpa(q[rows][None], kk, vv, c.mask, scale, causal=False)[0]
    return out


def decode_attention(q, k_cache, v_cache, d: DecodeBatch, scale: float) -> torch.Tensor:
    """q: (B, H, D), one query per sequence, attending to all ctx_lens[i] cached tokens."""
    kernels = cpu_kernels.load_cpu_kernels() if cpu_kernels.supports(q) else None
    if kernels is not None:
        return kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, d.block_table,
                                              d.ctx_lens, scale)
    kk, vv = _gather(k_cache, d.block_table), _gather(v_cache, d.block_table)
    mask = torch.arange(kk.shape[2], device=q.device)[None, :] < d.ctx_lens[:, None]  # (B, L)
    return _sdpa(q[:, None], kk, vv, mask[:, None, None, :], scale, causal=False)[:, 0]


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(num_blocks, KVH, bs, D) gathered by (B, n) block ids -> (B, KVH, n * bs, D)."""
    B, n = block_table.shape
    _, KVH, bs, D = cache.shape
    blocks = cache.index_select(0, block_table.reshape(-1)).view(B, n, KVH, bs, D)
    return blocks.transpose(1, 2).reshape(B, KVH, n * bs, D)


def _sdpa(q, k, v, mask, scale, causal):
    """q (B, Q, H, D) with k, v (B, KVH, L, D) -> (B, Q, H, D); grouped-query heads shared."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[2] != k.shape[1],
    )
    return o.transpose(1, 2)
