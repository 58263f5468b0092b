"""Tool-call parsers by name (`--tool-call-parser`): each finds function calls in the content.
Importing this package registers the built-in formats with ToolParserManager."""

from ladle.parsers.tool.base import ToolParser, ToolParserManager, random_tool_call_id
from ladle.parsers.tool.hermes import HermesToolParser
from ladle.parsers.tool.llama3_json import Llama3JsonToolParser
from ladle.parsers.tool.mistral import MistralToolParser
from ladle.parsers.tool.openai import OpenAIToolParser
from ladle.parsers.tool.pythonic import PythonicToolParser
from ladle.parsers.tool.qwen3_coder import Qwen3CoderToolParser


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; make one instance per choice."""
    return ToolParserManager.get(name)


__all__ = [
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "OpenAIToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "ToolParser",
    "ToolParserManager",
    "get_tool_parser",
    "random_tool_call_id",
]
