"""The sampler: one vectorised pass over the (rows, vocab) logits of a step.

Steps, in order (each skipped when no row needs it):
  1. float32
  2. greedy argmax for greedy rows
  3. temperature
  4. sampling by exponential race: argmax(p / E), E ~ Exp(1); seeded rows draw E from a
     counter-based hash of (seed, output position), others from the engine's generator
  5. per-row choice between the greedy and the random token
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.sample.metadata import SamplingMetadata
from ladle.sample.noise import SeededNoise


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # (R,) int64


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, generator: torch.Generator | None = None):
        self.noise = SeededNoise(vocab_size, device)
        self.generator = generator

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, output_positions: torch.Tensor
    ) -> SamplerOutput:
        """logits: (R, V); output_positions: (R,) index of the token being sampled within each
        request's output (the counter of the seeded noise)."""
        logits = logits.float()
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return SamplerOutput(greedy)
        probs = torch.softmax(logits / meta.temperature[:, None], dim=-1)
        sampled = self._race(probs, meta, output_positions)
        if greedy is not None:
            sampled = torch.where(meta.is_greedy, greedy, sampled)
        return SamplerOutput(sampled)

    def _race(self, probs, meta: SamplingMetadata, output_positions) -> torch.Tensor:
        if meta.all_seeded:
            noise = self.noise.exponential(meta.seeds, output_positions)
        else:
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            if meta.any_seeded:
                rows = meta.has_seed.nonzero().squeeze(1)
                noise[rows] = self.noise.exponential(meta.seeds[rows], output_positions[rows])
        return (probs / noise).argmax(dim=-1)
