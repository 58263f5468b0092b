"""The logits-processor plug-in interface and the BatchUpdate that keeps processors' row-indexed
state in step with the persistent batch.

A processor is instantiated once per engine. Each time the batch changes it receives a
BatchUpdate (removed, added, moved rows, applied in that order) and keeps whatever per-row state
it needs; each step, apply() transforms the whole (rows, vocab) logits tensor at once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ladle.sampling_params import SamplingParams


@dataclass(slots=True)
class AddedRow:
    row: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a live reference: it grows as the request generates
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class BatchUpdate:
    """Applied in this order: removed, added, moved. After it, rows [0, batch_size) are full."""

    batch_size: int
    removed: list[int] = field(default_factory=list)
    added: list[AddedRow] = field(default_factory=list)
    moved: list[tuple[int, int]] = field(default_factory=list)  # (from_row, to_row), one-way


@dataclass(slots=True)
class ProcessorConfig:
    """What a processor may need to know about the engine."""

    vocab_size: int
    device: torch.device
    max_num_reqs: int
    tokenizer: object | None = None  # for processors that work with text (optional)


class LogitsProcessor(ABC):
    def __init__(self, config: ProcessorConfig):
        self.config = config

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError (naming the field) for a request this processor cannot serve."""
        return None

    def supports_positions(self) -> bool:
        """True if apply() may run several times in one step, once per verified draft position
        of speculative decoding, reading per-row state that already includes the tokens
        accepted before that position (the live output_token_ids lists do). False (the
        default): the requests this processor applies to are never drafted."""
        return False

    def applies_to(self, params: SamplingParams) -> bool:
        """Whether this processor acts on a request with these params (rows it does not apply
        to must come out of apply() unchanged). Used to keep only those requests undrafted
        when the processor does not support positions; the default assumes every request."""
        return True

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if apply() never changes which token has the highest logit; such processors
        run after the greedy argmax and do not affect greedy rows."""

    @abstractmethod
    def update_state(self, update: BatchUpdate | None) -> None:
        """Called before every step; None means the batch did not change."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) float32 logits in batch-row order; may modify in place."""


class RowStateProcessor(LogitsProcessor):
    """Helper base: keeps a dict row -> state for the rows whose params activate it.
    Subclasses implement new_state(added) returning the state or None (inactive)."""

    def __init__(self, config: ProcessorConfig):
        super().__init__(config)
        self.states: dict[int, object] = {}

    def new_state(self, added: AddedRow):
        raise NotImplementedError

    def update_state(self, update: BatchUpdate | None) -> bool:
        """Returns True when the set of active rows changed (so tensors must be rebuilt)."""
        if update is None:
            return False
        changed = False
        for row in update.removed:
            changed |= self.states.pop(row, None) is not None
        for a in update.added:
            # A row is reused for a new request: drop whatever the old one had.
            changed |= self.states.pop(a.row, None) is not None
            state = self.new_state(a)
            if state is not None:
                self.states[a.row] = state
                changed = True
        for src, dst in update.moved:
            state = self.states.pop(src, None)
            changed |= self.states.pop(dst, None) is not None
            if state is not None:
                self.states[dst] = state
                changed = True
        return changed
