"""llama.cpp's own HF -> GGUF converter for tests, and the tokenizers it needs beside a
checkpoint. The converter and its gguf-py ship in the llama-cpp-python sdist, downloaded and
unpacked into ~/.cache/ladle-bench/llama-cpp ($LLAMA_CPP_DIR) on first use, exactly as
benchmarks/build_llama_cpp.sh does (converting needs no build)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"  # as benchmarks/build_llama_cpp.sh
LLAMA2_TOKENIZER = Path("/work/shared/data/tokenizers/llama2")
SENTENCEPIECE_VOCAB_SIZE = 512
# Converted files, reused while the checkpoint's bytes are the same (a conversion takes 15-25 s,
# most of it the converter importing torch and transformers).
CACHE_DIR = Path.home() / ".cache" / "ladle-test" / "gguf"


def llama_cpp_dir() -> Path:
    return Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "ladle-bench" /
                               "llama-cpp"))


def llama_cpp_source() -> Path:
    """The llama.cpp sources of the sdist (convert_hf_to_gguf.py, gguf-py/), fetched once."""
    base = llama_cpp_dir()
    unpacked = base / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    src = unpacked / "vendor" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").is_file():
        base.mkdir(parents=True, exist_ok=True)
        sdist = base / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
        if not sdist.is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            ":all:", f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(base)],
                           check=True, capture_output=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(base, filter="data")
        link = base / "src"
        if not link.exists():
            link.symlink_to(unpacked.name)
    return src


def convert_hf_to_gguf(model_dir: Path, out_file: Path, outtype: str = "f32") -> Path:
    """Run convert_hf_to_gguf.py on `model_dir` with the sdist's own gguf-py; its stderr is in
    the error when it fails."""
    src = llama_cpp_source()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    proc = subprocess.run(
        [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
         "--outfile", str(out_file)],
        env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {model_dir} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return out_file


def convert_cached(model_dir: Path, outtype: str = "f32") -> Path:
    """convert_hf_to_gguf into CACHE_DIR, keyed by every file of `model_dir` (config, weights,
    tokenizer), the outtype and the llama.cpp version: the same checkpoint converts once."""
    digest = hashlib.sha256(f"{LLAMA_CPP_VERSION} {outtype}".encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    out = CACHE_DIR / f"{model_dir.name}-{outtype}-{digest.hexdigest()[:16]}.gguf"
    if not out.is_file():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        convert_hf_to_gguf(model_dir, tmp, outtype)
        tmp.replace(out)  # whole or absent, so a killed run never leaves half a file
    return out


def add_llama2_tokenizer(model_dir: Path) -> None:
    """The Llama 2 SentencePiece tokenizer (32,000 pieces), for a llama checkpoint."""
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(LLAMA2_TOKENIZER / name, model_dir / name)


def add_qwen_tokenizer(model_dir: Path) -> None:
    """Qwen's byte-level BPE tokenizer (ladle-demo's), for a qwen2/qwen3 checkpoint with
    vocab_size 151936; the converter recognises its pre-tokenizer by hashing its output."""
    from ladle.models.demo import ensure_demo_model

    demo = Path(ensure_demo_model())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, model_dir / name)


def add_sentencepiece_tokenizer(model_dir: Path) -> int:
    """A tiny SentencePiece model (SENTENCEPIECE_VOCAB_SIZE pieces, trained once on generated
    text and kept in CACHE_DIR), for a gemma checkpoint: the converter reads Gemma's vocabulary
    from tokenizer.model, and a real Gemma one (262,144 pieces) would make the embedding most
    of a tiny model. Returns the vocabulary size."""
    cached = CACHE_DIR / f"sentencepiece-{SENTENCEPIECE_VOCAB_SIZE}.model"
    if not cached.is_file():
        import sentencepiece as spm

        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
        lines = (" ".join("".join(rng.choices(syllables, k=rng.randint(1, 4)))
                          for _ in range(12)) for _ in range(2000))
        work = CACHE_DIR / f"sentencepiece.{os.getpid()}"
        work.mkdir()
        (work / "corpus.txt").write_text("\n".join(lines))
        spm.SentencePieceTrainer.train(
            input=str(work / "corpus.txt"), model_prefix=str(work / "tokenizer"),
            model_type="unigram", vocab_size=SENTENCEPIECE_VOCAB_SIZE, minloglevel=2,
            num_threads=1)
        (work / "tokenizer.model").replace(cached)
        shutil.rmtree(work)
    shutil.copy(cached, model_dir / "tokenizer.model")
    return SENTENCEPIECE_VOCAB_SIZE
