"""The tokenizer and chat template of a GGUF file, built from its metadata alone (llama.cpp's
`tokenizer.ggml.*` keys) into a Hugging Face fast tokenizer that encodes and decodes as the
model's own tokenizer does. A file with no chat template gets its family's template from ladle.

Two vocabularies are supported, as `tokenizer.ggml.model` names them:
- `gpt2`: byte-level BPE. The file has the merges; `tokenizer.ggml.pre` names the regex that
  splits text into words before merging (as llama.cpp's `llama-vocab.cpp` chooses it).
- `llama`: SentencePiece BPE (Llama 2, Gemma). The file has a score per piece and no merges, so
  they are derived here: every split of a piece into two pieces, best score first, which is the
  order SentencePiece merges in. Spaces are written `▁`, characters outside the vocabulary fall
  back to `<0xNN>` byte pieces, and user-defined pieces (Gemma's newlines and HTML tags) are
  matched whole before merging, as SentencePiece and llama.cpp match them.
Where Hugging Face's Gemma tokenizer and SentencePiece differ (runs of more than 31 spaces), this
follows Hugging Face; see `_sentencepiece_pieces`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE_MARKER = "\u2581"  # SentencePiece's visible space, "▁"


# --- Pre-tokenizer splits, by tokenizer.ggml.pre ------------------------------------------------
# Written as the models' tokenizer.json files write them (llama.cpp rewrites `(?i:...)` for its
# own regex engine; the meaning is the same). Several regexes are applied one after another.

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER_THEN_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
_UPPER_RUN = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?" + _UPPER_THEN_LOWER + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?" + _UPPER_RUN + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?" + _UPPER_THEN_LOWER + r"|[^\r\n\p{L}\p{N}]?" + _UPPER_RUN
           + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
# llama.cpp's split when a byte-level file names no pre-tokenizer (or "default").
_LLAMA_CPP_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How a byte-level vocabulary splits text before merging."""

    splits: tuple[str, ...]  # regexes, applied in turn; each match is its own piece
    ignore_merges: bool = False  # a word that is itself a token is not merged (Llama 3)
    nfc: bool = False  # the Hugging Face tokenizer NFC-normalizes first (Qwen)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_LLAMA3_FAMILY = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_FAMILY = PreTokenizer((_QWEN2,), nfc=True)
_GPT2_FAMILY = PreTokenizer((_GPT2,))
_STARCODER_FAMILY = PreTokenizer((r"\p{N}", _GPT2))
_GPT4O_FAMILY = PreTokenizer((_GPT4O,))
_DEEPSEEK3_FAMILY = PreTokenizer(_DEEPSEEK3)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_LLAMA_CPP_DEFAULT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), _LLAMA3_FAMILY),
    "dbrx": PreTokenizer((_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    "qwen2": _QWEN2_FAMILY,
    "megrez": _QWEN2_FAMILY,
    # Qwen's split, from tokenizers that dropped Qwen's NFC normalizer.
    **dict.fromkeys(("deepseek-r1-qwen", "stablelm2", "kormo", "f2llmv2"),
                    PreTokenizer((_QWEN2,))),
    "qwen35": PreTokenizer((_QWEN35,)),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
                     "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat", "a.x-4.0", "mpt",
                     "olmo", "exaone4", "mellum", "modern-bert"), _GPT2_FAMILY),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b"), _STARCODER_FAMILY),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_FAMILY),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm"), _DEEPSEEK3_FAMILY),
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER),
    "falcon": PreTokenizer(_FALCON),
}


# --- Chat templates ------------------------------------------------------------------------------

