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


# The files a checkpoint's vocabulary can come from, the one transformers prefers first.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
TOKENIZER_FILES = (*VOCABULARY_FILES, "tokenizer_config.json")


def has_tokenizer(path: str | Path) -> bool:
    """A directory with tokenizer files (a bare weights checkpoint may have none)."""
    p = Path(path)
    return not p.is_dir() or any((p / n).is_file() for n in TOKENIZER_FILES)


def load_served_tokenizer(tokenizer: str | None, model_path: str | Path
                          ) -> PreTrainedTokenizerBase:
    """The server's tokenizer: --tokenizer (`tokenizer`), else the checkpoint's own, checked
    against the model before anything is served (`check_tokenizer`). The checkpoint's own
    tokenizer must pass: a missing or wrong file is a ModelLoadError naming it (transformers
    would otherwise build a tokenizer of a few tokens from what is left, and the server would
    serve garbage). An explicit --tokenizer that does not fit is the operator's choice (tests
    pair tiny random models with a real tokenizer): a warning."""
    from ladle.models.loader import ModelLoadError, read_hf_config

    path = tokenizer or model_path
    if tokenizer is None and not has_tokenizer(path):
        raise ModelLoadError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy "
                             "the checkpoint's tokenizer files there, or pass --tokenizer DIR")
    loaded = load_tokenizer(path)
    try:
        check_tokenizer(loaded, path, read_hf_config(Path(model_path)), model_path)
    except ModelLoadError as e:
        if tokenizer is None:
            raise
        logger.warning("--tokenizer %s: %s", tokenizer, e)
    return loaded


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, path: str | Path, hf_config: dict,
                    model_path: str | Path) -> None:
    """The tokenizer loaded from `path` fits the model: it has every special and EOS id that
    config.json and generation_config.json name, no id at or past vocab_size, and more than
    half of vocab_size ids (a vocabulary padded past the tokenizer's ids is fine). ModelLoadError
    names the tokenizer file at fault."""
    from ladle.models.loader import ModelLoadError

    num_ids = max(tokenizer.get_vocab().values(), default=-1) + 1
    vocab_size = hf_config.get("vocab_size")
    config_file = Path(model_path) if Path(model_path).is_file() else \
        Path(model_path) / "config.json"
    problems = []
    if isinstance(vocab_size, int) and num_ids > vocab_size:
        problems.append(f"it has ids up to {num_ids - 1}, past the model's vocab_size "
                        f"{vocab_size} ({config_file})")
    elif isinstance(vocab_size, int) and num_ids < vocab_size // 2:
        # Padding rounds the embedding up by a few hundred rows (Qwen3: 151,669 ids in
        # 151,936); a tokenizer with half the rows or fewer is another model's, or what
        # transformers builds from tokenizer_config.json alone (its special tokens).
        problems.append(f"it has {num_ids} ids, far fewer than the model's vocab_size "
                        f"{vocab_size} ({config_file})")
    for where, key, token_id in _model_special_ids(hf_config, model_path, config_file):
        if token_id >= num_ids:
            problems.append(f"it has no id {token_id}, the model's {key} ({where})")
    if problems:
        raise ModelLoadError(f"{_vocabulary_source(path, num_ids)}: {'; '.join(problems[:3])}. "
                             "Accepted: the tokenizer files the model was trained with (or "
                             "--tokenizer DIR)")


def _model_special_ids(hf_config: dict, model_path: str | Path, config_file: Path):
    """(file, key, id) for each special token id the model's files name."""
    sources = [(config_file, hf_config)]
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        with open(gen) as f:
            sources.append((gen, json.load(f)))
    for where, cfg in sources:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = cfg.get(key)
            for token_id in value if isinstance(value, list) else [value]:
                if isinstance(token_id, int) and token_id >= 0:
                    yield where, key, token_id


def _vocabulary_source(path: str | Path, num_ids: int) -> str:
    """Where a tokenizer that does not fit got its vocabulary, for the error: the first of
    VOCABULARY_FILES present, else tokenizer.json, named as missing."""
    p = Path(path)
    if p.is_file():
        return f"{p}: the tokenizer in its tokenizer.ggml.* metadata does not fit the model"
    if not p.is_dir():
        return f"tokenizer {path}: does not fit the model"
    for name in VOCABULARY_FILES:
        if (p / name).is_file():
            return f"{p / name}: the tokenizer does not fit the model"
    return (f"{p / 'tokenizer.json'}: missing (nor is there a {' or '.join(VOCABULARY_FILES[1:])}"
            f"), and the tokenizer built without it has {num_ids} token(s)")


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
