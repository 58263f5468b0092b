"""Presence, frequency and repetition penalties with incrementally kept state.

Per row: counts of every output token so far (updated with the tokens accepted each step; a
token is present in the output when its count is positive) and a seen mask (prompt tokens,
written once when the row is added, plus output tokens). A step's cost is a few passes over
(rows, vocab), independent of how many tokens the rows have produced. The state is allocated
only once a penalized request arrives, and batches without one skip this module entirely.

Semantics (vLLM): repetition_penalty divides positive and multiplies negative logits of tokens
seen in the prompt or the output; frequency_penalty subtracts penalty * count; presence_penalty
subtracts penalty once for every token present in the output."""

from __future__ import annotations

import torch

from ladle.runner import cpu_kernels
from ladle.sample.logits_processors.interface import BatchUpdate


def is_penalized(params) -> bool:
    return (params.presence_penalty != 0 or params.frequency_penalty != 0
            or params.repetition_penalty != 1)


class PenaltyState:
    """Row-indexed state on the device, all (max rows, V):
    counts (float32, output-token counts: frequency, and presence where positive) and seen
    (bool, prompt or output: repetition). accept() updates both with the step's tokens."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.max_num_reqs, self.vocab_size, self.device = max_num_reqs, vocab_size, device
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.active = torch.zeros(max_num_reqs, dtype=torch.bool)  # CPU: row is penalized

    def _allocate(self) -> None:
        shape = (self.max_num_reqs, self.vocab_size)
        self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        # Scratch for the repetition factors: a fresh (rows, V) float tensor each step would
        # page-fault its whole size on CPU.
        self.factor = torch.empty(shape, dtype=torch.float32, device=self.device)

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
            self.counts[a.row] = torch.bincount(out, minlength=self.vocab_size).float()
            self.seen[a.row] = self.counts[a.row] > 0
            self.seen[a.row, torch.tensor(a.prompt_token_ids, dtype=torch.long, device=dev)] = True
        for src, dst in update.moved:
            self.active[dst] = self.active[src]
            self.active[src] = False
            if self.counts is not None and self.active[dst]:
                for t in (self.counts, self.seen):
                    t[dst] = t[src]

    def accept(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the tokens just accepted (one per listed row)."""
        if self.counts is not None:
            self.counts.index_put_((rows, token_ids), torch.ones_like(rows, dtype=torch.float32),
                                   accumulate=True)
            self.seen[rows, token_ids] = True

    def apply(self, logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
              repetition: torch.Tensor, use: tuple[bool, bool, bool]) -> torch.Tensor:
        """In place on logits (R, V); per-row penalties (R,) with neutral values on
        unpenalized rows; `use` says which of (repetition, frequency, presence) any row has."""
        use_rep, use_freq, use_pres = use
        kernels = cpu_kernels.kernels_for(logits, presence, frequency, repetition)
        if kernels is not None and logits.is_contiguous():
            # One pass per row instead of five over (rows, V); the torch ops below are its twin.
            kernels.apply_penalties(logits, self.counts, self.seen, repetition, frequency,
                                    presence, use_rep, use_freq, use_pres)
            return logits
        return self.apply_torch(logits, presence, frequency, repetition, use)

    def apply_torch(self, logits, presence, frequency, repetition, use) -> torch.Tensor:
        R = logits.shape[0]
        use_rep, use_freq, use_pres = use
        if use_rep:
            rep = repetition[:, None]
            factor = self.factor[:R]
            torch.where(logits > 0, 1.0 / rep, rep, out=factor)
            factor.masked_fill_(~self.seen[:R], 1.0)
            logits.mul_(factor)
        if use_freq:
            logits.addcmul_(self.counts[:R], frequency[:, None], value=-1.0)
        if use_pres:
            logits.sub_((self.counts[:R] > 0) * presence[:, None])
        return logits
