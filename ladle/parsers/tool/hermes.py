"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`.

A block is a call when its inner text is a JSON object with a non-empty string "name" and an
"arguments" object (missing "arguments" means {}). Written in the usual order (name first), the
call is announced when the name is complete and its arguments stream as canonical JSON
fragments (json_stream.py); in any other key order the block is read whole and the call sent in
one piece when the block closes. The arguments string is json.dumps(arguments,
ensure_ascii=False), the string vLLM returns. Layout rules: tagged.py; what happens to arguments
that break off after the call was announced: base.py.
"""

from __future__ import annotations

from ladle.parsers.tool.base import ToolParser, ToolParserManager
from ladle.parsers.tool.json_stream import JsonCallStream
from ladle.parsers.tool.tagged import TaggedBlockParser
from ladle.parsers.types import DeltaToolCall


@ToolParserManager.register_module("hermes")
class HermesToolParser(TaggedBlockParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    markers = (start_tag, end_tag)

    def reset_block(self) -> None:
        self._call = JsonCallStream(("arguments",))
        self._num_fed = 0  # characters of the block fed so far
        self._end: int | None = None  # where in the block the object ended (or broke off)

    def feed_block(self, text: str) -> list[DeltaToolCall]:
        pieces: list[DeltaToolCall] = []
        if self._call.is_open and text:
            piece = self._call.feed(text)
            if piece.end is not None:
                self._end = self._num_fed + piece.end
            if self._call.whole_arguments is None:  # read whole: sent when the block closes
                if piece.name is not None:
                    pieces.append(self._announce(piece.name))
                pieces += self._fragment(piece.arguments)
        self._num_fed += len(text)
        return pieces

    def close_block(self, is_closed: bool) -> tuple[list[DeltaToolCall], bool, str]:
        self._call.finish()
        rest = self._block_text[self._end :] if self._end is not None else ""
        if self._call.state == "not_call":
            return [], False, ""
        if self._call.whole_arguments is not None:
            if rest.strip():  # text after the object: the block is not a call
                return [], False, ""
            return [self._announce(self._call.name),
                    *self._fragment(self._call.whole_arguments)], True, ""
        return [], True, rest


__all__ = ["HermesToolParser", "ToolParser"]
