"""Presence, frequency and repetition penalties with incrementally kept state.

Per row: counts of every output token so far (updated with the tokens accepted each step) and a
prompt-presence mask (written once, when the row is added). A step's cost is a few passes over
(rows, vocab), independent of how many tokens the rows have produced. The state is allocated
only once a penalized request arrives, and batches without one skip this module entirely.

Semantics (vLLM): repetition_penalty divides positive and multiplies negative logits of tokens
seen in the prompt or the output; frequency_penalty subtracts penalty * count; presence_penalty
subtracts penalty once for every token present in the output."""

from __future__ import annotations

import torch

from ladle.sample.logits_processors.interface import BatchUpdate


def is_penalized(params) -> bool:
    return (params.presence_penalty != 0 or params.frequency_penalty != 0
            or params.repetition_penalty != 1)


class PenaltyState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.max_num_reqs, self.vocab_size, self.device = max_num_reqs, vocab_size, device
        self.counts: torch.Tensor | None = None  # (max rows, V) int32 output-token counts
        self.prompt_mask: torch.Tensor | None = None  # (max rows, V) bool
        self.active = torch.zeros(max_num_reqs, dtype=torch.bool)  # CPU: row is penalized

    def _allocate(self) -> None:
        shape = (self.max_num_reqs, self.vocab_size)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def update_state(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        for row in update.removed:
            self.active[row] = False
        for a in update.added:
            self.active[a.row] = is_penalized(a.params)
            if not self.active[a.row]:
                continue
            if self.counts is None:
                self._allocate()
            dev = self.device
            # A re-added (preempted or unscheduled) request rebuilds its counts once here.
            out = torch.tensor(a.output_token_ids, dtype=torch.long, device=dev)
            self.counts[a.row] = torch.bincount(out, minlength=self.vocab_size).to(torch.int32)
            self.prompt_mask[a.row] = False
            self.prompt_mask[a.row, torch.tensor(a.prompt_token_ids, dtype=torch.long,
                                                 device=dev)] = True
        for src, dst in update.moved:
            self.active[dst] = self.active[src]
            self.active[src] = False
            if self.counts is not None and self.active[dst]:
                self.counts[dst] = self.counts[src]
                self.prompt_mask[dst] = self.prompt_mask[src]

    def accept(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the tokens just accepted (one per listed row)."""
        if self.counts is not None:
            self.counts.index_put_((rows, token_ids), torch.ones_like(rows, dtype=torch.int32),
                                   accumulate=True)

    def apply(self, logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
              repetition: torch.Tensor) -> torch.Tensor:
        """logits (R, V); per-row penalties (R,) with neutral values on unpenalized rows."""
        R = logits.shape[0]
        counts = self.counts[:R]
        seen_out = counts > 0
        rep = repetition[:, None]
        seen = seen_out | self.prompt_mask[:R]
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
        logits -= frequency[:, None] * counts
        logits -= presence[:, None] * seen_out
        return logits
