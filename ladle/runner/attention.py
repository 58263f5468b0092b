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
  - decode rows also use a padded masked call when the fused kernel is unavailable.

Two per-layer options (Gemma), both off by default, where the paths above run unchanged:
  - a sliding window: the query at position p attends keys at positions j with
    p - window < j <= p (transformers' and llama.cpp's rule). The decode kernel starts its walk
    at the window's first block; a prefill chunk reads only the blocks its window reaches, with a
    banded mask built by the first layer of the step that asks for it (PrefillChunk.keys_for).
  - soft-capping of the scores, cap * tanh(s / cap), before the softmax. The kernel applies it;
    SDPA cannot, so prefill (and the decode twin) take an explicit matmul-softmax path."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    block_size: int
    # window -> (blocks, mask) for each sliding window that cuts this chunk's context: built by
    # the step's first layer with that window, reused by the others.
    windows: dict = field(default_factory=dict)

    def keys_for(self, window: int | None, device) -> tuple[torch.Tensor | None,
                                                            torch.Tensor | None]:
        """(block_table, mask) of the keys a layer with this sliding window reads (None: no
        window). Those of the chunk when the window spans its whole context; else the blocks
        from the one holding the first query's earliest key, under a banded mask
        (1, 1, q_len, L). A fresh prompt keeps block_table None: it reads its own keys."""
        if window is None or window >= self.ctx_len:
            return self.block_table, self.mask
        if window not in self.windows:
            q0 = self.ctx_len - self.q_len  # position of the first query
            q_pos = q0 + torch.arange(self.q_len)  # (Q,)
            blocks, kv_pos = None, torch.arange(self.q_len)  # (L,)
            if self.block_table is not None:
                first = max(0, q0 - window + 1) // self.block_size
                blocks = self.block_table[first:]
                kv_pos = first * self.block_size + torch.arange(blocks.shape[0] * self.block_size)
            band = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
            self.windows[window] = (blocks, band[None, None].to(device))  # (1, 1, Q, L)
        return self.windows[window]


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # (T,) block written by each token of the step
    slot_offsets: torch.Tensor  # (T,) offset inside that block
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    # Hybrid models: which tokens continue which state slot (models/gated_deltanet.py's
    # SegmentPlan), for the linear-attention layers; None for other models.
    states: object | None = None


def build_prefill(q_start: int, q_len: int, ctx_len: int, blocks: torch.Tensor,
                  block_size: int, device) -> PrefillChunk:
    if q_len == ctx_len:
        return PrefillChunk(q_start, q_len, ctx_len, None, None, block_size)
    L = blocks.shape[0] * block_size
    kv_pos = torch.arange(L)
    q_pos = ctx_len - q_len + torch.arange(q_len)
    mask = (kv_pos[None, :] <= q_pos[:, None])[None, None].to(device)
    return PrefillChunk(q_start, q_len, ctx_len, blocks.to(device), mask, block_size)


