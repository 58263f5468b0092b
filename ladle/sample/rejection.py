"""Rejection sampling of draft-model tokens (speculative decoding): a draft token x drawn from
the draft's distribution q is kept with probability min(1, p(x) / q(x)), p being the target's
processed distribution at that position; on rejection the token is drawn from the residual
max(0, p - q), normalised. The kept-or-drawn token is distributed exactly as p (Leviathan et al.,
2023; Chen et al., 2023), whatever q is, as long as q is what x was drawn from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.sample.noise import ACCEPT_STREAM, RESIDUAL_STREAM
from ladle.sample.ops import race


@dataclass(slots=True)
class DraftTest:
    """The draft tokens to test at one position, for the random rows that have one."""

    rows: torch.Tensor  # (N,) int64 batch rows
    token_ids: torch.Tensor  # (N,) int64 the draft token of each row at this position
    probs: torch.Tensor  # (N, V) float32 q: the distribution each draft token was drawn from


# noise(rows, ids, stream) -> Exp(1) noise for the test rows over the token ids (N, K), or over
# the whole vocabulary for ids None: the counter-based hash of each row's seed (an unseeded row's
# drawn fresh) and output position
NoiseFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]


def accept_or_resample(probs: torch.Tensor, ids: torch.Tensor | None, test: DraftTest,
                       noise: NoiseFn) -> torch.Tensor:
    """probs: (N, K) the target's processed probabilities of the test rows, over the whole
    vocabulary (ids None) or over candidate ids (N, K) (what top-k / top-p left; every other
    token has p = 0). Returns (N,) tokens: the draft token where accepted, else a residual draw."""
    x = test.token_ids
    q = test.probs
    if ids is None:
        p_x = probs.gather(1, x[:, None])[:, 0]
        q_cand = q
    else:
        p_x = (probs * (ids == x[:, None])).sum(dim=1)
        q_cand = q.gather(1, ids)
    q_x = q.gather(1, x[:, None])[:, 0]
    n = x.shape[0]
    zeros = torch.zeros((n, 1), dtype=torch.int64, device=x.device)
    # u = exp(-E) with E ~ Exp(1) is uniform on (0, 1]; u < p/q happens with probability
    # min(1, p/q).
    u = torch.exp(-noise(test.rows, zeros, ACCEPT_STREAM)[:, 0])
    accepted = u * q_x < p_x
    residual = (probs - q_cand).clamp_min_(0.0)
    # Where p <= q everywhere (p == q up to rounding) no rejection is possible in exact
    # arithmetic; one that rounding caused draws from p itself.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    choice = race(residual, noise(test.rows, ids, RESIDUAL_STREAM))
    drawn = choice if ids is None else ids.gather(1, choice[:, None])[:, 0]
    return torch.where(accepted, x, drawn)
