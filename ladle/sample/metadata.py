"""SamplingMetadata: the device tensors the sampler reads, rebuilt only when the batch changes,
plus short-circuit flags so a step skips every stage no row needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    temperature: torch.Tensor  # (R,) float32; 1.0 on greedy rows so division is harmless
    is_greedy: torch.Tensor  # (R,) bool
    all_greedy: bool
    all_random: bool
    has_seed: torch.Tensor  # (R,) bool
    any_seeded: bool
    all_seeded: bool
    seeds: torch.Tensor  # (R,) int64

    @classmethod
    def from_columns(cls, cols: dict[str, np.ndarray], n: int, device) -> SamplingMetadata:
        def t(name):
            return torch.from_numpy(cols[name][:n].copy()).to(device)

        is_greedy = cols["is_greedy"][:n]
        temperature = np.where(is_greedy, 1.0, cols["temperature"][:n]).astype(np.float32)
        has_seed = cols["has_seed"][:n] & ~is_greedy
        return cls(
            num_rows=n,
            temperature=torch.from_numpy(temperature).to(device),
            is_greedy=t("is_greedy"),
            all_greedy=bool(is_greedy.all()),
            all_random=not bool(is_greedy.any()),
            has_seed=torch.from_numpy(has_seed).to(device),
            any_seeded=bool(has_seed.any()),
            all_seeded=bool(has_seed.all()),
            seeds=t("seed"),
        )
