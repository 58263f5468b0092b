"""Imports go one way: the engine side (engine/, runner/, sample/, structured_output/, models/,
distributed/) never imports the HTTP layer (FastAPI, protocol/, entrypoints/) or the text
frontend."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ladle"
ENGINE_SIDE = ("engine", "runner", "sample", "structured_output", "models", "distributed")
FORBIDDEN = ("fastapi", "uvicorn", "starlette", "pydantic", "ladle.protocol", "ladle.entrypoints",
             "ladle.frontend", "ladle.parsers")
ALLOWED = {("engine", "core_proc.py")}  # the engine process's own loop: zmq, never HTTP


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_engine_side_never_imports_http_or_text_layers():
    offenders = []
    for pkg in ENGINE_SIDE:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for mod in imported_modules(f):
                if mod.startswith(FORBIDDEN):
                    offenders.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not offenders, offenders


def test_parsers_are_plain_python():
    """Parsers return dataclasses, so any layer can use them."""
    for f in (ROOT / "parsers").rglob("*.py"):
        for mod in imported_modules(f):
            assert not mod.startswith(("fastapi", "pydantic", "torch", "msgspec")), (f, mod)
