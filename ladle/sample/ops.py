"""Tensor operations of the sampler: top-k / top-p restriction and the exponential race."""

from __future__ import annotations

import torch

from ladle.runner import cpu_kernels

NEG_INF = float("-inf")
# When every random row has top_k at most this, the race runs on the top-k candidates only
# (torch.topk) instead of sorting the whole vocabulary.
TOPK_CANDIDATE_LIMIT = 4096


def top_p_sorted(vals: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vals: (R, K) logits sorted descending (-inf where already removed). Keeps the smallest
    prefix whose probability mass reaches top_p; the first token always stays. Rows with
    top_p >= 1 are unchanged."""
    probs = torch.softmax(vals, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly better tokens
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    return vals.masked_fill(drop, NEG_INF)


def restrict_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         k: int | None, need_top_p: bool):
    """Candidates after top-k then top-p (on the mass that top-k left).

    k: number of candidates to keep per row (the largest top_k), or None for all (a full sort).
    top_k: (R,) with 0 meaning off. Returns (vals, ids), both (R, K), vals sorted descending
    with -inf on dropped candidates."""
    if k is None:
        vals, ids = logits.sort(dim=-1, descending=True)
    else:
        vals, ids = cpu_kernels.topk(logits, k)
    K = vals.shape[1]
    limit = torch.where(top_k > 0, top_k, K)
    vals = vals.masked_fill(torch.arange(K, device=vals.device)[None, :] >= limit[:, None], NEG_INF)
    if need_top_p:
        vals = top_p_sorted(vals, top_p)
    return vals, ids


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.
    E is kept away from 0 so a removed token (p = 0) can never score 0 / 0 = NaN."""
    return (probs / noise.clamp_min_(1e-30)).argmax(dim=-1)
