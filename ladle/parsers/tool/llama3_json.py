"""Llama 3.1 / 3.2 JSON tool calls: `{"name": "f", "parameters": {...}}`, several separated by
";", opening the output or following `<|python_tag|>`. "arguments" is read like "parameters".
A call is announced when its name is complete; its arguments stream as canonical JSON fragments
(json_stream.py). Text before `<|python_tag|>` is content; an object that is not a call, and
everything after it, is content (tag included)."""

from __future__ import annotations

from ladle.parsers.tool.base import ToolParserManager
from ladle.parsers.tool.json_stream import JsonCallStream
from ladle.parsers.tool.region import CallRunParser
from ladle.parsers.types import DeltaToolCall

_KEYS = ("parameters", "arguments")


class JsonObjectRun(CallRunParser):
    """A run of call objects with separators in between (llama3_json; mistral's array)."""

    separators = " \t\r\n;"

    def reset_run(self) -> None:
        self._call: JsonCallStream | None = None
        self._obj = ""  # the current object's text (content if it is not a call)
        self._prefix = ""  # the marker, while no call has been read (content too if none is)
        self._is_started = False

    def read_objects(self, text: str, i: int) -> tuple[list[DeltaToolCall], str | None, int]:
        """Read objects from text[i:]: (pieces, content from a non-call on, index where a
        character that is neither a separator nor an object stopped the reading)."""
        pieces: list[DeltaToolCall] = []
        while i < len(text):
            if self._call is None:
                ch = text[i]
                if ch in self.separators:
                    i += 1
                    continue
                if ch != "{":
                    return pieces, None, i
                self._call, self._obj = JsonCallStream(_KEYS), ""
            piece = self._call.feed(text[i:])
            consumed = len(text) - i if piece.end is None else piece.end
            self._obj += text[i : i + consumed]
            i += consumed
            if piece.name is not None:
                pieces.append(self._announce(piece.name))
            pieces += self._fragment(piece.arguments)
            state = self._call.state
            if state == "call":
                self._call, self._prefix = None, ""
            elif state == "not_call":
                return pieces, self._prefix + self._obj + text[i:], len(text)
            elif state == "broken":
                return pieces, text[i:], len(text)
        return pieces, None, i

    def finish_run(self) -> tuple[list[DeltaToolCall], str]:
        if self._call is None:
            return [], ""
        self._call.finish()
        return [], (self._prefix + self._obj) if self._call.state == "not_call" else ""


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(JsonObjectRun):
    marker = "<|python_tag|>"
    opens_at_start = ("{",)
    markers = (marker,)

    def feed_run(self, text: str) -> tuple[list[DeltaToolCall], str | None]:
        i = 0
        if not self._is_started:
            self._is_started = True
            if text.startswith(self.marker):
                self._prefix, i = self.marker, len(self.marker)
        pieces, rest, stop = self.read_objects(text, i)
        if rest is None and stop < len(text):  # other text after the calls
            rest = (self._prefix if self.num_calls == 0 else "") + text[stop:]
        return pieces, rest
