"""The structured-output backend interface.

A backend is engine-wide: it knows the tokenizer and compiles a constraint into a grammar. A
grammar is per request: it follows the tokens the request produces and says which tokens may
come next. The per-request calls (accept, validate without advancing, rollback) are the ones
speculative decoding needs, so it can be added without changing this interface."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ladle.sampling_params import StructuredOutputsParams

# JSON may put whitespace between tokens, but at most this many characters in one place: enough
# for pretty-printed output, and a model that prefers whitespace (small or untrained ones do)
# cannot fill its whole budget with it. disable_any_whitespace allows none.
MAX_JSON_WHITESPACE = 16


@dataclass(frozen=True, slots=True)
class ConstraintKey:
    """What a compiled grammar is cached under: (kind, spec) plus the options that change it."""

    kind: str  # json | json_object | regex | choice | grammar | structural_tag
    spec: str  # canonical text of the constraint
    any_whitespace: bool = True

    @classmethod
    def from_params(cls, p: StructuredOutputsParams) -> ConstraintKey:
        kind = p.kind
        value = getattr(p, kind)
        # Key order is kept: a schema's property order is the order the output follows.
        if kind == "json":
            spec = value if isinstance(value, str) else json.dumps(value)
        elif kind == "json_object":
            spec = ""
        elif kind == "choice":
            spec = json.dumps(value)
        elif kind == "structural_tag":
            spec = value if isinstance(value, str) else json.dumps(value)
        else:
            spec = value
        return cls(kind, spec, not p.disable_any_whitespace)


class StructuredOutputGrammar(ABC):
    """One request's matcher."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over the tokens; False if one is not allowed (the state is then undefined)."""

    @abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest allowed prefix of token_ids, without advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token mask into bitmask[row] (int32 words, bit set = allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The constraint is complete and nothing more may follow."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state."""


class StructuredOutputBackend(ABC):
    name: str

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 cache_bytes: int = 0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_bytes = cache_bytes  # the bound for a cache of the backend's own, if any

    @staticmethod
    @abstractmethod
    def check(key: ConstraintKey) -> str | None:
        """Cheap check that needs no tokenizer: None if this backend can express the
        constraint, else the reason (an invalid schema, regex or grammar, or an unsupported
        feature)."""

    @abstractmethod
    def compile(self, key: ConstraintKey):
        """Compile (slow, runs in a worker thread); raises ValueError on a bad constraint."""

    @abstractmethod
    def new_grammar(self, compiled) -> StructuredOutputGrammar:
        """A fresh matcher for one request over a compiled constraint (fast)."""

    @abstractmethod
    def compiled_size(self, compiled) -> int:
        """Bytes a compiled constraint holds in memory (what the compile cache counts)."""

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """(rows, ceil(V / 32)) int32, all tokens allowed."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


def choice_to_regex(choices: list[str]) -> str:
    """A regex matching exactly one of the strings."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"
