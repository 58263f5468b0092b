"""The tool-call parser interface: find function calls in the content part of the output, for a
whole text (`extract`) and for a stream of detokenized deltas (`feed` / `finish`).

`extract(text)` is defined as a fresh stream fed `text` in one delta, so a stream reassembled
with `merge_deltas` equals `extract` for every chunking (ids aside, which the factory makes).
"""

import copy
import uuid
from collections.abc import Callable

from ladle.parsers.types import DeltaMessage, ExtractedMessage, merge_deltas


def random_tool_call_id() -> str:
    """OpenAI-style call id: "call_" and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Per-request parser (one per choice when n > 1): `feed` keeps state between deltas."""

    num_calls: int
    """Calls sent by the stream so far (the next call's index); set by reset()."""

    def __init__(self, id_factory: Callable[[], str] = random_tool_call_id):
        # Makes each call's id; tests inject a deterministic one.
        self.id_factory = id_factory
        self.reset()

    def reset(self) -> None:
        """Forget the stream so far (start a new one)."""
        raise NotImplementedError

    def feed(self, delta_text: str) -> DeltaMessage:
        """Take the next content delta; return the content and call pieces now certain."""
        raise NotImplementedError

    def finish(self) -> DeltaMessage:
        """End of output: release held-back text and any call still open."""
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedMessage:
        """Parse a whole content text; does not touch this object's stream state."""
        stream = copy.copy(self)
        stream.reset()
        return merge_deltas([stream.feed(text), stream.finish()])
