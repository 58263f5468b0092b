"""Reasoning parsers by name (`--reasoning-parser`): each splits output into reasoning/content.
Importing this package registers the built-in ones with ReasoningParserManager."""

from ladle.parsers.reasoning.base import ReasoningParser, ReasoningParserManager
from ladle.parsers.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from ladle.parsers.reasoning.gptoss import GptOssReasoningParser
from ladle.parsers.reasoning.qwen3 import Qwen3ReasoningParser


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name`; make one instance per choice."""
    return ReasoningParserManager.get(name)


__all__ = [
    "DeepSeekR1ReasoningParser",
    "GptOssReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "get_reasoning_parser",
]
