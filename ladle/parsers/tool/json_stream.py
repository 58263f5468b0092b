"""Streaming a JSON call object as the model writes it: `JsonStream` checks JSON one character at
a time and re-writes it in one canonical spelling (json.dumps's separators, ensure_ascii=False),
and `JsonCallStream` reads `{"name": "f", "arguments": {...}}`, announcing the name as soon as it
is complete and then the arguments as fragments.

Why canonical: a stream's fragments and a whole response must give the same arguments string
for any chunking, and that string should be what vLLM returns (json.dumps of the arguments). The
canonical text equals json.dumps(json.loads(raw), ensure_ascii=False) except that a repeated key
is kept twice (json.loads keeps the last), a lone surrogate stays an escape, and a number too
large for a float is kept as written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
# What a parser expects next inside a container.
_VALUE, _VALUE_OR_END, _KEY_OR_END, _KEY, _COLON, _COMMA_OR_END = range(6)


def _canonical_scalar(text: str) -> str:
    """json.dumps's spelling of a number (1E2 -> 100.0), unless that would not be JSON."""
    if text in _LITERALS:
        return text
    spelled = json.dumps(json.loads(text))
    return text if spelled in ("Infinity", "-Infinity", "NaN") else spelled


def _encode(ch: str) -> str:
    return json.dumps(ch, ensure_ascii=False)[1:-1]


class JsonStream:
    """One JSON value, fed in pieces. `feed` returns (canonical text now certain, number of
    characters of the piece it consumed, status): "more" (consumed all of it), "done" (the value
    ended at that many characters) or "error" (the character at that index is not JSON)."""

    def __init__(self, object_only: bool = True):
        self.object_only = object_only  # arguments must be an object
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = _VALUE
        self._in_string = False
        self._is_key = False
        self._escape: str | None = None  # None, "" (after a backslash) or "u" + hex digits
        self._high: int | None = None  # a high surrogate waiting for its low half
        self._scalar = ""  # a number or literal being read
        self.is_done = False

    def feed(self, text: str) -> tuple[str, int, str]:
        out: list[str] = []
        for i, ch in enumerate(text):
            if not self._char(ch, out):
                return "".join(out), i, "error"
            if self.is_done:
                return "".join(out), i + 1, "done"
        return "".join(out), len(text), "more"

    def _char(self, ch: str, out: list[str]) -> bool:
        if self._in_string:
            return self._string_char(ch, out)
        if self._scalar:
            if ch.isalnum() or ch in "+-.":
                self._scalar += ch
                return True
            if not (_NUMBER.fullmatch(self._scalar) or self._scalar in _LITERALS):
                return False
            out.append(_canonical_scalar(self._scalar))
            self._scalar = ""
            self._after_value()
            if self.is_done:  # a bare top-level scalar ends before this character
                return False
        if ch in " \t\n\r":
            return True
        expect = self._expect
        if expect in (_VALUE, _VALUE_OR_END):
            if expect == _VALUE_OR_END and ch == "]":
                return self._close(ch, out)
            if not self._stack and self.object_only and ch != "{":
                return False
            if ch in "{[":
                out.append(ch)
                self._stack.append(ch)
                self._expect = _KEY_OR_END if ch == "{" else _VALUE_OR_END
            elif ch == '"':
                out.append(ch)
                self._in_string, self._is_key = True, False
            elif ch == "-" or ch.isdigit() or ch in "tfn":
                self._scalar = ch
            else:
                return False
            return True
        if expect in (_KEY_OR_END, _KEY):
            if ch == '"':
                out.append(ch)
                self._in_string, self._is_key = True, True
                return True
            return expect == _KEY_OR_END and ch == "}" and self._close(ch, out)
        if expect == _COLON:
            if ch != ":":
                return False
            out.append(": ")
            self._expect = _VALUE
            return True
        # _COMMA_OR_END
        if ch == ",":
            out.append(", ")
            self._expect = _KEY if self._stack[-1] == "{" else _VALUE
            return True
        return ch == ("}" if self._stack[-1] == "{" else "]") and self._close(ch, out)

    def _close(self, ch: str, out: list[str]) -> bool:
        out.append(ch)
        self._stack.pop()
        self._after_value()
        return True

    def _after_value(self) -> None:
        if self._stack:
            self._expect = _COMMA_OR_END
        else:
            self.is_done = True

    def _string_char(self, ch: str, out: list[str]) -> bool:
        if self._escape is None:
            if ch == '"':
                self._flush_high(out)
                out.append(ch)
                self._in_string = False
                if self._is_key:
                    self._expect = _COLON
                else:
                    self._after_value()
            elif ch == "\\":
                self._escape = ""
            elif ch < " ":
                return False  # JSON strings cannot hold raw control characters
            else:
                self._flush_high(out)
                out.append(_encode(ch))
            return True
        if self._escape == "":
            if ch == "u":
                self._escape = "u"
                return True
            if ch not in _ESCAPES:
                return False
            self._escape = None
            self._flush_high(out)
            out.append(_encode(_ESCAPES[ch]))
            return True
        if ch not in "0123456789abcdefABCDEF":
            return False
        self._escape += ch
        if len(self._escape) == 5:
            code = int(self._escape[1:], 16)
            self._escape = None
            if 0xD800 <= code < 0xDC00:
                self._flush_high(out)
                self._high = code
            elif 0xDC00 <= code < 0xE000 and self._high is not None:
                out.append(chr(0x10000 + ((self._high - 0xD800) << 10) + code - 0xDC00))
                self._high = None
            else:
                self._flush_high(out)
                # a lone surrogate stays an escape (it has no UTF-8 form)
                out.append(f"\\u{code:04x}" if 0xD800 <= code < 0xE000 else _encode(chr(code)))
        return True

    def _flush_high(self, out: list[str]) -> None:
        if self._high is not None:
            out.append(f"\\u{self._high:04x}")
            self._high = None


