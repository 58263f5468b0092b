"""Mistral tool calls after `[TOOL_CALLS]`, in either of Mistral's two spellings:
- a JSON array, `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (tokenizers before v11);
- `[TOOL_CALLS]f[ARGS]{...}`, one marker per call (v11 and later).
A call is announced when its name is complete; its arguments stream as canonical JSON fragments.
Text before the first marker is content; text that breaks the format, and everything after it,
is content (marker included when no call came before it). Call ids are 9 letters and digits,
the form Mistral's chat templates accept."""

from __future__ import annotations

import random
import re
import string

from ladle.parsers.tool.base import ToolParserManager
from ladle.parsers.tool.json_stream import JsonStream
from ladle.parsers.tool.llama3_json import JsonObjectRun
from ladle.parsers.types import DeltaToolCall, partial_tag_len

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ARGS = "[ARGS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(JsonObjectRun):
    marker = "[TOOL_CALLS]"
    markers = (marker, _ARGS)
    separators = " \t\r\n,"

    @staticmethod
    def default_id() -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def reset_run(self) -> None:
        super().reset_run()
        self._state = "marker"  # marker | choose | array | name | args | after
        self._buf = ""  # text not read yet
        self._args: JsonStream | None = None

    def feed_run(self, text: str) -> tuple[list[DeltaToolCall], str | None]:
        self._buf += text
        pieces: list[DeltaToolCall] = []
        while True:
            buf = self._buf
            if self._state in ("marker", "after"):
                stripped = buf.lstrip()
                if not stripped:
                    return pieces, None
                if not stripped.startswith(self.marker):
                    if self.marker.startswith(stripped):
                        return pieces, None
                    return pieces, self._content(stripped)
                self._prefix = self.marker
                self._buf, self._state = stripped[len(self.marker) :], "choose"
            elif self._state == "choose":
                stripped = buf.lstrip()
                if not stripped:
                    return pieces, None
                self._state = "array" if stripped.startswith("[") else "name"
                self._buf = stripped[1:] if self._state == "array" else stripped
                if self._state == "array":
                    self._prefix += "["
            elif self._state == "array":
                more, rest, stop = self.read_objects(buf, 0)
                pieces += more
                self._buf = ""
                if rest is not None:
                    return pieces, rest
                if stop == len(buf):
                    return pieces, None
                if buf[stop] != "]":  # neither an object, a comma nor the end of the array
                    return pieces, self._content(buf[stop:])
                self._buf, self._state = buf[stop + 1 :], "after"
            elif self._state == "name":
                end = buf.find(_ARGS)
                name = buf[: len(buf) - partial_tag_len(buf, _ARGS)] if end < 0 else buf[:end]
                if name and not _NAME.fullmatch(name):
                    return pieces, self._content(buf)
                if end < 0:
                    return pieces, None
                if not name:
                    return pieces, self._content(buf)
                pieces.append(self._announce(name))
                self._prefix = ""
                self._buf, self._state, self._args = buf[end + len(_ARGS) :], "args", JsonStream()
            else:  # args
                out, consumed, status = self._args.feed(buf)
                pieces += self._fragment(out)
                self._buf = buf[consumed:]
                if status == "more":
                    return pieces, None
                if status == "error":
                    return pieces, self._buf
                self._state = "after"

    def _content(self, text: str) -> str:
        """Text that is not a call: content, with the marker if no call took it."""
        return self._prefix + text

    def finish_run(self) -> tuple[list[DeltaToolCall], str]:
        if self._state == "array":
            pieces, rest = super().finish_run()
            return pieces, rest if self._call is not None else self._prefix
        if self._state in ("marker", "choose", "name"):
            return [], self._content(self._buf) if (self._prefix or self._buf.strip()) else ""
        return [], ""  # args cut off: the call keeps what was sent; "after": layout
