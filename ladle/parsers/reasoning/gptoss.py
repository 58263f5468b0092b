"""gpt-oss reasoning (`--reasoning-parser openai_gptoss`, vLLM's name): the analysis channel of
the harmony format. The server uses parsers/harmony.py for reasoning, content and calls at once
(ChoiceOutputParser with harmony on); this class is the same parser seen as a reasoning parser
alone, for code that asks the registry (its tool calls are left out)."""

from ladle.parsers.harmony import CHANNEL, END, HarmonyParser
from ladle.parsers.reasoning.base import ReasoningParser, ReasoningParserManager
from ladle.parsers.tool.base import random_tool_call_id
from ladle.parsers.types import DeltaMessage


@ReasoningParserManager.register_module("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    start_tag = CHANNEL  # the markers a server must keep in the text (see ToolParser.markers)
    end_tag = END
    is_harmony = True

    def reset(self) -> None:
        self._parser = HarmonyParser(random_tool_call_id)

    @property
    def is_reasoning_end(self) -> bool:
        return self._parser.is_in_answer

    def feed(self, delta_text: str) -> DeltaMessage:
        return _without_calls(self._parser.feed(delta_text))

    def finish(self) -> DeltaMessage:
        return _without_calls(self._parser.finish())


def _without_calls(delta: DeltaMessage) -> DeltaMessage:
    return DeltaMessage(reasoning=delta.reasoning, content=delta.content)
