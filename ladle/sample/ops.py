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


# Top-p over the whole vocabulary (rows without a top-k) looks for its kept set among the
# largest TOP_P_LEVELS[0] tokens; the rows whose candidates hold less than top_p of the mass go
# to the radix-select kernel on CPU, elsewhere to TOP_P_LEVELS[1] candidates and then a sort of
# the whole row. A trained model's nucleus is rarely more than a few hundred tokens; a full sort
# of 32 x 152k rows takes ~200-300 ms on a 2-core CPU, a 256-candidate top-k ~4 ms.
TOP_P_LEVELS = (256, 2048)


def _largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if k >= x.shape[1]:
        return x.sort(dim=-1, descending=True)
    return cpu_kernels.topk(x, k)


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """logits (R, V) with -inf on the tokens that top-k then top-p remove, rows with neither
    untouched: the kept set of restrict_top_k_top_p (its reference) without sorting whole rows.

    A row with a top-k keeps its top_k largest, then top-p on their mass. A row with only top-p
    takes the largest candidates of the next level and their probabilities under the whole
    row's softmax (its logsumexp); once the candidates hold top_p of the mass, every token
    past them has at least that much mass before it, so the kept set lies among them and
    equals the full sort's. Updates logits in place and returns it."""
    R, V = logits.shape
    restricted = (top_k > 0) | (top_p < 1)
    rows = restricted.nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits
    sub = logits if rows.numel() == R else logits[rows]
    tk, tp = top_k[rows], top_p[rows]
    n = sub.shape[0]

    def rows_of(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:  # no copy for all rows
        return t if i.numel() == n else t[i]

    def keep(i: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor) -> None:
        """Rows i of sub become -inf but for their kept candidates (in place: a fresh (R, V)
        tensor page-faults its whole size on CPU)."""
        if i.numel() == n:
            sub.fill_(NEG_INF).scatter_(1, ids, vals)
        elif i.numel():
            sub.index_fill_(0, i, NEG_INF)
            sub.view(-1)[(i[:, None] * V + ids).view(-1)] = vals.reshape(-1)

    by_k = (tk > 0).nonzero().squeeze(1)
    if by_k.numel():
        vals, ids = restrict_top_k_top_p(rows_of(sub, by_k), tk[by_k], tp[by_k],
                                         int(tk[by_k].max()), bool((tp[by_k] < 1).any()))
        keep(by_k, vals, ids)
    rest = (tk <= 0).nonzero().squeeze(1)  # top-p only (top_p < 1)
    lse = cpu_kernels.logsumexp(rows_of(sub, rest)) if rest.numel() else None
    for level in (*TOP_P_LEVELS, V):
        if rest.numel() == 0:
            break
        if level > TOP_P_LEVELS[0]:  # past the cheap candidates: the radix-select kernel
            x = rows_of(sub, rest)
            if cpu_kernels.top_p_mask(x, lse, tp[rest]):
                if x is not sub:
                    sub[rest] = x
                break
        vals, ids = _largest(rows_of(sub, rest), min(level, V))
        probs = torch.exp(vals - lse[:, None])
        mass = torch.cumsum(probs, dim=-1)
        p = tp[rest][:, None]
        vals = vals.masked_fill(mass - probs >= p, NEG_INF)
        done = (mass[:, -1:] >= p)[:, 0] if level < V else torch.ones_like(rest, dtype=torch.bool)
        keep(rest[done], vals[done], ids[done])
        rest, lse = rest[~done], lse[~done]
    if rows.numel() < R:
        logits[rows] = sub
    return logits


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.
    E is kept away from 0 so a removed token (p = 0) can never score 0 / 0 = NaN."""
    return (probs / noise.clamp_min_(1e-30)).argmax(dim=-1)