# general.architecture -> ladle's template for files that carry none.
FAMILY_TEMPLATES = {"gemma": "gemma.jinja", "gemma2": "gemma.jinja", "gemma3": "gemma.jinja"}


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    text: str  # the Jinja source
    is_fallback: bool  # the file had no tokenizer.chat_template; this is ladle's for the family
    source: str  # where the text came from, for a log line


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    tokenizer: PreTrainedTokenizerFast  # its chat_template is set when `chat_template` is not None
    chat_template: ChatTemplate | None  # None: neither the file nor ladle has one for this family


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer and chat template of the GGUF file at `path` (its metadata is read once)."""
    metadata = read_tokenizer_metadata(path)
    tokenizer = tokenizer_from_metadata(metadata, path)
    template = chat_template_from_metadata(metadata, path)
    if template is not None:
        tokenizer.chat_template = template.text
    return GGUFTokenizer(tokenizer, template)


def tokenizer_from_gguf(path: str | Path) -> PreTrainedTokenizerFast:
    """The file's tokenizer, with its chat template (or the family's) set on it."""
    return load_gguf_tokenizer(path).tokenizer


def chat_template_from_gguf(path: str | Path) -> ChatTemplate | None:
    """`tokenizer.chat_template` from the file, else ladle's template for its architecture."""
    return chat_template_from_metadata(read_tokenizer_metadata(path), path)


def chat_template_from_metadata(metadata: Mapping[str, Any],
                                path: str | Path) -> ChatTemplate | None:
    text = metadata.get("tokenizer.chat_template")
    if text is not None:
        if not isinstance(text, str):
            raise _load_error(f"{path}: tokenizer.chat_template is {type(text).__name__}, "
                              "not a string")
        return ChatTemplate(text, is_fallback=False, source=f"{path} (tokenizer.chat_template)")
    name = FAMILY_TEMPLATES.get(metadata.get("general.architecture"))
    if name is None:
        return None
    text = (resources.files("ladle.models") / "templates" / name).read_text("utf-8")
    return ChatTemplate(text, is_fallback=True, source=f"ladle/models/templates/{name}")


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """`general.architecture`, `{arch}.context_length` and every `tokenizer.*` key, as plain
    Python values, from ladle's GGUF reader (the header only; tensors stay where they are)."""
    from ladle.models.gguf import read_metadata

    metadata = read_metadata(path)
    wanted = ("general.architecture", f"{metadata.get('general.architecture')}.context_length")
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.") or k in wanted}


# Texts of tokens that end a turn, which llama.cpp also stops at (a GGUF file has no
# generation_config.json to list them; Gemma's says EOS is <eos> but a turn ends <end_of_turn>).
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>")


def end_of_generation_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The ids generation stops at, as llama.cpp finds them: EOS first, then the file's EOT and
    EOM tokens and the control tokens whose text is a known end of turn (END_OF_TURN_TEXTS)."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or [CONTROL] * len(tokens)
    ids = [metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    ids += [i for i, (text, kind) in enumerate(zip(tokens, types, strict=False))
            if kind == CONTROL and text in END_OF_TURN_TEXTS]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and 0 <= i < len(tokens)))


# --- Building the tokenizer -----------------------------------------------------------------------


@dataclass(slots=True)
class _Vocab:
    """The tokenizer.ggml.* keys, checked."""

    model: str
    tokens: list[str]
    scores: list[float] | None
    token_types: list[int]
    merges: list[str] | None
    pre: str
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


