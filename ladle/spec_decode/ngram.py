"""The n-gram (prompt lookup) proposer: drafts the tokens that followed the latest earlier
occurrence of the sequence's own suffix, searched over prompt + output so far."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, k: int):
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens; [] when no suffix of length min_n..max_n
        occurred before. The longest matching suffix wins, then its latest occurrence that has k
        tokens after it."""
        k = min(self.k, max_drafts)
        n_tok = len(tokens)
        if k <= 0 or n_tok <= self.min_n:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = arr[n_tok - n:]
            # Windows that start before the suffix itself: arr[i : i + n] for i < n_tok - n.
            windows = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if len(hits):
                # The latest occurrence with k tokens after it, else the one with the most.
                full = hits[hits + n + k <= n_tok]
                start = int(full[-1] if len(full) else hits[0]) + n
                return arr[start : start + k].tolist()
        return []
