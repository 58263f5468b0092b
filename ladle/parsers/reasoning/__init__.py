"""Reasoning parsers by name (`--reasoning-parser`): each splits output into reasoning/content."""

from collections.abc import Mapping
from types import MappingProxyType

from ladle.parsers.reasoning.base import ReasoningParser
from ladle.parsers.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from ladle.parsers.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: Mapping[str, type[ReasoningParser]] = MappingProxyType(
    {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "qwen3": Qwen3ReasoningParser,
    }
)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name`; make one instance per request."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        available = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; available: {available}") from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "get_reasoning_parser",
]