def tokenizer_from_metadata(metadata: Mapping[str, Any],
                            path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF file's metadata describes (`path` is only named in errors). The
    metadata maps key -> str, int, float, bool or a list of them, as GGUF readers return it."""
    vocab = _read_vocab(metadata, path)
    if vocab.model == "llama":
        backend = _sentencepiece_backend(vocab)
    else:
        backend = _byte_level_backend(vocab, path)
    _add_whole_tokens(backend, vocab)

    def text_of(token_id: int | None) -> str | None:
        return None if token_id is None else vocab.tokens[token_id]

    max_length = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    extra = {"model_max_length": max_length} if isinstance(max_length, int) else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=text_of(vocab.bos_id),
        eos_token=text_of(vocab.eos_id),
        unk_token=text_of(vocab.unk_id),
        pad_token=text_of(vocab.pad_id),
        # These two make transformers write the post-processor that adds BOS / EOS.
        add_bos_token=vocab.add_bos and vocab.bos_id is not None,
        add_eos_token=vocab.add_eos and vocab.eos_id is not None,
        clean_up_tokenization_spaces=False,
        **extra,
    )


def _read_vocab(metadata: Mapping[str, Any], path: str | Path) -> _Vocab:
    def error(key: str, problem: str) -> Exception:
        return _load_error(f"{path}: {key} {problem}")

    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise error("tokenizer.ggml.model", "is missing: the file describes no tokenizer")
    if model not in ("llama", "gpt2"):
        raise error("tokenizer.ggml.model", f"is {model!r}; supported: 'llama' (SentencePiece) "
                    "and 'gpt2' (byte-level BPE)")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise error("tokenizer.ggml.tokens", "is missing or not a list of strings")
    num_tokens = len(tokens)
    # llama.cpp names an empty token so that every token has a distinct text.
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    def number_list(key: str, kinds: tuple[type, ...], what: str) -> list | None:
        values = metadata.get(key)
        if values is None:
            return None
        if (not isinstance(values, list) or len(values) != num_tokens
                or not all(isinstance(v, kinds) and not isinstance(v, bool) for v in values)):
            raise error(key, f"must be a list of {num_tokens} {what}, one per token")
        return values

    scores = number_list("tokenizer.ggml.scores", (int, float), "numbers")
    if scores is not None and not all(math.isfinite(s) for s in scores):
        raise error("tokenizer.ggml.scores", "holds a NaN or infinite score")
    token_types = (number_list("tokenizer.ggml.token_type", (int,), "integers")
                   or [NORMAL] * num_tokens)
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list)
                               or not all(isinstance(m, str) for m in merges)):
        raise error("tokenizer.ggml.merges", "is not a list of strings")
    if model == "gpt2" and not merges:
        raise error("tokenizer.ggml.merges", "is missing: a 'gpt2' vocabulary needs its merges")
    if model == "llama" and scores is None:
        raise error("tokenizer.ggml.scores", "is missing: a 'llama' vocabulary needs its scores")

    pre = metadata.get("tokenizer.ggml.pre") or "default"
    if not isinstance(pre, str):
        raise error("tokenizer.ggml.pre", f"is {pre!r}, not a string")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise error("tokenizer.ggml.pre", f"is {pre!r}, which ladle does not know; supported: "
                    f"{', '.join(sorted(PRE_TOKENIZERS))}")

    # llama.cpp's defaults for a key the file leaves out.
    spm = model == "llama"
    defaults = {"bos": 1, "eos": 2, "unknown": 0} if spm else {}

    def token_id(name: str) -> int | None:
        key = f"tokenizer.ggml.{name}_token_id"
        value = metadata.get(key, defaults.get(name))
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < num_tokens:
            raise error(key, f"is {value!r}, not a token id (the vocabulary has {num_tokens})")
        return value

    def flag(name: str, default: bool) -> bool:
        key = f"tokenizer.ggml.{name}"
        value = metadata.get(key, default)
        if not isinstance(value, bool):
            raise error(key, f"is {value!r}, not true or false")
        return value

    return _Vocab(
        model=model, tokens=tokens, scores=scores, token_types=token_types, merges=merges,
        pre=pre, bos_id=token_id("bos"), eos_id=token_id("eos"), unk_id=token_id("unknown"),
        pad_id=token_id("padding"),
        add_bos=flag("add_bos_token", spm or PRE_TOKENIZERS[pre].add_bos),
        add_eos=flag("add_eos_token", False),
        add_space_prefix=flag("add_space_prefix", spm),
    )


def _is_whole(vocab: _Vocab, token_id: int) -> bool:
    """Matched as a whole in the text before any splitting: control and unknown tokens (as
    special tokens) and user-defined ones (as plain added tokens, like Qwen's `<think>`), except
    SentencePiece's user-defined runs of spaces (see `_sentencepiece_pieces`)."""
    kind = vocab.token_types[token_id]
    if kind == USER_DEFINED and vocab.model == "llama":
        return " " not in vocab.tokens[token_id]
    return kind in (UNKNOWN, CONTROL, USER_DEFINED)


def _add_whole_tokens(backend: Tokenizer, vocab: _Vocab) -> None:
    """Added tokens keep their ids because each text is in the model's vocabulary already."""
    special, plain = [], []
    for i, text in enumerate(vocab.tokens):
        if _is_whole(vocab, i):
            is_special = vocab.token_types[i] != USER_DEFINED
            (special if is_special else plain).append(
                AddedToken(text, special=is_special, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _sentencepiece_pieces(vocab: _Vocab) -> list[str]:
    """The vocabulary as SentencePiece spells it. llama.cpp's converter writes user-defined
    pieces with real spaces (Gemma's runs of 2 to 31 spaces, "▁▁" in the model) so that it can
    match them in raw text; Hugging Face's Gemma tokenizer reaches them by merging `▁`s instead,
    which differs from matching the longest run only for runs of more than 31 spaces."""
    pieces = list(vocab.tokens)
    taken = set(pieces)
    for i, text in enumerate(pieces):
        if vocab.token_types[i] == USER_DEFINED and " " in text:
            spelled = text.replace(" ", SPACE_MARKER)
            if spelled not in taken:
                pieces[i] = spelled
    return pieces


def _sentencepiece_backend(vocab: _Vocab) -> Tokenizer:
    """SentencePiece BPE as a `tokenizers` BPE: merges derived from the scores (see
    `sentencepiece_merges`), spaces as `▁`, byte fallback when the vocabulary has byte pieces."""
    pieces = _sentencepiece_pieces(vocab)
    has_bytes = any(t == BYTE for t in vocab.token_types)
    backend = Tokenizer(models.BPE(
        vocab={text: i for i, text in enumerate(pieces)},
        merges=sentencepiece_merges(pieces, vocab.scores, vocab.token_types),
        unk_token=None if vocab.unk_id is None else vocab.tokens[vocab.unk_id],
        fuse_unk=True,
        byte_fallback=has_bytes,
    ))
    spaces = [normalizers.Replace(" ", SPACE_MARKER)]
    if vocab.add_space_prefix:
        # SentencePiece's dummy prefix: every stretch of text between whole tokens starts with a
        # space, even one that already starts with a space (llama.cpp does the same).
        spaces.insert(0, normalizers.Prepend(SPACE_MARKER))
    backend.normalizer = normalizers.Sequence(spaces)
    steps = [decoders.Replace(SPACE_MARKER, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def sentencepiece_merges(pieces: list[str], scores: list[float],
                         token_types: list[int]) -> list[tuple[str, str]]:
    """The merges that reproduce SentencePiece's BPE over these pieces.

    SentencePiece starts from characters and keeps joining the adjacent pair whose join is the
    normal piece with the best score (the leftmost pair on a tie); user-defined pieces are taken
    whole before that. As a merge list: every split of a normal or user-defined piece into two
    such pieces, user-defined pieces first (in file order), then normal ones by score, then id;
    of two splits of one piece, the one with the longer left part first (as Hugging Face's own
    conversion orders them).
    """
    mergeable = {text for text, kind in zip(pieces, token_types, strict=True)
                 if kind in (NORMAL, USER_DEFINED)}
    ranked = []
    for token_id, (text, score, kind) in enumerate(zip(pieces, scores, token_types, strict=True)):
        if kind not in (NORMAL, USER_DEFINED):
            continue
        rank = (0, 0.0) if kind == USER_DEFINED else (1, -score)
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((*rank, token_id, -cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _byte_level_backend(vocab: _Vocab, path: str | Path) -> Tokenizer:
    """Byte-level BPE: the file's vocabulary and merges, the split regex its pre-tokenizer names.
    Normal tokens are spelled in GPT-2's byte alphabet; whole tokens are stored as plain text."""
    pre = PRE_TOKENIZERS[vocab.pre]
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    merges = []
    for i, merge in enumerate(vocab.merges or ()):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise _load_error(f"{path}: tokenizer.ggml.merges[{i}] is {merge!r}, not two tokens "
                              "separated by a space")
        left, right = merge[:cut], merge[cut + 1:]
        # llama.cpp keeps a merge of unknown tokens but can never use it; tokenizers refuses it.
        if left in ids and right in ids and left + right in ids:
            merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _load_error(message: str) -> Exception:
    # Imported here: the loader imports this module.
    from ladle.models.loader import ModelLoadError

    return ModelLoadError(message)


__all__ = [
    "ChatTemplate",
    "GGUFTokenizer",
    "PRE_TOKENIZERS",
    "chat_template_from_gguf",
    "chat_template_from_metadata",
    "end_of_generation_ids",
    "load_gguf_tokenizer",
    "read_tokenizer_metadata",
    "sentencepiece_merges",
    "tokenizer_from_gguf",
    "tokenizer_from_metadata",
]
