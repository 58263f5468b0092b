"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`.

Rules (the same for a stream and a whole text):
- A block runs from <tool_call> to the first </tool_call>, or to the end of the output if the
  model never closed it. A block is a call when its inner text is a JSON object with a non-empty
  string "name" and an "arguments" object (missing "arguments" means {}); keys may come in any
  order. The call's arguments string is `json.dumps(arguments, ensure_ascii=False)`, the same
  string vLLM returns. NaN/Infinity are not JSON and make the block invalid.
- An invalid block is not a call: its text, tags included, stays in the content verbatim.
- Content is the text outside calls, in order (vLLM keeps only the text before the first call;
  ladle keeps text between and after calls too, so nothing the model wrote is lost), except that
  a whitespace-only stretch next to a call is dropped (the newlines between calls are layout).
- Whitespace inside non-blank text is kept as written ("Let me check.\\n\\n" stays).

Streaming: text outside blocks streams as it comes, except a possible partial "<tool_call>" at
the end of a delta and a whitespace-only stretch whose neighbour is not yet known, which are held
back; so no markup ever reaches the content. A block is held until it closes, then parsed once
and sent as one DeltaToolCall carrying index, id, name and the whole arguments string. Streaming
arguments token by token cannot promise the non-stream string: the JSON may turn out invalid or
cut off by max_tokens (then the block is content), keys may repeat, and json.dumps normalises
spacing, escapes and numbers. Holding the block costs latency only for the call itself.
"""

import json

from ladle.parsers.tool.base import ToolParser
from ladle.parsers.types import DeltaMessage, DeltaToolCall, join_or_none, partial_tag_len


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class HermesToolParser(ToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def reset(self) -> None:
        self._held = ""  # a possible partial tag at the end of the text seen so far
        self._in_block = False  # between <tool_call> and </tool_call>
        self._block_text = ""  # the current block's inner text
        self._blank_run = ""  # whitespace opening the current stretch of text, not yet sent
        self._stretch_has_text = False  # the current stretch has non-whitespace (already sent)
        self._after_call = False  # the previous block was a call
        self.num_calls = 0  # calls sent so far; the next call's index

    def feed(self, delta_text: str) -> DeltaMessage:
        text = self._held + delta_text
        self._held = ""
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        while text:
            tag = self.end_tag if self._in_block else self.start_tag
            found = text.find(tag)
            if found < 0:
                num_held = partial_tag_len(text, tag)
                self._held = text[len(text) - num_held :]
                text = text[: len(text) - num_held]
                if self._in_block:
                    self._block_text += text
                else:
                    self._add_text(text, content)
                break
            if self._in_block:
                self._block_text += text[:found]
                self._close_block(is_closed=True, content=content, calls=calls)
            else:
                self._add_text(text[:found], content)
                self._in_block = True
            text = text[found + len(tag) :]
        return DeltaMessage(content=join_or_none(content), tool_calls=calls)

    def finish(self) -> DeltaMessage:
        held, self._held = self._held, ""
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        if self._in_block:  # never closed: parse what there is
            self._block_text += held
            self._close_block(is_closed=False, content=content, calls=calls)
        else:  # a partial start tag is ordinary text
            self._add_text(held, content)
        if not self._after_call:  # trailing whitespace next to a call is dropped
            content.append(self._blank_run)
        self._blank_run = ""
        return DeltaMessage(content=join_or_none(content), tool_calls=calls)

    def _add_text(self, text: str, content: list[str]) -> None:
        """Text outside blocks: send it, unless the stretch is still all whitespace."""
        if self._stretch_has_text:
            content.append(text)
        elif text.isspace():
            self._blank_run += text
        elif text:
            content.append(self._blank_run + text)
            self._blank_run = ""
            self._stretch_has_text = True

    def _close_block(self, is_closed: bool, content: list[str], calls: list[DeltaToolCall]) -> None:
        parsed = self._parse_call(self._block_text)
        if parsed is None:  # not a call: the block is content, tags and all
            raw = self.start_tag + self._block_text + (self.end_tag if is_closed else "")
            content.append(("" if self._after_call else self._blank_run) + raw)
            self._after_call = False
        else:
            name, arguments = parsed
            calls.append(
                DeltaToolCall(
                    index=self.num_calls, id=self.id_factory(), name=name, arguments=arguments
                )
            )
            self.num_calls += 1
            self._after_call = True
        # _blank_run is empty or was whitespace next to a call: either way it is spent.
        self._blank_run = ""
        self._stretch_has_text = False
        self._in_block = False
        self._block_text = ""

    @staticmethod
    def _parse_call(block_text: str) -> tuple[str, str] | None:
        """(name, arguments JSON) when the block is a valid call, else None."""
        try:
            call = json.loads(block_text, parse_constant=_reject_constant)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return None
        if not isinstance(call, dict):
            return None
        name = call.get("name")
        arguments = call.get("arguments", {})
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return name, json.dumps(arguments, ensure_ascii=False)
