"""Pythonic tool calls (Llama 3.2 / Llama 4 and others): a Python list of calls with keyword
arguments, `[get_weather(city="Paris", days=3), get_time()]`, opening the output, optionally
wrapped in `<|python_start|>` ... `<|python_end|>`. Argument values are Python literals
(strings, numbers, True / False / None, lists, dicts, tuples) and become JSON. A call is
announced at `name(` and its first keyword (or `)`); each argument is sent as an arguments fragment once its value is complete,
and `)` closes the object. Output that does not open with a call list is content; a call list
that breaks off (a positional argument, a value that is not a literal) ends there, and the rest
is content."""

from __future__ import annotations

import ast
import json
import re

from ladle.parsers.tool.base import ToolParserManager
from ladle.parsers.tool.region import CallRunParser
from ladle.parsers.types import DeltaToolCall

_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_CALL_PREFIX = re.compile(r"[A-Za-z_][\w.]*\s*")
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=")
_KEYWORD_PREFIX = re.compile(r"[A-Za-z_]\w*\s*")
_END = "<|python_end|>"


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(CallRunParser):
    marker = "<|python_start|>"
    opens_at_start = ("[",)
    markers = (marker, _END)

    def reset_run(self) -> None:
        self._state = "open"  # open | name | keyword | value | after_call | after_list
        self._buf = ""  # text not read yet
        self._run_text = ""  # the run's text while no call is announced (content if none is)
        self._num_args = 0

    def feed_run(self, text: str) -> tuple[list[DeltaToolCall], str | None]:
        if self.num_calls == 0:
            self._run_text += text
        self._buf += text
        pieces: list[DeltaToolCall] = []
        while True:
            buf = self._buf.lstrip()
            if not buf:
                return pieces, None
            state = self._state
            if state == "open":
                if buf.startswith(self.marker):
                    buf = buf[len(self.marker) :].lstrip()
                if not buf or self.marker.startswith(buf):
                    return pieces, None
                if buf[0] != "[":
                    return pieces, self._not_calls(buf)
                self._buf, self._state = buf[1:], "name"
            elif state == "name":
                m = _CALL.match(buf)
                if m is None:
                    if _CALL_PREFIX.fullmatch(buf):
                        return pieces, None
                    return pieces, self._not_calls(buf)
                after = buf[m.end() :].lstrip()  # announced at the first keyword or ")"
                if not (after.startswith(")") or _KEYWORD.match(after)):
                    if not after or _KEYWORD_PREFIX.fullmatch(after):
                        return pieces, None
                    return pieces, self._not_calls(buf)
                pieces.append(self._announce(m.group(1)))
                self._run_text = ""
                self._buf, self._state, self._num_args = buf[m.end() :], "keyword", 0
            elif state == "keyword":
                if buf[0] == ")":
                    pieces += self._fragment("}" if self._num_args else "{}")
                    self._buf, self._state = buf[1:], "after_call"
                    continue
                if buf[0] == "," and self._num_args:
                    buf = buf[1:].lstrip()
                    if not buf:
                        return pieces, None
                m = _KEYWORD.match(buf)
                if m is None:
                    if _KEYWORD_PREFIX.fullmatch(buf):
                        return pieces, None
                    return pieces, buf
                self._key = m.group(1)
                self._buf, self._state = buf[m.end() :], "value"
            elif state == "value":
                end = _value_end(buf)
                if end is None:
                    return pieces, None
                try:
                    value = json.dumps(ast.literal_eval(buf[:end].strip()), ensure_ascii=False,
                                       allow_nan=False)
                except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
                    return pieces, buf
                pieces += self._fragment(("{" if self._num_args == 0 else ", ")
                                         + json.dumps(self._key, ensure_ascii=False) + ": "
                                         + value)
                self._num_args += 1
                self._buf, self._state = buf[end:], "keyword"
            elif state == "after_call":
                if buf[0] == ",":
                    self._buf, self._state = buf[1:], "name"
                elif buf[0] == "]":
                    self._buf, self._state = buf[1:], "after_list"
                else:
                    return pieces, buf
            else:  # after_list: an end marker is layout, anything else is content
                if buf.startswith(_END):
                    self._buf = buf[len(_END) :]
                    continue
                if _END.startswith(buf):
                    return pieces, None
                return pieces, buf

    def _not_calls(self, buf: str) -> str:
        """No call was announced: the run's text is content as written."""
        return self._run_text if self.num_calls == 0 else buf

    def finish_run(self) -> tuple[list[DeltaToolCall], str]:
        if self.num_calls == 0:
            return [], self._run_text
        if self._state == "after_list":
            return [], self._buf if not _END.startswith(self._buf.strip()) else ""
        return [], ""  # cut off inside a call: it keeps what was sent


def _value_end(text: str) -> int | None:
    """Index of the "," or ")" that ends the literal at the start of `text` (None: not yet)."""
    depth = 0
    quote = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote is not None:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:  # ")" ends the call; "]" or "}" here is not a literal (it fails)
                return i
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return None
