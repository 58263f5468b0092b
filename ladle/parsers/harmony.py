"""The harmony output format of gpt-oss, parsed incrementally from one choice's text.

A harmony reply is a run of messages, each `<|start|>{header}<|message|>{text}<|end|>`; the
prompt ends in `<|start|>assistant`, so the first header is the output's. The header names the
channel (`<|channel|>analysis`, `commentary` or `final`) and, for a tool call, a recipient
(`to=functions.NAME`, before or after the channel, with a content type such as
`<|constrain|>json`). `<|call|>` ends a call and `<|return|>` the final answer; both are stop
tokens, so the engine ends the output on them and their text never reaches the parser.

What becomes what:
- `analysis` (and a message to a recipient other than `functions.*`, e.g. a built-in tool):
  reasoning;
- `to=functions.NAME`: a tool call, announced (index, id, name) when its header is complete,
  its arguments streamed as the model writes them;
- anything else (`final`, a `commentary` preamble, no channel): content;
- a message of another role (the model writing a tool's answer itself) is dropped.
Two messages of one kind (two analysis messages) are joined with "\\n", as vLLM joins them.
Text outside any message (a malformed reply) is content; a stray end marker there is dropped.

The parser reads text, not token ids: ladle's per-choice parsers all take the detokenized text,
and for harmony the server decodes with special tokens kept (skip_special_tokens off). A model
writing the marker text as ordinary tokens would be read as markers; the tokenizer encodes that
text as the special token, so a model never sees the two apart.

Any chunking of a text parses to the same message: a decision is taken only on whole markers,
a partial marker at the end of a delta is held back, and a header is read only when
`<|message|>` completes it (at most MAX_HEADER_CHARS; a longer one is malformed, read as
content, so nothing is held without bound).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ladle.parsers.types import DeltaMessage, DeltaToolCall, join_or_none, partial_tag_len

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
"""The special tokens the format writes (the tokenizer must have each as one token)."""
STOP_MARKERS = (CALL, RETURN)
"""The assistant's turn ends on these: the server adds them to the request's stop tokens."""
ASSISTANT_START = START + "assistant"
"""How a prompt for a completion ends: the output is the rest of this message."""
FUNCTIONS = "functions."  # the recipient prefix of a function call
MAX_HEADER_CHARS = 1024  # a header without <|message|> by then is malformed

_MESSAGE_ENDS = (END, CALL, RETURN, START)  # what ends a message's text (<|start|>: no <|end|>)
_HEADER_ENDS = (MESSAGE, END, CALL, RETURN, START)
_MAX_MARKER_LEN = max(map(len, MARKERS))
_CHANNEL_NAME = re.compile(r"[^\s<]*")


class _State(enum.Enum):
    OUTSIDE = enum.auto()  # between messages: waiting for <|start|>
    HEADER = enum.auto()  # reading a header, up to <|message|>
    TEXT = enum.auto()  # inside a message's text, up to its end marker


class _Kind(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    CALL = enum.auto()
    DROPPED = enum.auto()


@dataclass(slots=True)
class _Pieces:
    """What one feed produces, in order."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def delta(self) -> DeltaMessage:
        return DeltaMessage(reasoning=join_or_none(self.reasoning),
                            content=join_or_none(self.content), tool_calls=self.tool_calls)


