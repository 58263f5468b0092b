"""Output text parsers: reasoning/ (<think> blocks) and tool/ (function calls), each a base with a
registry and one file per format; harmony.py splits gpt-oss's channels (reasoning, content and
calls at once); choice.py is the one per-choice parser that chains them or runs harmony;
types.py holds the plain results. `load_plugins` imports user parser files (vLLM's
--tool-parser-plugin / --reasoning-parser-plugin)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ladle.parsers.reasoning import ReasoningParserManager
from ladle.parsers.tool import ToolParserManager


def load_plugin(path: str | Path) -> None:
    """Import a Python file; its @...Manager.register_module decorators register its parsers."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"parser plugin {str(path)!r}: no such file")
    name = f"ladle_parser_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"parser plugin {str(path)!r}: importing it failed "
                         f"({type(e).__name__}: {e})") from e


def load_plugins(*, tool_parser_plugin: str | None = None,
                 reasoning_parser_plugin: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
    """Load the plugin files, then check that the chosen parser names are registered (a
    ValueError lists the names that are)."""
    for plugin in (tool_parser_plugin, reasoning_parser_plugin):
        if plugin is not None:
            load_plugin(plugin)
    if tool_call_parser is not None:
        ToolParserManager.get(tool_call_parser)
    if reasoning_parser is not None:
        ReasoningParserManager.get(reasoning_parser)
