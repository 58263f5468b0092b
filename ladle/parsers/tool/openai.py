"""gpt-oss tool calls (`--tool-call-parser openai`, vLLM's name): `to=functions.NAME` messages
on the commentary channel of the harmony format. The server uses parsers/harmony.py for
reasoning, content and calls at once (ChoiceOutputParser with harmony on); this class is the same
parser seen as a tool parser alone, for code that asks the registry (reasoning is left out)."""

from __future__ import annotations

from ladle.parsers.harmony import MARKERS, HarmonyParser
from ladle.parsers.tool.base import ToolParser, ToolParserManager
from ladle.parsers.types import DeltaMessage


@ToolParserManager.register_module("openai")
class OpenAIToolParser(ToolParser):
    markers = MARKERS
    is_harmony = True

    def reset(self) -> None:
        self._parser = HarmonyParser(self.id_factory)

    @property
    def num_calls(self) -> int:
        return self._parser.num_calls

    def feed(self, delta_text: str) -> DeltaMessage:
        return _without_reasoning(self._parser.feed(delta_text))

    def finish(self) -> DeltaMessage:
        return _without_reasoning(self._parser.finish())


def _without_reasoning(delta: DeltaMessage) -> DeltaMessage:
    return DeltaMessage(content=delta.content, tool_calls=delta.tool_calls)
