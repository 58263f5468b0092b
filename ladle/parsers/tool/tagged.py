"""Formats whose calls sit between a start and an end tag (hermes, qwen3_coder): the text outside
blocks is content, each block is read by the subclass as it arrives.

Layout rules (the same for a stream and a whole text):
- A block runs from the start tag to the first end tag, or to the end of the output.
- Content is the text outside calls, in order (vLLM keeps only the text before the first call;
  ladle keeps text between and after calls too), except that a whitespace-only stretch next to
  a call is dropped (the newlines between calls are layout). Whitespace inside non-blank text is
  kept as written.
- A block that is not a call stays in the content verbatim, tags included.
- Text outside blocks streams as it comes, except a possible partial start tag at the end of a
  delta and a whitespace-only stretch whose neighbour is not yet known.
"""

from __future__ import annotations

from ladle.parsers.tool.base import ToolParser
from ladle.parsers.types import DeltaMessage, DeltaToolCall, join_or_none, partial_tag_len


class TaggedBlockParser(ToolParser):
    start_tag: str
    end_tag: str

    def reset(self) -> None:
        self._held = ""  # a possible partial tag at the end of the text seen so far
        self._in_block = False  # between the start and end tags
        self._block_text = ""  # the current block's inner text
        self._blank_run = ""  # whitespace opening the current stretch of text, not yet sent
        self._stretch_has_text = False  # the current stretch has non-whitespace (already sent)
        self._after_call = False  # the previous block was a call
        self.num_calls = 0
        self.reset_block()

    # ---- what a subclass implements -------------------------------------------------------
    def reset_block(self) -> None:
        """A new block starts."""
        raise NotImplementedError

    def feed_block(self, text: str) -> list[DeltaToolCall]:
        """More of the block's inner text: the call pieces now certain."""
        raise NotImplementedError

    def close_block(self, is_closed: bool) -> tuple[list[DeltaToolCall], bool, str]:
        """The block ended (end tag, or end of output when not is_closed): (last pieces, whether
        it was a call, text of the block that is content after all: "" for a clean call)."""
        raise NotImplementedError

    # ---- the stream -----------------------------------------------------------------------
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
                    calls += self.feed_block(text)
                else:
                    self._add_text(text, content)
                break
            if self._in_block:
                self._block_text += text[:found]
                calls += self.feed_block(text[:found])
                self._close(is_closed=True, content=content, calls=calls)
            else:
                self._add_text(text[:found], content)
                self._in_block = True
            text = text[found + len(tag) :]
        return DeltaMessage(content=join_or_none(content), tool_calls=calls)

    def finish(self) -> DeltaMessage:
        held, self._held = self._held, ""
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        if self._in_block:  # never closed
            self._block_text += held
            calls += self.feed_block(held)
            self._close(is_closed=False, content=content, calls=calls)
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

    def _close(self, is_closed: bool, content: list[str], calls: list[DeltaToolCall]) -> None:
        pieces, is_call, rest = self.close_block(is_closed)
        calls += pieces
        if not is_call:  # the block is content, tags and all
            raw = self.start_tag + self._block_text + (self.end_tag if is_closed else "")
            content.append(("" if self._after_call else self._blank_run) + raw)
            self._after_call = False
        else:
            if rest.strip():
                content.append(rest)
            self._after_call = True
        # _blank_run is empty or was whitespace next to a call: either way it is spent.
        self._blank_run = ""
        self._stretch_has_text = False
        self._in_block = False
        self._block_text = ""
        self.reset_block()
