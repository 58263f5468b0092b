"""One object per request that turns chat output text into reasoning, content and tool calls:
the reasoning parser runs first and only its content goes on to the tool parser."""

from collections.abc import Callable

from ladle.parsers.reasoning import ReasoningParser, get_reasoning_parser
from ladle.parsers.tool import ToolParser, get_tool_parser, random_tool_call_id
from ladle.parsers.types import DeltaMessage, ExtractedMessage


class ChatOutputParser:
    """Chains an optional reasoning parser and an optional tool parser (one per choice)."""

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None = None,
        tool_parser: ToolParser | None = None,
    ):
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser

    @classmethod
    def from_names(
        cls,
        reasoning_parser: str | None = None,
        tool_parser: str | None = None,
        *,
        prompt_text: str = "",
        id_factory: Callable[[], str] = random_tool_call_id,
    ) -> "ChatOutputParser":
        """Build from registry names; `prompt_text` (the rendered prompt) tells whether the chat
        template already opened the think block. Pass tool_parser=None when the request has no
        tools (or tool_choice is "none") so tool-like text stays content."""
        reasoning = None
        if reasoning_parser is not None:
            reasoning_cls = get_reasoning_parser(reasoning_parser)
            reasoning = reasoning_cls(
                prompt_ends_in_think=reasoning_cls.thinking_started_in_prompt(prompt_text)
            )
        tool = get_tool_parser(tool_parser)(id_factory=id_factory) if tool_parser else None
        return cls(reasoning, tool)

    @property
    def is_reasoning_end(self) -> bool:
        """True once the stream is past the reasoning (always, without a reasoning parser)."""
        return self.reasoning_parser is None or self.reasoning_parser.is_reasoning_end

    @property
    def num_tool_calls(self) -> int:
        """Tool calls streamed so far: finish_reason is "tool_calls" when non-zero."""
        return 0 if self.tool_parser is None else self.tool_parser.num_calls

    def extract(self, text: str) -> ExtractedMessage:
        """Parse a whole output text; does not touch the stream state."""
        reasoning, content = None, text or None
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract(text)
        if self.tool_parser is None:
            return ExtractedMessage(reasoning=reasoning, content=content)
        message = self.tool_parser.extract(content or "")
        message.reasoning = reasoning
        return message

    def feed(self, delta_text: str) -> DeltaMessage:
        """Take the next detokenized delta of the output."""
        if self.reasoning_parser is None:
            delta = DeltaMessage(content=delta_text or None)
        else:
            delta = self.reasoning_parser.feed(delta_text)
        return self._parse_tools(delta, is_final=False)

    def finish(self) -> DeltaMessage:
        """End of output: flush everything held back by either parser."""
        delta = DeltaMessage()
        if self.reasoning_parser is not None:
            delta = self.reasoning_parser.finish()
        return self._parse_tools(delta, is_final=True)

    def _parse_tools(self, delta: DeltaMessage, is_final: bool) -> DeltaMessage:
        if self.tool_parser is None:
            return delta
        tools = self.tool_parser.feed(delta.content or "")
        if is_final:
            last = self.tool_parser.finish()
            tools.content = "".join(filter(None, [tools.content, last.content])) or None
            tools.tool_calls += last.tool_calls
        tools.reasoning = delta.reasoning
        return tools
