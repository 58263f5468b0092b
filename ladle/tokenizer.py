"""Tokenizer loading and the facts about it the rest of ladle needs (EOS ids, vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ValueError(f"tokenizer: could not load one from {path} ({type(e).__name__}: {e})") from e


def has_tokenizer(path: str | Path) -> bool:
    """A directory with tokenizer files (a bare weights checkpoint may have none)."""
    p = Path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return not p.is_dir() or any((p / n).is_file() for n in names)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str | Path) -> list[int]:
    """generation_config.json's eos_token_id (int or list) plus the tokenizer's own EOS."""
    ids: list[int] = []
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def generation_defaults(model_path: str | Path) -> dict:
    """Sampling defaults a checkpoint publishes in generation_config.json (temperature, top_p,
    top_k, min_p, repetition_penalty) - the API layer applies them when a request omits them."""
    gen = Path(model_path) / "generation_config.json"
    if not gen.is_file():
        return {}
    with open(gen) as f:
        cfg = json.load(f)
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: cfg[k] for k in keys if k in cfg}
