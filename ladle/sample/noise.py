"""Counter-based exponential noise for seeded sampling.

The noise for token j of a request's k-th output token is a hash of (seed, k, j), computed for all
rows at once with integer tensor ops. A seeded request therefore draws the same sample alone, in
any batch, after preemption and across restarts, with no per-request generator and no Python loop.
Hash: murmur3's 32-bit finaliser applied twice, on 32-bit values held in int64 (the products
overflow int64 but only their low 32 bits are kept, which wrapping preserves)."""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


class SeededNoise:
    """Holds the per-vocabulary half of the hash so each step hashes only once per element."""

    def __init__(self, vocab_size: int, device: torch.device):
        j = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self.token_key = _fmix32((j * 0x9E3779B1) & _M32)  # (V,)

    def row_keys(self, seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two 32-bit keys per row from the 64-bit seed and the output position."""
        lo, hi = seeds & _M32, (seeds >> 32) & _M32
        k1 = _fmix32(lo ^ _fmix32(hi ^ 0x5BD1E995))
        k2 = _fmix32(k1 ^ ((positions * 0x27D4EB2F + 0x165667B1) & _M32))
        return k1, k2

    def exponential(self, seeds: torch.Tensor, positions: torch.Tensor,
                    token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(R,) seeds and output positions -> (R, V) float32 Exp(1) noise, or (R, K) for the
        token ids (R, K) given. A token's noise depends only on (seed, position, token id), so
        drawing over a candidate subset gives the same values as over the whole vocabulary."""
        k1, k2 = self.row_keys(seeds, positions)
        tk = self.token_key[None, :] if token_ids is None else self.token_key[token_ids]
        h = _fmix32(((tk ^ k1[:, None]) + k2[:, None]) & _M32)
        # 23 bits keep u <= 1 - 2**-24, which float32 represents, so E is never 0 (at 24 bits
        # the top value rounds to 1.0 and a masked token's 0 / 0 would win the race).
        u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # uniform in (0, 1)
        return -torch.log(u)
