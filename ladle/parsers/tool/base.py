"""The tool-call parser interface and registry: find function calls in the content part of the
output, for a whole text (`extract`) and for a stream of detokenized deltas (`feed` / `finish`).

`extract(text)` is defined as a fresh stream fed `text` in one delta, so a stream reassembled
with `merge_deltas` equals `extract` for every chunking (ids aside, which the factory makes).

Streaming shape (OpenAI's and vLLM's): a call's first piece carries its index, id and name (and
arguments ""); later pieces carry only the index and the next `arguments` fragment. A call is
announced once its text can only be a call (the name is complete and the arguments opened);
before that point a block that turns out malformed is returned as content, tags and all. If the
arguments break off after that point (bad JSON, or max_tokens), the call keeps the fragments
already sent and the rest of its text is content: a stream cannot take a piece back, and a
whole response says the same as the stream.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from ladle.parsers.types import DeltaMessage, DeltaToolCall, ExtractedMessage, merge_deltas


def random_tool_call_id() -> str:
    """OpenAI-style call id: "call_" and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Per-request parser (one per choice when n > 1): `feed` keeps state between deltas."""

    markers: ClassVar[tuple[str, ...]] = ()
    """The tags this format writes. Where the tokenizer marks them as special tokens, the server
    keeps special tokens in the text (skip_special_tokens off) so the parser still sees them."""

    num_calls: int
    """Calls announced by the stream so far (the next call's index); set by reset()."""

    def __init__(self, id_factory: Callable[[], str] | None = None,
                 tools: list[dict[str, Any]] | None = None):
        # Makes each call's id; tests inject a deterministic one.
        self.id_factory = id_factory or self.default_id
        # The request's tools (OpenAI shape): formats whose values are untyped text
        # (qwen3_coder) read the parameter types from them.
        self.tools = tools or []
        self.reset()

    @staticmethod
    def default_id() -> str:
        return random_tool_call_id()

    def reset(self) -> None:
        """Forget the stream so far (start a new one)."""
        raise NotImplementedError

    def feed(self, delta_text: str) -> DeltaMessage:
        """Take the next content delta; return the content and call pieces now certain."""
        raise NotImplementedError

    def finish(self) -> DeltaMessage:
        """End of output: release held-back text and end any call still open."""
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedMessage:
        """Parse a whole content text; does not touch this object's stream state."""
        stream = copy.copy(self)
        stream.reset()
        return merge_deltas([stream.feed(text), stream.finish()])

    # ---- helpers for subclasses ---------------------------------------------------------------
    def _announce(self, name: str) -> DeltaToolCall:
        """The first piece of the next call."""
        piece = DeltaToolCall(index=self.num_calls, id=self.id_factory(), name=name, arguments="")
        self.num_calls += 1
        return piece

    def _fragment(self, arguments: str) -> list[DeltaToolCall]:
        """The next arguments fragment of the current call (nothing for "")."""
        return [DeltaToolCall(index=self.num_calls - 1, arguments=arguments)] if arguments else []

    def _parameter_schema(self, function: str, parameter: str) -> dict:
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == function:
                props = (fn.get("parameters") or {}).get("properties") or {}
                return props.get(parameter) or {}
        return {}


class ToolParserManager:
    """Tool parsers by name (`--tool-call-parser`). Built-ins register on import; a plugin file
    (`--tool-parser-plugin FILE.py`) registers its own with the same decorator:

        @ToolParserManager.register_module("my_format")
        class MyParser(ToolParser): ...
    """

    parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def register_module(cls, name: str | list[str], force: bool = True):
        names = [name] if isinstance(name, str) else list(name)

        def register(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"tool parser {names}: must be a subclass of ToolParser")
            for n in names:
                if n in cls.parsers and not force:
                    raise KeyError(f"tool parser {n!r} is already registered")
                cls.parsers[n] = parser
            return parser

        return register

    @classmethod
    def get(cls, name: str) -> type[ToolParser]:
        try:
            return cls.parsers[name]
        except KeyError:
            available = ", ".join(sorted(cls.parsers))
            raise ValueError(f"unknown tool parser {name!r}; available: {available}") from None
