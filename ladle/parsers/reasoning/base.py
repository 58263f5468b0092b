"""Splitting model output into reasoning and answer by <think>...</think> tags, both for a whole
text (`extract`) and for a stream of detokenized deltas (`feed` / `finish`).

Conventions (shared by every tag-based parser):
- Exactly the tags are removed; whitespace around them is kept, as vLLM's parsers do:
  "<think>\\nplan\\n</think>\\n\\nanswer" gives reasoning "\\nplan\\n" and content "\\n\\nanswer".
  The one exception: whitespace *before* a start tag at the very start of the output is dropped
  (vLLM's non-stream parsers drop everything before <think>).
- The start tag is recognised only at the start of the output (after optional whitespace); later
  it is ordinary text. The first end tag closes reasoning; anything after it is content, verbatim.
- An empty part is None, never "" ("<think></think>hi" gives reasoning None, content "hi").
- `extract(text)` is the stream fed `text` in one delta, so streaming and non-stream agree for
  every chunking (qwen3 has one documented exception, see qwen3.py).
"""

import copy
import enum
from typing import ClassVar

from ladle.parsers.types import DeltaMessage, join_or_none, partial_tag_len


class _Phase(enum.Enum):
    START = enum.auto()  # nothing decided yet: the output may still open with a start tag
    REASONING = enum.auto()  # inside <think>, waiting for </think>
    IMPLICIT_CONTENT = enum.auto()  # content, but a bare </think> would still be removed (qwen3)
    CONTENT = enum.auto()  # reasoning is over; everything is content, verbatim


class ReasoningParser:
    """Per-request parser. Subclasses set the tags and what output without a start tag means.

    Make one object per request (or per choice when n > 1): `feed` keeps state between deltas.
    `extract` does not touch that state, so one object can do both.
    """

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, prompt_ends_in_think: bool = False):
        # True when the output starts inside the think block (the prompt opened it, or Qwen3's
        # hybrid template left it to the model): parsers/choice.py's
        # output_starts_in_reasoning decides it, once per request.
        self.prompt_ends_in_think = prompt_ends_in_think
        self.reset()

    def _phase_without_start_tag(self) -> _Phase:
        """Where output that does not open with the start tag goes."""
        return _Phase.REASONING

    def reset(self) -> None:
        """Forget the stream so far (start a new one)."""
        self._phase = _Phase.START
        self._held = ""  # text held back: a start tag or end tag may still be completed

    @property
    def is_reasoning_end(self) -> bool:
        """True once the stream is past the reasoning: later text is content.

        Structured outputs (and tool parsing) apply only from that point on.
        """
        return self._phase in (_Phase.IMPLICIT_CONTENT, _Phase.CONTENT)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Split a whole output into (reasoning, content)."""
        stream = copy.copy(self)
        stream.reset()
        first, last = stream.feed(text), stream.finish()
        return (
            join_or_none(filter(None, [first.reasoning, last.reasoning])),
            join_or_none(filter(None, [first.content, last.content])),
        )

    def feed(self, delta_text: str) -> DeltaMessage:
        """Take the next detokenized delta; return the reasoning/content that is now certain."""
        text = self._held + delta_text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._phase is _Phase.START:
                stripped = text.lstrip()
                if stripped.startswith(self.start_tag):
                    text = stripped[len(self.start_tag) :]
                    self._phase = _Phase.REASONING
                elif self.start_tag.startswith(stripped):  # whitespace and maybe part of the tag
                    self._held = text
                    text = ""
                else:
                    self._phase = self._phase_without_start_tag()
            elif self._phase is _Phase.CONTENT:
                content.append(text)
                text = ""
            else:  # REASONING or IMPLICIT_CONTENT: look for the end tag
                out = reasoning if self._phase is _Phase.REASONING else content
                end = text.find(self.end_tag)
                if end >= 0:
                    out.append(text[:end])
                    text = text[end + len(self.end_tag) :]
                    self._phase = _Phase.CONTENT
                else:
                    num_held = partial_tag_len(text, self.end_tag)
                    out.append(text[: len(text) - num_held])
                    self._held = text[len(text) - num_held :]
                    text = ""
        return DeltaMessage(reasoning=join_or_none(reasoning), content=join_or_none(content))

    def finish(self) -> DeltaMessage:
        """End of output: release held-back text (an incomplete tag is ordinary text)."""
        held, self._held = self._held, ""
        if not held:
            return DeltaMessage()
        phase = self._phase
        if phase is _Phase.START:
            phase = self._phase_without_start_tag()
        if phase is _Phase.REASONING:
            return DeltaMessage(reasoning=held)
        return DeltaMessage(content=held)


class ReasoningParserManager:
    """Reasoning parsers by name (`--reasoning-parser`). Built-ins register on import; a plugin
    file (`--reasoning-parser-plugin FILE.py`) registers its own with the same decorator:

        @ReasoningParserManager.register_module("my_model")
        class MyParser(ReasoningParser):
            start_tag, end_tag = "<reason>", "</reason>"
    """

    parsers: ClassVar[dict[str, type[ReasoningParser]]] = {}

    @classmethod
    def register_module(cls, name: str | list[str], force: bool = True):
        names = [name] if isinstance(name, str) else list(name)

        def register(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            if not (isinstance(parser, type) and issubclass(parser, ReasoningParser)):
                raise TypeError(f"reasoning parser {names}: must be a subclass of "
                                "ReasoningParser")
            for n in names:
                if n in cls.parsers and not force:
                    raise KeyError(f"reasoning parser {n!r} is already registered")
                cls.parsers[n] = parser
            return parser

        return register

    @classmethod
    def get(cls, name: str) -> type[ReasoningParser]:
        try:
            return cls.parsers[name]
        except KeyError:
            available = ", ".join(sorted(cls.parsers))
            raise ValueError(f"unknown reasoning parser {name!r}; available: {available}") \
                from None
