"""`ladle serve --config FILE.yaml`, as vLLM reads it: a YAML mapping whose keys are the long
flag names (`max-model-len: 4k`, underscores accepted too), turned into command-line words that
go before the real command line, so a flag given there wins over the file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def config_file_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags the file sets, as argv words for `parser`. ValueError names the file and key."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not YAML ({e})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of flag names to values")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}  # noqa: SLF001
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are `ladle serve` "
                             "flag names without the dashes)")
        argv += _words(flag, action, value, f"--config {path}: {key}")
    return argv


def _words(flag: str, action: argparse.Action, value: Any, where: str) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        _check_bool(value, where)
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true / store_false: the flag is there or not
        _check_bool(value, where)
        return [flag] if value else []
    if action.nargs in ("+", "*"):
        values = value if isinstance(value, list) else [value]
        return [flag, *(_text(v) for v in values)]
    return [flag, _text(value)]


def _check_bool(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: must be true or false, got {value!r}")


def _text(value: Any) -> str:
    """A YAML value as the flag's text: mappings and lists as JSON (the JSON-valued flags)."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
