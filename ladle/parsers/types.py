"""Plain results of the output parsers (no pydantic, so any layer can use them), plus the two
small text helpers the parsers share: the partial-tag holdback and reassembling a stream."""

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCall:
    """One complete function call found in the output."""

    id: str
    """Unique per call, e.g. "call_3f2a..."; made by the tool parser's id factory."""
    name: str
    """The function name the model wrote."""
    arguments: str
    """The arguments object as JSON text: `json.dumps(args, ensure_ascii=False)`."""


@dataclass(slots=True)
class DeltaToolCall:
    """A piece of a tool call in a stream, shaped like OpenAI's `choices[].delta.tool_calls[]`."""

    index: int
    """Position of the call within the message (0, 1, ...); every piece of a call repeats it."""
    id: str | None = None
    """Set on the first piece of a call only."""
    name: str | None = None
    """Set on the first piece of a call only."""
    arguments: str | None = None
    """A fragment of the arguments JSON; a call's fragments concatenate to ToolCall.arguments."""


@dataclass(slots=True)
class DeltaMessage:
    """What one stream step adds to the message; None / [] where it adds nothing."""

    reasoning: str | None = None
    """New reasoning text (the part inside <think>...</think>)."""
    content: str | None = None
    """New answer text."""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
    """New tool-call pieces."""

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to send (the server can skip the chunk)."""
        return self.reasoning is None and self.content is None and not self.tool_calls


@dataclass(slots=True)
class ExtractedMessage:
    """A whole parsed message: the non-stream result, or a stream reassembled by merge_deltas."""

    reasoning: str | None = None
    """The reasoning text, None when there is none."""
    content: str | None = None
    """The answer text, None when there is none."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The extracted calls, in the order the model wrote them."""


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none).

    A stream holds that many characters back: the next delta may complete the tag.
    """
    for num_chars in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:num_chars]):
            return num_chars
    return 0


def join_or_none(pieces: Iterable[str]) -> str | None:
    """Concatenate text pieces; None (not "") when they add up to nothing."""
    return "".join(pieces) or None


def merge_deltas(deltas: Iterable[DeltaMessage]) -> ExtractedMessage:
    """Reassemble a stream into the message a client accumulating the chunks would see."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.reasoning is not None:
            reasoning.append(delta.reasoning)
        if delta.content is not None:
            content.append(delta.content)
        for piece in delta.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                if piece.id is None or piece.name is None:
                    raise ValueError(f"first piece of tool call {piece.index} has no id or name")
                call = calls[piece.index] = ToolCall(id=piece.id, name=piece.name, arguments="")
            call.arguments += piece.arguments or ""
    return ExtractedMessage(
        reasoning=join_or_none(reasoning),
        content=join_or_none(content),
        tool_calls=[calls[index] for index in sorted(calls)],
    )


def merge_pieces(a: DeltaMessage, b: DeltaMessage) -> DeltaMessage:
    """Two consecutive deltas as one (e.g. the last feed and finish, sent in one chunk)."""
    calls = list(a.tool_calls)
    for piece in b.tool_calls:  # each call index once per chunk
        if calls and calls[-1].index == piece.index and piece.id is None:
            calls[-1] = DeltaToolCall(calls[-1].index, calls[-1].id, calls[-1].name,
                                      (calls[-1].arguments or "") + (piece.arguments or ""))
        else:
            calls.append(piece)
    return DeltaMessage(reasoning=join_or_none(filter(None, [a.reasoning, b.reasoning])),
                        content=join_or_none(filter(None, [a.content, b.content])),
                        tool_calls=calls)