def paged_attention(q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, KVH, D); kv_cache: (k_cache, v_cache) each
    (num_blocks, KVH, block_size, D). Returns (T, H, D). `window`: this layer's sliding window
    (None: full attention); `softcap`: cap of cap * tanh(scores / cap) (None: off); `sinks`:
    gpt-oss's learned per-head logit (H,) that joins every softmax's denominator and adds no
    value (None: off)."""
    k_cache, v_cache = kv_cache
    cpu_kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
    d = meta.decode
    if d is not None and not meta.prefills and d.rows.shape[0] == q.shape[0]:
        # every row decodes, in order
        return decode_attention(q, k_cache, v_cache, d, scale, window, softcap, sinks)
    out = torch.empty_like(q)
    if d is not None:
        out[d.rows] = decode_attention(q[d.rows], k_cache, v_cache, d, scale, window, softcap,
                                       sinks)
    for c in meta.prefills:
        rows = slice(c.q_start, c.q_start + c.q_len)
        blocks, mask = c.keys_for(window, q.device)
        if blocks is None:  # fresh prompt: its own keys, causal (and banded by a window)
            kk, vv = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
        else:
            kk, vv = _gather(k_cache, blocks[None]), _gather(v_cache, blocks[None])
        if softcap is None and sinks is None:
            out[rows] = _sdpa(q[rows][None], kk, vv, mask, scale, causal=mask is None)[0]
        else:
            out[rows] = _eager(q[rows][None], kk, vv, mask, scale, softcap, sinks)[0]
    return out


def decode_attention(q, k_cache, v_cache, d: DecodeBatch, scale: float,
                     window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, H, D), one query per sequence, attending to its cached tokens: all ctx_lens[i],
    or the last `window` of them. Outside batch-invariant mode the kernel may attend a prefill
    chunk's rows (16 or more) in tiles (AMX-BF16 or AVX512-BF16): within rounding of the rows
    attended alone."""
    kernels = cpu_kernels.load_cpu_kernels() if cpu_kernels.supports(q) else None
    if kernels is not None:
        return kernels.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, d.block_table, d.ctx_lens, scale, window or 0,
            softcap or 0.0, None if sinks is None else sinks.float().contiguous(),
            not cpu_kernels.batch_invariant())
    # The kernel's twin: every block gathered, the window and the context length as a mask.
    kk, vv = _gather(k_cache, d.block_table), _gather(v_cache, d.block_table)
    pos = torch.arange(kk.shape[2], device=q.device)[None, :]  # (1, L)
    mask = pos < d.ctx_lens[:, None]  # (B, L)
    if window is not None:
        mask &= pos >= d.ctx_lens[:, None] - window
    if softcap is not None or sinks is not None:
        return _eager(q[:, None], kk, vv, mask[:, None, None, :], scale, softcap, sinks)[:, 0]
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


# Scores per block of query rows in the eager path, which materialises (B, H, rows, L).
_SOFTCAP_SCORES = 1 << 24


def _eager(q, k, v, mask, scale, softcap=None, sinks=None):
    """Attention in HF's eager order: (q . k) * scale, then (with `softcap`)
    cap * tanh(s / cap), the mask, softmax (with `sinks` (H,): over the scores and the head's
    sink logit, whose share is then dropped), times v; all in float32 as the kernel computes it
    (HF's bfloat16 eager rounds the scores to bfloat16), cast at the end. q (B, Q, H, D) with
    k, v (B, KVH, L, D) -> (B, Q, H, D); mask (B or 1, 1, Q, L) bool, or None for bottom-right
    causal. Query rows go in blocks so the scores stay bounded."""
    B, Q, H, D = q.shape
    KVH, L = k.shape[1], k.shape[2]
    G = H // KVH
    qg = q.permute(0, 2, 1, 3).reshape(B, KVH, G, Q, D).float()  # heads grouped by KV head
    kt = k[:, :, None].transpose(-1, -2).float()  # (B, KVH, 1, D, L)
    v = v[:, :, None].float()  # (B, KVH, 1, L, D)
    out = torch.empty(B, KVH, G, Q, D, dtype=q.dtype, device=q.device)
    step = max(1, _SOFTCAP_SCORES // (B * H * L))
    for i in range(0, Q, step):
        rows = slice(i, min(Q, i + step))
        s = torch.matmul(qg[:, :, :, rows], kt) * scale  # (B, KVH, G, rows, L)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if mask is None:
            q_pos = L - Q + torch.arange(rows.start, rows.stop, device=q.device)
            allowed = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]  # (rows, L)
        else:
            allowed = mask[:, :, None, rows]  # (B or 1, 1, 1, rows, L)
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:
            sink = sinks.float().view(1, KVH, G, 1, 1).expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        out[:, :, :, rows] = torch.matmul(p, v)
    return out.reshape(B, H, Q, D).transpose(1, 2)
