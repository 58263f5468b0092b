"""Counter-based exponential noise for sampling (seeded rows; unseeded rows hash a fresh random
seed each step).

The noise for token j of a request's k-th output token is a hash of (seed, k, j), computed for all
rows at once with integer tensor ops. A seeded request therefore draws the same sample alone, in
any batch, after preemption and across restarts, with no per-request generator and no Python loop.

Hash: murmur3's 32-bit finaliser on int32 tensors (multiplication wraps, logical shifts are
arithmetic shifts masked). The per-step (rows, vocab) work runs in place in reused buffers: at
full vocabulary every fresh allocation would cost a page-faulting pass of its own.

Streams: speculative decoding with a draft model needs draws that are independent of the token
draw at the same (seed, position): the draft's own sample, the accept test and the residual
draw. Each gets its own stream, a salt mixed into the row key; stream 0 is the token draw and is
keyed exactly as without streams."""

from __future__ import annotations

import torch

from ladle.runner import cpu_kernels
from ladle.sample.ops import race

_M32 = 0xFFFFFFFF


def _signed(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


_C1, _C2 = _signed(0x85EBCA6B), _signed(0xC2B2AE35)

# Noise streams (see the module docstring); the value is the salt of the row key.
TOKEN_STREAM = 0
DRAFT_STREAM = 0x3C6EF372  # the draft model's sample of a draft token
ACCEPT_STREAM = 0xA54FF53A  # the uniform of a draft token's accept test
RESIDUAL_STREAM = 0x510E527F  # the draw from the residual after a rejection


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """Out-of-place, on small int64 tensors holding 32-bit values (the per-row keys)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _fmix32_(h: torch.Tensor, tmp: torch.Tensor) -> None:
    """In place on int32; tmp is scratch of the same shape."""
    for shift, mult in ((16, _C1), (13, _C2), (16, None)):
        torch.bitwise_right_shift(h, shift, out=tmp)
        tmp.bitwise_and_((1 << (32 - shift)) - 1)
        h.bitwise_xor_(tmp)
        if mult is not None:
            h.mul_(mult)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit values -> the same bits as int32."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


class SeededNoise:
    """Holds the per-vocabulary half of the hash so each step hashes only once per element."""

    def __init__(self, vocab_size: int, device: torch.device):
        j = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self.token_key = _to_int32(_fmix32((j * 0x9E3779B1) & _M32))  # (V,) int32
        self._bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def row_keys(self, seeds: torch.Tensor, positions: torch.Tensor, stream: int = TOKEN_STREAM):
        """Two 32-bit keys per row (int32) from the 64-bit seed, the output position and the
        stream."""
        lo, hi = seeds & _M32, (seeds >> 32) & _M32
        k1 = _fmix32(lo ^ _fmix32(hi ^ 0x5BD1E995))
        if stream != TOKEN_STREAM:
            k1 = _fmix32(k1 ^ stream)
        k2 = _fmix32(k1 ^ ((positions * 0x27D4EB2F + 0x165667B1) & _M32))
        return _to_int32(k1), _to_int32(k2)

    def _buffers(self, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = shape[0] * shape[1]
        if self._bufs is None or self._bufs[0].numel() < n:
            dev = self.token_key.device
            self._bufs = (torch.empty(n, dtype=torch.int32, device=dev),
                          torch.empty(n, dtype=torch.int32, device=dev),
                          torch.empty(n, dtype=torch.float32, device=dev))
        return tuple(b[:n].view(shape) for b in self._bufs)

    def exponential(self, seeds: torch.Tensor, positions: torch.Tensor,
                    token_ids: torch.Tensor | None = None,
                    stream: int = TOKEN_STREAM) -> torch.Tensor:
        """(R,) seeds and output positions -> (R, V) float32 Exp(1) noise, or (R, K) for the
        token ids (R, K) given. A token's noise depends only on (seed, position, token id), so
        drawing over a candidate subset gives the same values as over the whole vocabulary.
        The result lives in a reused buffer: valid until the next call."""
        k1, k2 = self.row_keys(seeds, positions, stream)
        tk = self.token_key[None, :] if token_ids is None else self.token_key[token_ids]
        shape = (seeds.shape[0], tk.shape[1])
        h, tmp, out = self._buffers(shape)
        kern = cpu_kernels.kernels_for(out)
        if kern is not None:  # the same uniforms, bit for bit, in one pass
            kern.noise_uniform(tk.expand(shape), k1.contiguous(), k2.contiguous(), out)
        else:
            self._uniform_torch(tk, k1, k2, h, tmp, out)
        return out.log_().neg_()

    def race(self, logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
             stream: int = TOKEN_STREAM) -> torch.Tensor:
        """The sampled token of each row of (R, V) logits: the exponential race of
        softmax(logits) against this noise. On CPU one fused kernel pass, which hashes only the
        tokens that are not -inf (a grammar mask removes most); race_torch is its twin."""
        kern = cpu_kernels.kernels_for(logits)
        if kern is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            k1, k2 = self.row_keys(seeds, positions, stream)
            return kern.seeded_race(logits, self.token_key, k1.contiguous(), k2.contiguous())
        return self.race_torch(logits, seeds, positions, stream)

    def race_torch(self, logits, seeds, positions, stream: int = TOKEN_STREAM) -> torch.Tensor:
        return race(torch.softmax(logits, dim=-1), self.exponential(seeds, positions, None, stream))

    @staticmethod
    def _uniform_torch(tk, k1, k2, h, tmp, out) -> None:
        """The kernel's twin: out = uniforms in (0, 1) from the hash of (token key, row keys)."""
        torch.bitwise_xor(tk, k1[:, None], out=h)
        h.add_(k2[:, None])
        _fmix32_(h, tmp)
        # 23 bits keep u <= 1 - 2**-24, which float32 represents, so E is never 0 (at 24 bits
        # the top value rounds to 1.0 and a masked token's 0 / 0 would win the race).
        h.bitwise_right_shift_(9).bitwise_and_(0x7FFFFF)
        torch.add(h, 0.5, out=out)
        out.mul_(1.0 / (1 << 23))
