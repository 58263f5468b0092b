"""Qwen3-Coder tool calls: XML parameters inside hermes-style tags:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after the opening tag and one before the closing
tag are layout); it becomes JSON by the type the request's tool schema gives that parameter
(string stays text; integer, number, boolean, null, object and array are parsed, and a value that
does not parse stays text), as vLLM's parser does. The call is announced at `<function=NAME>`
and each parameter is sent as an arguments fragment when it closes; `</function>` closes the
object. A missing `</parameter>` ends at the next `<parameter=` or `</function>`.
"""

from __future__ import annotations

import ast
import json
import re

from ladle.parsers.tool.base import ToolParserManager
from ladle.parsers.tool.tagged import TaggedBlockParser
from ladle.parsers.types import DeltaToolCall

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>")


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(TaggedBlockParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    markers = (start_tag, end_tag)

    def reset_block(self) -> None:
        self._state = "head"  # head | params | done | not_call | broken
        self._cursor = 0  # how far the block text is read
        self._name = ""
        self._num_params = 0

    def feed_block(self, text: str) -> list[DeltaToolCall]:
        pieces: list[DeltaToolCall] = []
        buf = self._block_text
        while self._state in ("head", "params"):
            start = self._cursor
            while start < len(buf) and buf[start].isspace():
                start += 1
            rest = buf[start:]
            if not rest:
                break
            if self._state == "head":
                m = _FUNCTION.match(rest)
                if m is None:
                    if not _could_open(rest, "<function="):
                        self._state = "not_call"
                    break
                self._name = m.group(1).strip()
                pieces.append(self._announce(self._name))
                self._cursor, self._state = start + m.end(), "params"
                continue
            if rest.startswith("</function>"):
                pieces += self._fragment("}" if self._num_params else "{}")
                self._cursor, self._state = start + len("</function>"), "done"
                break
            m = _PARAMETER.match(rest)
            if m is None:
                if not (_could_open(rest, "<parameter=") or "</function>".startswith(rest)):
                    self._cursor, self._state = start, "broken"
                break
            ends = [(rest.find(e, m.end()), e) for e in _VALUE_ENDS]
            ends = [(i, e) for i, e in ends if i >= 0]
            if not ends:
                break  # the value is still arriving
            end, tag = min(ends)
            value = rest[m.end() : end].removeprefix("\n").removesuffix("\n")
            pieces += self._fragment(("{" if self._num_params == 0 else ", ")
                                     + json.dumps(m.group(1).strip(), ensure_ascii=False) + ": "
                                     + self._json_value(m.group(1).strip(), value))
            self._num_params += 1
            self._cursor = start + end + (len(tag) if tag == "</parameter>" else 0)
        return pieces

    def close_block(self, is_closed: bool) -> tuple[list[DeltaToolCall], bool, str]:
        if self._state in ("head", "not_call"):
            return [], False, ""
        if self._state == "params":  # no </function>
            if not is_closed:
                return [], True, ""  # cut off: the call keeps what was sent
            rest = self._block_text[self._cursor :]
            if rest.strip():  # an unterminated parameter
                return [], True, rest
            return self._fragment("}" if self._num_params else "{}"), True, ""
        return [], True, self._block_text[self._cursor :]

    def _json_value(self, parameter: str, value: str) -> str:
        kind = self._parameter_schema(self._name, parameter).get("type", "string")
        kinds = kind if isinstance(kind, list) else [kind]
        if "string" not in kinds:
            for parse in (json.loads, ast.literal_eval):
                try:
                    parsed = parse(value.strip())
                    return json.dumps(parsed, ensure_ascii=False, allow_nan=False)
                except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
                    continue
        return json.dumps(value, ensure_ascii=False)


def _could_open(text: str, opener: str) -> bool:
    """`text` is the start of `opener...>` that has not finished arriving."""
    if opener.startswith(text):
        return True
    return text.startswith(opener) and ">" not in text and "\n" not in text