# ---- a call object ----------------------------------------------------------------------------
def match_call_head(text: str, keys: tuple[str, ...]) -> tuple[str, str | None, int]:
    """Does `text` open `{"name": "<name>", "<key>": {` (key one of `keys`)? ("match", name,
    index of the arguments' opening brace), ("partial", None, 0) when more text could still make it match, or
    ("nomatch", None, 0)."""
    partial = ("partial", None, 0)
    nomatch = ("nomatch", None, 0)
    i = 0
    name = None
    for want in ("{", ('"name"',), ":", "STRING", ",", tuple(f'"{k}"' for k in keys), ":"):
        while i < len(text) and text[i] in " \t\n\r":
            i += 1
        if i == len(text):
            return partial
        if want == "STRING":
            if text[i] != '"':
                return nomatch
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                return partial
            try:
                name = json.loads(text[i : j + 1])
            except ValueError:
                return nomatch
            if not name:
                return nomatch
            i = j + 1
            continue
        options = want if isinstance(want, tuple) else (want,)
        rest = text[i:]
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return partial if any(o.startswith(rest) for o in options) else nomatch
        i += len(hit)
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    if i == len(text):
        return partial
    return ("match", name, i) if text[i] == "{" else nomatch  # arguments must be an object


@dataclass(slots=True)
class CallPiece:
    """What one `JsonCallStream.feed` adds."""

    name: str | None = None  # the function name, the moment it is complete
    arguments: str = ""  # the next canonical fragment of the arguments
    end: int | None = None  # index in the fed text where the object ended (or broke off)


class JsonCallStream:
    """One call object as it arrives. States: "head" (the name is not known yet), "args" (the
    name was announced; arguments stream), "tail" (arguments done; waiting for the closing
    brace), "call" (the object closed as a call), "broken" (announced, then not JSON: the call
    keeps what streamed, the rest of the text is not part of it), "whole" (the head did not
    match the usual order: the object is read whole, then judged), "not_call"."""

    def __init__(self, keys: tuple[str, ...] = ("arguments", "parameters")):
        self.keys = keys
        self.state = "head"
        self.name: str | None = None
        self.whole_arguments: str | None = None  # a "whole" object that turned out a call
        self._raw = ""  # the text fed while the head is undecided or the object is read whole
        self._args = JsonStream()
        self._scan: JsonStream | None = None

    @property
    def is_open(self) -> bool:
        return self.state in ("head", "args", "tail", "whole")

    def feed(self, text: str) -> CallPiece:
        piece = CallPiece()
        pos = 0
        if self.state == "head":
            offset = len(self._raw)
            self._raw += text
            status, name, end = match_call_head(self._raw, self.keys)
            if status == "partial":
                return piece
            if status == "match":
                self.state, self.name, piece.name = "args", name, name
                pos = end - offset
                self._raw = ""
            else:
                self.state, self._scan = "whole", JsonStream(object_only=True)
                _, consumed, st = self._scan.feed(self._raw)
                return self._judge_whole(piece, st, consumed, consumed - offset)
        elif self.state == "whole":
            offset = len(self._raw)
            self._raw += text
            _, consumed, st = self._scan.feed(text)
            return self._judge_whole(piece, st, offset + consumed, consumed)
        if self.state == "args":
            out, consumed, st = self._args.feed(text[pos:])
            piece.arguments = out
            pos += consumed
            if st == "error":
                self.state, piece.end = "broken", pos
                return piece
            if st == "done":
                self.state = "tail"
        if self.state == "tail":
            while pos < len(text) and text[pos] in " \t\n\r":
                pos += 1
            if pos < len(text):
                self.state = "call" if text[pos] == "}" else "broken"
                piece.end = pos + 1 if self.state == "call" else pos
        return piece

    def _judge_whole(self, piece: CallPiece, status: str, raw_end: int,
                     text_end: int) -> CallPiece:
        """The object read whole: a call when it is a JSON object with a string name and an
        object under one of the keys, whatever the order."""
        if status == "more":
            return piece
        self.state = "not_call"
        piece.end = max(text_end, 0)
        if status == "done":
            try:
                obj = json.loads(self._raw[:raw_end])
            except (ValueError, RecursionError):
                return piece  # e.g. a number out of range
            name = obj.get("name")
            args = next((obj[k] for k in self.keys if k in obj), {})  # none: no arguments
            if isinstance(name, str) and name and isinstance(args, dict):
                self.state, self.name = "call", name
                self.whole_arguments = json.dumps(args, ensure_ascii=False)
                piece.name, piece.arguments = name, self.whole_arguments
        return piece

    def finish(self) -> None:
        """No more text: an unfinished head or whole object is not a call; announced arguments
        that did not close are a cut call."""
        if self.state in ("head", "whole"):
            self.state = "not_call"
        elif self.state in ("args", "tail"):
            self.state = "broken"
