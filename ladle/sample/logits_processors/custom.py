"""Custom processors: loading them (flag or entry point) and the adapter for old-style
per-request callables.

A custom processor is a LogitsProcessor subclass, instantiated once per engine. It decides per
request, from SamplingParams.extra_args, whether a row is active; rows that did not ask for it
must come out unchanged."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

import torch

from ladle.sample.logits_processors.interface import (
    AddedRow,
    LogitsProcessor,
    ProcessorConfig,
    RowStateProcessor,
)

ENTRY_POINT_GROUP = "ladle.logits_processors"

RequestLogitsFn = Callable[[list[int], torch.Tensor], torch.Tensor]


class AdapterLogitsProcessor(RowStateProcessor):
    """Wraps per-request callables f(output_ids, logits_row) -> logits_row.

    Subclass it and implement new_req_logits_processor(params), returning the callable for a
    request or None. This is the slow path: the callables run one row at a time in Python. Write
    a vectorised LogitsProcessor when speed matters."""

    def new_req_logits_processor(self, params) -> RequestLogitsFn | None:
        raise NotImplementedError

    def is_argmax_invariant(self) -> bool:
        return False  # an arbitrary function may change anything

    def applies_to(self, params) -> bool:
        return self.new_req_logits_processor(params) is not None

    def new_state(self, a: AddedRow):
        fn = self.new_req_logits_processor(a.params)
        return None if fn is None else (fn, a.output_token_ids)

    def apply(self, logits):
        for row, (fn, out) in self.states.items():
            logits[row] = fn(out, logits[row])
        return logits


def _load_class(spec: str) -> type[LogitsProcessor]:
    module, sep, name = spec.partition(":")
    if not sep:
        module, _, name = spec.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"logits_processors: cannot load {spec!r} ({e}); use module:Class") from e
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(f"logits_processors: {spec!r} is not a ladle LogitsProcessor subclass")
    return cls


def load_custom_processors(specs: list[str], config: ProcessorConfig) -> list[LogitsProcessor]:
    """Instances of the classes named by `specs` (module:Class) and by the installed packages'
    `ladle.logits_processors` entry points, each once."""
    classes: list[type[LogitsProcessor]] = [_load_class(s) for s in specs]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if cls not in classes:
            classes.append(cls)
    return [cls(config) for cls in classes]
