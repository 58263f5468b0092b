"""Tokenizer loading and the facts about it the rest of ladle needs (EOS ids, vocabulary)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """From a checkpoint or tokenizer directory, or built from a GGUF file's metadata (with the
    file's chat template, else ladle's for the model's family, logged)."""
    if Path(path).is_file():
        from ladle.models.gguf_tokenizer import load_gguf_tokenizer

        loaded = load_gguf_tokenizer(Path(path))
        if loaded.chat_template is not None and loaded.chat_template.is_fallback:
            logger.info("%s has no tokenizer.chat_template: using %s (--chat-template FILE "
                        "overrides it)", path, loaded.chat_template.source)
        return loaded.tokenizer
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
    if Path(model_path).is_file():  # a GGUF file: no generation_config.json, but end-of-turn
        from ladle.models.gguf_tokenizer import end_of_generation_ids, read_tokenizer_metadata

        ids += [i for i in end_of_generation_ids(read_tokenizer_metadata(model_path))
                if i not in ids]
    return ids


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_path: str | Path, source: str = "auto",
                        overrides: dict | None = None) -> dict:
    """Sampling defaults for requests that omit them (the API layer applies them), as vLLM's
    --generation-config / --override-generation-config choose them: `source` "auto" reads the
    checkpoint's generation_config.json, "vllm" reads none (ladle's own defaults), a directory
    reads that directory's; `overrides` go on top. ValueError names the flag at fault."""
    if source == "vllm":
        cfg: dict = {}
    else:
        folder = Path(model_path) if source == "auto" else Path(source)
        if source != "auto" and not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config: {source!r} is not auto, vllm, or a directory "
                             "with a generation_config.json")
        gen = folder / "generation_config.json"
        cfg = json.loads(gen.read_text()) if gen.is_file() else {}
    defaults = {k: cfg[k] for k in GENERATION_KEYS if k in cfg}
    unknown = sorted(set(overrides or {}) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unsupported key(s) {', '.join(unknown)}; "
                         f"accepted: {', '.join(GENERATION_KEYS)}")
    return defaults | dict(overrides or {})
