"""Formats where a marker (or the very start of the output) opens a run of calls that lasts to
the end of the output (llama3_json, mistral, pythonic): text before the run is content; inside
it, the subclass reads calls one after another. Whitespace before a run that opens the output is
layout, and so is whitespace between calls. Once the run holds something that is not a call,
that text and everything after it is content."""

from __future__ import annotations

from ladle.parsers.tool.base import ToolParser
from ladle.parsers.types import DeltaMessage, DeltaToolCall, join_or_none, partial_tag_len


class CallRunParser(ToolParser):
    marker: str  # opens a run anywhere in the text
    opens_at_start: tuple[str, ...] = ()  # what also opens a run when the output starts with it

    def reset(self) -> None:
        self._phase = "start"  # start | text | run | content
        self._held = ""  # undecided text: leading whitespace, a partial marker
        self.num_calls = 0
        self.reset_run()

    # ---- what a subclass implements -------------------------------------------------------
    def reset_run(self) -> None:
        raise NotImplementedError

    def feed_run(self, text: str) -> tuple[list[DeltaToolCall], str | None]:
        """More text of the run (the first piece starts with the marker or opener): (call
        pieces, None) or, once the run turned out to hold
        something that is not a call, (pieces, the text that is content from there on)."""
        raise NotImplementedError

    def finish_run(self) -> tuple[list[DeltaToolCall], str]:
        """End of output inside the run: (last pieces, text that is content after all)."""
        raise NotImplementedError

    # ---- the stream -----------------------------------------------------------------------
    def feed(self, delta_text: str) -> DeltaMessage:
        text = self._held + delta_text
        self._held = ""
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        if self._phase == "start":
            stripped = text.lstrip()
            if not stripped:
                self._held = text
                return DeltaMessage()
            openers = (self.marker, *self.opens_at_start)
            hit = next((o for o in openers if stripped.startswith(o)), None)
            if hit is None and any(o.startswith(stripped) for o in openers):
                self._held = text
                return DeltaMessage()
            if hit is not None:  # the run gets its opening text, marker included
                self._phase = "run"
                text = stripped
            else:
                self._phase = "text"
        if self._phase == "text":
            found = text.find(self.marker)
            if found < 0:
                num_held = partial_tag_len(text, self.marker)
                self._held = text[len(text) - num_held :]
                content.append(text[: len(text) - num_held])
                text = ""
            else:
                content.append(text[:found])
                text = text[found:]
                self._phase = "run"
        if self._phase == "run" and text:
            pieces, rest = self.feed_run(text)
            calls += pieces
            if rest is not None:
                self._phase = "content"
                text = rest
            else:
                text = ""
        if self._phase == "content":
            content.append(text)
        return DeltaMessage(content=join_or_none(content), tool_calls=calls)

    def finish(self) -> DeltaMessage:
        held, self._held = self._held, ""
        if self._phase == "run":
            pieces, rest = self.feed_run(held) if held else ([], None)
            if rest is None:
                more, rest = self.finish_run()
                pieces += more
            return DeltaMessage(content=rest or None, tool_calls=pieces)
        return DeltaMessage(content=held or None)