class HarmonyParser:
    """One choice's harmony text -> reasoning, content and tool-call pieces. Make one per choice,
    `feed` it every delta and call `finish` once."""

    def __init__(self, id_factory: Callable[[], str], prefix: str = ASSISTANT_START):
        # prefix: the prompt's unfinished last message (from its last <|start|>), which the
        # output continues: "<|start|>assistant" for a new reply, more with
        # continue_final_message. It sets the state; its own text is not output.
        self.id_factory = id_factory
        self._state = _State.OUTSIDE
        self._buffer = ""  # text read but not yet decided (a header, a partial marker)
        self._is_role_known = False  # HEADER: the header's role was in the prompt
        self._kind = _Kind.CONTENT  # TEXT: where the message's text goes
        self._is_fresh = False  # TEXT: the message has produced no text yet
        self._has_text: set[_Kind] = set()  # kinds that produced text so far (separators)
        self._pending_call: str | None = None  # a call whose announcement is not sent yet
        self.num_calls = 0  # calls announced so far
        self._is_priming = True
        self._run(_Pieces(), prefix, is_final=False)
        self._is_priming = False

    @property
    def is_in_answer(self) -> bool:
        """True while the text being read is an answer or a call (not reasoning)."""
        return self._state is _State.TEXT and self._kind in (_Kind.CONTENT, _Kind.CALL)

    def feed(self, delta_text: str) -> DeltaMessage:
        """The next detokenized delta; returns what it decided."""
        out = _Pieces()
        self._run(out, delta_text, is_final=False)
        return out.delta()

    def finish(self) -> DeltaMessage:
        """End of output: what was held back (an unfinished header is dropped)."""
        out = _Pieces()
        self._run(out, "", is_final=True)
        return out.delta()

    # ---- the state machine -------------------------------------------------------------------
    def _run(self, out: _Pieces, text: str, is_final: bool) -> None:
        self._buffer += text
        self._announce(out)
        while self._step(out, is_final):
            pass
        if is_final:  # what is left is an unfinished header: not text
            self._buffer = ""

    def _step(self, out: _Pieces, is_final: bool) -> bool:
        """Decide what the buffer allows; True when the state changed (step again)."""
        buf = self._buffer
        if self._state is _State.HEADER:
            return self._read_header()
        ends = _MESSAGE_ENDS if self._state is _State.TEXT else MARKERS
        at, marker = _first(buf, ends)
        if marker is None:
            num_held = 0 if is_final else max(partial_tag_len(buf, m) for m in ends)
            self._emit(out, buf[: len(buf) - num_held])
            self._buffer = buf[len(buf) - num_held :]
            return False
        self._emit(out, buf[:at])
        self._buffer = buf[at + len(marker) :]
        if marker == START:
            self._open_header(is_role_known=False, header="")
        elif self._state is _State.OUTSIDE and marker == CHANNEL:
            # The model skipped "<|start|>assistant": the header starts at the channel.
            self._open_header(is_role_known=True, header=CHANNEL)
        else:  # a message's end, or a stray marker between messages (dropped)
            self._state = _State.OUTSIDE
        return True

    def _open_header(self, is_role_known: bool, header: str) -> None:
        self._state = _State.HEADER
        self._is_role_known = is_role_known
        self._buffer = header + self._buffer

    def _read_header(self) -> bool:
        buf = self._buffer
        at, marker = _first(buf, _HEADER_ENDS)
        if marker is not None and at <= MAX_HEADER_CHARS:
            self._buffer = buf[at + len(marker) :]
            if marker == MESSAGE:
                self._open_text(*_read_header(buf[:at], self._is_role_known))
            elif marker == START:  # a new message before this header finished: drop it
                self._open_header(is_role_known=False, header="")
            else:  # ended before <|message|>: a malformed header, dropped
                self._state = _State.OUTSIDE
            return True
        if marker is not None or len(buf) > MAX_HEADER_CHARS + _MAX_MARKER_LEN:
            # No <|message|> within the limit: not a header; its text is content.
            self._open_text(_Kind.CONTENT, None)
            return True
        return False

    def _open_text(self, kind: _Kind, call_name: str | None) -> None:
        self._state = _State.TEXT
        self._kind = kind
        self._is_fresh = True
        self._pending_call = call_name

    # ---- output ------------------------------------------------------------------------------
    def _announce(self, out: _Pieces) -> None:
        if self._pending_call is None or self._is_priming:
            return
        out.tool_calls.append(DeltaToolCall(index=self.num_calls, id=self.id_factory(),
                                            name=self._pending_call, arguments=""))
        self.num_calls += 1
        self._pending_call = None

    def _emit(self, out: _Pieces, text: str) -> None:
        """Text of the current message (or between messages) that is now certain."""
        if self._state is _State.TEXT and self._kind is _Kind.CALL:
            self._announce(out)
        if not text or self._is_priming:
            return
        kind = self._kind if self._state is _State.TEXT else _Kind.CONTENT
        if kind is _Kind.DROPPED:
            return
        if kind is _Kind.CALL:
            out.tool_calls.append(DeltaToolCall(index=self.num_calls - 1, arguments=text))
            return
        if self._state is _State.TEXT and self._is_fresh and kind in self._has_text:
            text = "\n" + text  # a second message of this kind
        self._is_fresh = False
        self._has_text.add(kind)
        (out.reasoning if kind is _Kind.REASONING else out.content).append(text)


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest whole marker in text: (position, marker), or (-1, None)."""
    best, found = -1, None
    for m in markers:
        i = text.find(m)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, m
    return best, found


def _read_header(header: str, is_role_known: bool) -> tuple[_Kind, str | None]:
    """A complete header (between <|start|> and <|message|>) -> (kind, call name). The role
    comes first unless the prompt wrote it; the channel follows <|channel|>; a recipient is a
    `to=` word anywhere; the content type (`json`, `<|constrain|>json`) does not matter here."""
    channel = None
    at = header.find(CHANNEL)
    if at >= 0:
        rest = header[at + len(CHANNEL) :]
        channel = _CHANNEL_NAME.match(rest).group()
        header = header[:at] + " " + rest[len(channel) :]
    words = header.replace(CONSTRAIN, " " + CONSTRAIN).split()
    role = "assistant" if is_role_known else (words.pop(0) if words else "")
    if words and words[0] == role:
        words.pop(0)
    if role != "assistant":
        return _Kind.DROPPED, None
    recipient = next((w[3:] for w in words if w.startswith("to=")), None)
    if recipient in (None, "all"):
        return (_Kind.REASONING if channel == "analysis" else _Kind.CONTENT), None
    if recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
        return _Kind.CALL, recipient[len(FUNCTIONS) :]
    return _Kind.REASONING, None  # a built-in tool's call (browser, python): not the client's
