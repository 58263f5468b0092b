"""Tool-call parsers by name (`--tool-call-parser`): each finds function calls in the content."""

from collections.abc import Mapping
from types import MappingProxyType

from ladle.parsers.tool.base import ToolParser, random_tool_call_id
from ladle.parsers.tool.hermes import HermesToolParser

TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType(
    {
        "hermes": HermesToolParser,
    }
)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; make one instance per request."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        available = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; available: {available}") from None


__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "ToolParser",
    "get_tool_parser",
    "random_tool_call_id",
]
