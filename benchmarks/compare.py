"""ladle against llama.cpp and transformers on the same checkpoints, GGUF files and requests, in
one table of ratios per model.

Models (--models, any subset, in this order by default):
  - gemma: the real Gemma 3 270M Q4_K_M file that ladle ships (`ladle serve gemma-3-270m`), run
    by ladle and llama.cpp from that same file; gemma-q5_k_m, gemma-iq4_xs: that file requantized
    to Q5_K_M or IQ4_XS by llama.cpp's quantize API (allow_requantize; its 640-value rows get the
    fallbacks Q5_1 and IQ4_NL);
  - 0.6b-q8_0, 0.6b-q4_k_m, 0.6b-q5_k_m, 0.6b-q3_k_m, 0.6b-q2_k, 0.6b-iq4_xs, 0.6b-iq3_m,
    0.6b-iq3_xxs, 0.6b-iq2_m, 0.6b-iq2_xs, 0.6b-iq2_xxs: the random Qwen3-0.6B-shaped
    checkpoint converted to a bf16 GGUF by llama.cpp's own converter, then quantized by
    llama.cpp's quantize API (llama-cpp-python's `llama_model_quantize`, its default tensor-type
    mix for the type; the i-quants of 2-3 bits, most of which need an importance matrix, by its
    llama-quantize tool with a uniform one); ladle and llama.cpp both load the quantized file
    (ladle's default for a .gguf: --quantization gguf, the blocks kept; the i-quants' in blocks
    of 32);
  - 0.6b: that checkpoint in bfloat16 (ladle and transformers load the safetensors, llama.cpp
    its bf16 conversion), plus a `ladle int8` column: ladle with --quantization int8 (W8A8) on
    the same bf16 checkpoint (shown "n/a" while this ladle does not accept int8);
  - tiny: a tiny Qwen3 (hidden 128, 4 layers, Qwen's 152k vocabulary) in float32, where framework
    overhead dominates.
The random checkpoints carry Qwen's tokenizer, so llama.cpp's HF -> GGUF converter (shipped in
the llama-cpp-python sdist that benchmarks/build_llama_cpp.sh builds) converts them; every file
is made once, beside its checkpoint in the ladle cache directory (~/.cache/ladle,
$LADLE_CACHE_DIR): model-bf16.gguf, model-q8_0.gguf, model-q4_k_m.gguf, model-q5_k_m.gguf,
model-q3_k_m.gguf, model-q2_k.gguf, model-iq4_xs.gguf, model-iq3_m.gguf, model-iq3_xxs.gguf,
model-iq2_m.gguf, model-iq2_xs.gguf, model-iq2_xxs.gguf, model-f32.gguf.
Cases:
  - single-stream decode tok/s and TTFT of a 128-token prompt, every model (in process: ladle's
    LLM, transformers' generate, llama-cpp-python's Llama);
  - 32 x (128 in, 128 out) output tok/s (ladle's LLM, transformers' generate on the batch of 32,
    llama.cpp's llama-server with 32 parallel slots): 0.6b-q8_0, 0.6b, tiny;
  - server to server, 8 streaming clients each sending 128-token prompts for 64 tokens:
    aggregate tok/s, median/p90 TTFT and median inter-token latency (`ladle serve` against
    llama-server with 8 parallel slots, the same GGUF file for 0.6b-q8_0): 0.6b-q8_0, 0.6b, tiny.
Each system runs in its own process, and the systems are interleaved within every repetition
(reported: the median over repetitions), since this machine's speed drifts with other load.
After the repetitions, the single-stream decode runs again in alternating turns
(--decode-turns, default 10): every system's worker holds its model loaded and idle while the
others decode, each turn decodes once per system seconds apart (the order reversed every other
turn, a new prompt per turn, of --decode-context tokens; each decode timed inside its worker
from the first token to the last), and the decode ratios are the medians of the per-turn ratios
(each decode's share of the read bandwidth: the median over the turns, each measured beside its
turn). A repetition's systems are minutes apart, and this machine's read bandwidth moved by half
between minutes (29-47 GB/s on one Zen 4), which moved those ratios by 20-40% from run to run;
within a turn they still moved 10-40% on that machine (two runs of 6 turns: Q8_0 decode medians
1.33x and 1.18x), so one run's decode ratio is good to about a tenth. Each turn also times
every system's first token of a new 128-token prompt, and the TTFT ratios within one model
(ladle against llama.cpp, int8 against bf16) are the medians of those per-turn ratios too.

Physical limits, measured in the same run: the read bandwidth (max of a 1 GiB array) and the
matmul peaks in bf16, f32 and int8. The bf16 and f32 peaks are the faster of torch's matmul and
ladle's own linear kernel (torch's bf16 GEMM has no fast path on an AVX2-only CPU, 1 GFLOP/s
measured there). The int8 peak is the faster of torch._int_mm (int8 x int8 ->
int32) and fbgemm's dynamic int8 linear (torch.ao.nn.quantized.dynamic.Linear, activations
quantized per call, VNNI where the CPU has it); either may be missing or run a slow reference
path on a given build, so the method that gave the number is printed beside it. Every
single-stream decode cell gets a share of the read bandwidth: bytes of weights read per token x
tok/s / bandwidth (measured again right before and after each decode, with the same method in
every system's process: on a shared machine it drifts by half between minutes), where the bytes
per token are
  - for a GGUF file, its tensor bytes (token_embd counted once when it is also the output head,
    left out when an output.weight exists, since the lookup reads one row);
  - for a safetensors checkpoint, 2 (bf16) or 4 (f32) bytes x every matmul weight (the head once);
  - for `ladle int8`, 1 byte x every matmul weight, the head included, plus a float32 scale
    per output row.
The alternating turns also print each share with the KV cache a step reads at its mean context
(keys and values of every layer, a sliding layer's window at most; ladle's cache in --dtype,
llama.cpp's f16): 18 MB a step for the 0.6B at the default 160 tokens, 1.5% of its weights,
but a fifth of them at --decode-context 2048. The targets keep the weight bytes alone.
TTFT (the prefill's matmuls: the head once), batched and server rows give ladle's share of the
matmul peak of its arithmetic (int8 for a quantized GGUF file). The end of the run prints issue
21's targets beside this run's numbers (ratios across tables come from separate, not
interleaved, runs).

    nice -n 19 benchmarks/build_llama_cpp.sh          # once, many minutes
    python benchmarks/compare.py [--reps 3]
        [--models gemma,gemma-q5_k_m,0.6b-q8_0,0.6b-q4_k_m,0.6b-q5_k_m,0.6b-q3_k_m,0.6b,tiny,...]
        [--skip-batch] [--skip-server] [--skip-hf] [--skip-llama] [--skip-int8]
        [--decode-turns 10] [--decode-tokens 64] [--decode-context 128]
        [--batch-out 128] [--server-out 64]
                                                          # smaller: quick checks only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache/ladle-bench/llama-cpp"))
PROMPT_LEN, DECODE_TOKENS, BATCH, BATCH_OUT = 128, 64, 32, 128
# The paired decode turns' prompt length (--decode-context): the context a single-stream
# decode starts from, where attention's share of a step grows with it.
DECODE_CONTEXT = PROMPT_LEN
SERVER_CLIENTS, SERVER_OUT, SERVER_ROUNDS = 8, 64, 2


def max_context() -> int:
    """Every system's context window for this run's requests."""
    return max(512, DECODE_CONTEXT + DECODE_TOKENS + 16)

TINY_QWEN3 = dict(
    vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def cache_root() -> Path:
    return Path(os.environ.get("LADLE_CACHE_DIR", Path.home() / ".cache" / "ladle"))


def random_checkpoint(name: str, make_model, max_position_embeddings: int) -> Path:
    """A random-weight checkpoint with Qwen's tokenizer, built once into the cache directory:
    make_model() (seeded here) gives the transformers model, saved as it is."""
    path = cache_root() / name
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return path
    import torch

    from ladle.models.qwen_tokenizer import write_qwen_tokenizer

    torch.manual_seed(0)
    model = make_model()
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    write_qwen_tokenizer(tmp, max_position_embeddings)
    tmp.rename(path)
    return path


def tiny_checkpoint() -> Path:
    def make():
        import transformers as tf

        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY_QWEN3, torch_dtype="float32"))

    return random_checkpoint("qwen3-tiny-random-f32", make,
                             TINY_QWEN3["max_position_embeddings"])


@dataclass(frozen=True)
class Spec:
    source: str  # the weights: "0.6b" or "tiny" (random checkpoints), "gemma" (packaged file)
    dtype: str  # ladle's --dtype (activations, KV cache) and transformers' dtype
    # The GGUF file llama.cpp runs: a converter outtype ("bf16", "f32"), a type made from the bf16
    # conversion by llama.cpp's quantize (a key of QUANT_FTYPES or IMATRIX_FTYPES), or
    # "packaged" (as shipped).
    gguf: str
    ladle_on_gguf: bool  # ladle loads that .gguf file too (else the safetensors checkpoint)
    cases: tuple[str, ...]  # of "single", "batch", "server"
    hf: bool = False  # a transformers column (safetensors checkpoints only)
    int8: bool = False  # a `ladle int8` column: --quantization int8 on the checkpoint


MODELS = {
    "gemma": Spec("gemma", "bfloat16", "packaged", True, ("single",)),
    "gemma-q5_k_m": Spec("gemma", "bfloat16", "q5_k_m", True, ("single",)),
    "gemma-iq4_xs": Spec("gemma", "bfloat16", "iq4_xs", True, ("single",)),
    "0.6b-q8_0": Spec("0.6b", "bfloat16", "q8_0", True, ("single", "batch", "server")),
    "0.6b-q4_k_m": Spec("0.6b", "bfloat16", "q4_k_m", True, ("single",)),
    "0.6b-q5_k_m": Spec("0.6b", "bfloat16", "q5_k_m", True, ("single",)),
    "0.6b-q3_k_m": Spec("0.6b", "bfloat16", "q3_k_m", True, ("single",)),
    "0.6b-q2_k": Spec("0.6b", "bfloat16", "q2_k", True, ("single",)),
    "0.6b-iq4_xs": Spec("0.6b", "bfloat16", "iq4_xs", True, ("single",)),
    "0.6b-iq3_m": Spec("0.6b", "bfloat16", "iq3_m", True, ("single",)),
    "0.6b-iq3_xxs": Spec("0.6b", "bfloat16", "iq3_xxs", True, ("single",)),
    "0.6b-iq2_m": Spec("0.6b", "bfloat16", "iq2_m", True, ("single",)),
    "0.6b-iq2_xs": Spec("0.6b", "bfloat16", "iq2_xs", True, ("single",)),
    "0.6b-iq2_xxs": Spec("0.6b", "bfloat16", "iq2_xxs", True, ("single",)),
    "0.6b": Spec("0.6b", "bfloat16", "bf16", False, ("single", "batch", "server"), hf=True,
                 int8=True),
    "tiny": Spec("tiny", "float32", "f32", False, ("single", "batch", "server"), hf=True),
}
# llama.cpp's quantize API: our file-name suffix -> llama_cpp's llama_ftype constant.
QUANT_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
                "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K", "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}
# Types llama.cpp quantizes only with an importance matrix (its quantize refuses them without
# one, IQ3_XXS for the IQ2_S it gives attn_k, and the API takes it as a C++ map; IQ3_M, which
# needs none, made the same way): made by its
# llama-quantize tool (built beside llama-server) with a uniform matrix, every column weighted
# alike, which is all a random checkpoint has to say; its type names.
IMATRIX_FTYPES = {"iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS", "iq2_m": "IQ2_M",
                  "iq3_xxs": "IQ3_XXS", "iq3_m": "IQ3_M"}
PACKAGED_GEMMA = "gemma-3-270m"


def checkpoint(source: str) -> Path:
    """The safetensors directory of a random checkpoint, or the packaged GGUF file."""
    if source == "0.6b":
        sys.path.insert(0, str(HERE))
        from throughput import qwen3_06b_checkpoint

        return qwen3_06b_checkpoint()
    if source == "gemma":
        from ladle.models.packaged import ensure_packaged_model

        return ensure_packaged_model(PACKAGED_GEMMA)
    return tiny_checkpoint()


def gguf(path: Path, outtype: str) -> Path:
    """Converted by the converter shipped with the llama.cpp sources that were built."""
    out = path / f"model-{outtype}.gguf"
    if out.exists():
        return out
    src = LLAMA_DIR / "src" / "vendor" / "llama.cpp"
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(path), "--outtype",
                    outtype, "--outfile", str(out) + ".tmp"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.rename(str(out) + ".tmp", out)
    return out


def quantized_gguf(path: Path, qtype: str, llama_py: Path) -> Path:
    """The bf16 conversion of checkpoint `path` (a GGUF file: that file itself, requantized),
    quantized to `qtype` by llama.cpp's quantize API (in llama-cpp-python's environment); made
    once, beside the checkpoint or file."""
    out = (path.with_name(f"{path.stem}-requantized-{qtype}.gguf") if path.is_file()
           else path / f"model-{qtype}.gguf")
    if out.exists():
        return out
    src = path if path.is_file() else gguf(path, "bf16")
    tmp = out.with_name(out.name + ".tmp")
    if qtype in IMATRIX_FTYPES:
        imatrix = uniform_imatrix(src, out.with_name(out.name + ".imatrix"))
        tool = LLAMA_DIR / "server-build" / "bin" / "llama-quantize"
        res = subprocess.run([str(tool), "--allow-requantize", "--imatrix", str(imatrix), str(src),
                              str(tmp), IMATRIX_FTYPES[qtype]], capture_output=True, text=True)
    else:
        res = subprocess.run([str(llama_py), str(Path(__file__).resolve()), "--worker",
                              "quantize", str(src), str(tmp), QUANT_FTYPES[qtype]],
                             capture_output=True, text=True)
    if res.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {src} -> {qtype} failed: {res.stderr[-1500:]}")
    os.rename(tmp, out)
    return out


def uniform_imatrix(src: Path, out: Path) -> Path:
    """An importance matrix of ones for every 2-d weight of the blocks in `src` and every
    stacked experts' weight (3-d: a row's columns per expert, experts after each other), in
    llama.cpp's legacy imatrix file layout (int32 count; per entry int32 name length, the name,
    int32 calls, int32 values, float32 values; then int32 last chunk and int32 dataset name
    length 0)."""
    import struct

    from gguf import GGUFReader

    entries = [(t.name, int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) == 3 else 1))
               for t in GGUFReader(src).tensors
               if t.name.startswith("blk.") and t.name.endswith(".weight")
               and len(t.shape) in (2, 3)]
    with open(out, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, cols in entries:
            f.write(struct.pack("<i", len(name)) + name.encode())
            f.write(struct.pack("<ii", 1, cols) + struct.pack(f"<{cols}f", *([1.0] * cols)))
        f.write(struct.pack("<ii", 1, 0))
    return out


def worker_quantize(src: str, dst: str, ftype: str) -> dict:
    """llama.cpp's quantize (what its llama-quantize tool runs), default tensor-type mix; a
    quantized source is requantized (llama-quantize --allow-requantize)."""
    import ctypes

    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"bytes": os.path.getsize(dst)}


def prompts(n: int, length: int = PROMPT_LEN, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 100000) for _ in range(length)] for _ in range(n)]


@dataclass(frozen=True)
class SinglePrompts:
    """The single-stream prompts, none of them in the batch: each TTFT repetition and the decode
    run get a prompt of their own, so no system answers from a cached prefix (ladle's prefix
    cache would otherwise serve a repeated prompt without a prefill)."""

    warm_up: list[int]
    ttft: list[list[int]]
    decode: list[int]


def single_prompts() -> SinglePrompts:
    p = prompts(5, seed=2)  # seed 1: the server prompts
    return SinglePrompts(warm_up=p[0][:16], ttft=p[1:4], decode=p[4])


# --- Workers: one system, one model, one process; print one JSON line. ----------------------

def worker_ladle(path, dtype, cases, quantization=None):
    """quantization: ladle's `quantization` (None: the checkpoint's own, i.e. gguf for a .gguf
    file). A value this ladle does not accept gives {"unavailable": reason}, not a failure."""
    from ladle import LLM, SamplingParams

    kw = {} if quantization is None else {"quantization": quantization}
    try:
        llm = LLM(str(path), dtype=dtype, max_num_seqs=BATCH, max_model_len=max_context(),
                  max_num_batched_tokens=2048, kv_cache_memory="2GiB", **kw)
    except (ValueError, TypeError) as e:  # EngineConfig's check; ModelLoadError is a ValueError
        if quantization is not None and "quantization" in str(e):
            return {"unavailable": f"{quantization} unavailable: {str(e)[:200]}"}
        raise
    p, single = prompts(BATCH), single_prompts()

    def run(ps, n):
        return llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    run([single.warm_up], 4)
    if "paired" in cases:
        ends = []  # each engine step's end
        step = llm.engine.step

        def timed_step():
            out = step()
            ends.append(time.perf_counter())
            return out

        llm.engine.step = timed_step

        def timed(q, n):  # one token per step after the first: the last n steps decode
            ends.clear()
            got = len(run([q], n)[0].outputs[0].token_ids)
            return got, ends[-1] - ends[-got]

        return decode_turns(timed, lambda q: run([q], 1))
    out = {}
    if "single" in cases:
        ttft = _median_over(lambda q: run([q], 1), single.ttft)

        def decode():
            t = time.perf_counter()
            run([single.decode], DECODE_TOKENS + 1)
            return decode_rate(DECODE_TOKENS, time.perf_counter() - t, ttft)

        out["ttft_ms"] = ttft * 1e3
        out.update(decode_beside_bandwidth(decode))
    if "batch" in cases:
        t = time.perf_counter()
        res = run(p, BATCH_OUT)
        n = sum(len(r.outputs[0].token_ids) for r in res)
        out["batch_tps"] = n / (time.perf_counter() - t)
    return out


def worker_hf(path, dtype, cases):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    p, single = prompts(BATCH), single_prompts()

    @torch.inference_mode()
    def run(ps, n):
        ids = torch.tensor(ps)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)

    run([single.warm_up], 4)
    out = {}
    if "single" in cases:
        ttft = _median_over(lambda q: run([q], 1), single.ttft)

        def decode():
            t = time.perf_counter()
            run([single.decode], DECODE_TOKENS + 1)
            return decode_rate(DECODE_TOKENS, time.perf_counter() - t, ttft)

        out["ttft_ms"] = ttft * 1e3
        out.update(decode_beside_bandwidth(decode))
    if "batch" in cases:
        t = time.perf_counter()
        run(p, BATCH_OUT)
        out["batch_tps"] = BATCH * BATCH_OUT / (time.perf_counter() - t)
    return out


NO_REPACK_ENV = "LADLE_BENCH_LLAMA_NO_REPACK"


def llama_extra_buffers_as_asked() -> None:
    """In a llama-cpp-python process: with NO_REPACK_ENV set (--llama-no-repack), the models
    Llama() loads from now on get no extra weight buffers (repacking, AMX), as llama-server's
    --no-repack. Also used by gguf_accuracy.py's llama.cpp worker."""
    if not os.environ.get(NO_REPACK_ENV):
        return
    import llama_cpp

    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def no_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = no_extra_buffers


def worker_llama(path, outtype, cases):
    """llama-cpp-python in process: one sequence; its `eval` reuses a matching prefix, so every
    measurement starts from reset()."""
    from llama_cpp import Llama

    llama_extra_buffers_as_asked()
    llm = Llama(model_path=str(path), n_ctx=max_context(), n_batch=512, n_threads=os.cpu_count(),
                verbose=False)
    single = single_prompts()

    def run(ids, n):
        llm.reset()
        r = llm.create_completion(prompt=ids, max_tokens=n, temperature=0.0)
        return r["usage"]["completion_tokens"]

    run(single.warm_up, 4)
    if "paired" in cases:
        def timed(ids, n):  # greedy tokens as Llama.generate yields them, one per eval
            llm.reset()
            times = []
            for _ in llm.generate(ids, temp=0.0, reset=True):
                times.append(time.perf_counter())
                if len(times) == n:
                    break
            return len(times), times[-1] - times[0]

        return decode_turns(timed, lambda q: run(q, 1))
    out = {}
    if "single" in cases:
        ttft = _median_over(lambda q: run(q, 1), single.ttft)

        def decode():
            t = time.perf_counter()
            n = run(single.decode, DECODE_TOKENS + 1)
            return decode_rate(n - 1, time.perf_counter() - t, ttft)

        out["ttft_ms"] = ttft * 1e3
        out.update(decode_beside_bandwidth(decode))
    return out


def decode_turns(timed, first_token) -> None:
    """Paired mode (paired_decode): the model loaded and warmed up, answer each `turn N` line on
    stdin with one TTFT and one decode measurement as a JSON line, until stdin ends. A turn's
    prompts (PROMPT_LEN tokens, seed 1000 + N, for first_token(prompt), which runs the prefill
    and samples one token; DECODE_CONTEXT tokens, seed 100 + N, for the decode) are new to every
    system. The TTFT of separate repetitions moved as much as the decode between minutes (int8
    against bf16 prefill: 1.97x and 1.53x in two runs of one day). timed(prompt, n) -> (tokens,
    seconds from the first token to the last), timed inside the worker (ladle: its engine
    steps; llama.cpp: the tokens its generate() yields), so no prefill is in the rate: taking a TTFT off the
    total left the rate at the mercy of the prefill's own variation, which at 2048 tokens of
    context was larger than a 64-token decode (per-turn ratios 1.0-2.9x in one run)."""
    timed(prompts(1, seed=99)[0], 9)  # one unmeasured decode: first-step allocations, caches
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if len(cmd) != 2 or cmd[0] != "turn":
            break
        turn = int(cmd[1])
        prompt = prompts(1, length=DECODE_CONTEXT, seed=100 + turn)[0]
        t = time.perf_counter()
        first_token(prompts(1, seed=1000 + turn)[0])
        ttft_ms = (time.perf_counter() - t) * 1e3

        def decode(prompt=prompt):
            n, seconds = timed(prompt, DECODE_TOKENS + 1)
            if n < 2 or seconds <= 0:
                return {"note": f"decode left out: {n} tokens"}
            return {"decode_tps": (n - 1) / seconds}

        print(json.dumps({"ttft_ms": ttft_ms, **decode_beside_bandwidth(decode)}), flush=True)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, all its threads (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def paired_decode(entries: dict[str, tuple[str, list[str]]], turns: int,
                  log: Path) -> dict[str, list[dict]]:
    """Single-stream decode of several systems in alternating turns: each system's worker
    process (entries: system -> (python, worker args)) loads its model once and waits; then every
    turn runs one decode per system, one after another (the order reversed every other turn), so
    each ratio compares measurements seconds apart. Separate repetitions are minutes apart, and
    this machine's bandwidth drifts by half between minutes. Returns each turn's result per
    system (decode_beside_bandwidth's dicts), and under "_idle" the most CPU (in cores) any
    waiting worker used during another's turn (spin-waiting threads would slow the one
    measured)."""
    procs: dict[str, subprocess.Popen] = {}
    rates: dict[str, list[dict]] = {s: [] for s in entries}
    idle = 0.0

    def answer(proc) -> dict:
        for line in proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"worker {proc.args[-4:]} ended: see {log}")

    with open(log, "a") as err:
        try:
            for s, (python, wargs) in entries.items():
                procs[s] = subprocess.Popen(
                    [python, str(Path(__file__).resolve()), *size_flags(), "--worker", *wargs],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
                answer(procs[s])  # {"ready": true}
            order = list(procs)
            for turn in range(turns):
                for s in order if turn % 2 == 0 else order[::-1]:
                    time.sleep(0.5)  # the last system's threads stop spinning
                    others = {o: cpu_seconds(p.pid) for o, p in procs.items() if o != s}
                    t = time.perf_counter()
                    procs[s].stdin.write(f"turn {turn}\n")
                    procs[s].stdin.flush()
                    r = answer(procs[s])
                    wall = time.perf_counter() - t
                    for o, before in others.items():
                        after = cpu_seconds(procs[o].pid)
                        if before is not None and after is not None:
                            idle = max(idle, (after - before) / wall)
                    rates[s].append(r)
        finally:
            for p in procs.values():
                try:
                    p.stdin.close()
                    p.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
    return {**rates, "_idle": [{"cores": idle}]}


def decode_rate(tokens: int, total: float, ttft: float) -> dict:
    """Decode tok/s: the run's time less the median TTFT of the other prompts. When the prefill
    of this run was faster than that median by more than the decode took (few tokens on a loaded
    machine), the difference means nothing and is left out, with a note."""
    if total - ttft <= 0.05 * total:
        return {"note": f"decode left out: {tokens} tokens in {total:.3f} s, TTFT {ttft:.3f} s"}
    return {"decode_tps": tokens / (total - ttft)}


def _median_time(fn, reps=3) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _median_over(fn, inputs) -> float:
    """Median time of fn(x) over the inputs."""
    ts = []
    for x in inputs:
        t = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def read_bandwidth() -> float:
    """The read bandwidth now, bytes/s: the max of 1 GiB of float32, split over every core's
    thread (numpy, which releases the GIL in the reduction: the same method in ladle's,
    transformers' and llama-cpp-python's environments), median of 3. The max, not the sum:
    numpy's float32 sum (pairwise) was compute-bound on a 2-core Intel Xeon, 17.5 GB/s where the
    max read 32.7, and single-stream decodes there read "173%" of it."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    x = np.ones(256 * 2**20, dtype=np.float32)
    parts = np.array_split(x, os.cpu_count() or 1)
    with ThreadPoolExecutor(len(parts)) as pool:
        def read():
            return max(pool.map(np.max, parts))

        read()
        return x.nbytes / _median_time(read)


def decode_beside_bandwidth(decode) -> dict:
    """decode() (returning its dict of results) between two read-bandwidth measurements: the
    machine's bandwidth drifts by half between minutes (29-47 GB/s seen on one Zen 4), so each
    decode's share of it is taken against the bandwidth measured beside it (their mean)."""
    before = read_bandwidth()
    out = decode()
    out["read_gbs"] = (before + read_bandwidth()) / 2e9
    return out


def worker_limits():
    """This machine's read bandwidth (max of a 1 GiB array) and matmul peaks: bf16 and f32
    (the faster of torch's matmul and ladle's linear, which is what the engine runs at that
    shape: on an AVX2 CPU torch's bf16 GEMM has no fast path and ladle's kernel takes every row
    count), int8 (see int8_peak)."""
    import torch

    from ladle.runner import cpu_kernels

    bw = read_bandwidth()
    cpu_kernels.load_cpu_kernels()
    peaks = {}
    for name, dt in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        a, b = torch.randn(2048, 1024).to(dt), torch.randn(1024, 3072).to(dt)
        w = b.T.contiguous()  # (N, K), as a linear's weight
        best = 0.0
        for fn in (lambda a=a, b=b: a @ b, lambda a=a, w=w: cpu_kernels.linear(a, w)):
            fn()
            best = max(best, 2 * 2048 * 1024 * 3072 / _median_time(fn, reps=5))
        peaks[name] = best
    int8, how = int8_peak()
    return {"read_gbs": bw / 1e9, "peak_bf16_gflops": peaks["bf16"] / 1e9,
            "peak_f32_gflops": peaks["f32"] / 1e9,
            "peak_int8_gops": None if int8 is None else int8 / 1e9, "peak_int8_how": how}


def int8_peak(m=2048, k=1024, n=3072) -> tuple[float | None, str]:
    """int8 multiply-adds per second x 2 on an (m, k) x (k, n) product, the best of the ways torch
    has on this build: torch._int_mm (int8 x int8 -> int32; weight row-major or transposed), and
    fbgemm's dynamic int8 linear (torch.ao.nn.quantized.dynamic.Linear: u8 activations quantized
    per call, s8 weights, VNNI where present; the activation quantization is counted in its
    time). Returns (ops/s or None, which method gave it, or why none ran)."""
    import warnings

    import torch

    ops, results, errors = 2 * m * k * n, {}, []
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    for layout, b in (("", torch.randint(-127, 128, (k, n), dtype=torch.int8)),
                      (", B transposed", torch.randint(-127, 128, (n, k), dtype=torch.int8).t())):
        try:
            torch._int_mm(a, b)
            results[f"torch._int_mm{layout}"] = ops / _median_time(
                lambda b=b: torch._int_mm(a, b), reps=5)
        except Exception as e:  # absent on this build/device, or a layout it refuses
            errors.append(f"torch._int_mm{layout}: {type(e).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch 2.1x
            lin = torch.ao.nn.quantized.dynamic.Linear(k, n, dtype=torch.qint8)
            x = torch.randn(m, k)
            lin(x)
            results["fbgemm dynamic int8 linear"] = ops / _median_time(lambda: lin(x), reps=5)
    except Exception as e:
        errors.append(f"dynamic int8 linear: {type(e).__name__}")
    if not results:
        return None, "none ran (" + "; ".join(errors) + ")"
    best = max(results, key=results.get)
    others = ", ".join(f"{k_} {v / 1e9:.3g}" for k_, v in results.items() if k_ != best)
    return results[best], best + (f"; also {others} GOPS" if others else "")


# --- Servers ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], url: str, log: Path, timeout=600,
                 ready_path="/health", env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start cmd in its own process group (stop_server ends its children too) and wait for
    ready_path to answer 200; env: extra environment variables."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **env} if env else None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + ready_path, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy: {log.read_text()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def text_prompts(path: Path, n: int) -> list[str]:
    """Prompts as text (llama-cpp-python's server takes no token ids): random token ids decoded
    by the checkpoint's tokenizer, about PROMPT_LEN tokens each when encoded again."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.decode(p) for p in prompts(n, seed=1)]


def drive_streams(url: str, ps: list[str], clients: int, rounds: int, out_tokens: int) -> dict:
    """`clients` concurrent streaming clients, each sending `rounds` requests one after another;
    returns aggregate output tok/s, TTFT and inter-token latency statistics."""
    import asyncio

    import httpx
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def one(client, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        t0 = time.perf_counter()
        stamps = []
        # A connection per request: llama-server closes keep-alive connections idle for 5 s,
        # and a request sent on one it is closing fails with "Server disconnected without
        # sending a response" (seen in some 8-client repetitions). Both servers are driven alike.
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Connection": "close"}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        stamps.append(time.perf_counter())
        return t0, stamps

    async def client_loop(client, i):
        return [await one(client, ps[i * rounds + j]) for j in range(rounds)]

    async def main():
        limits = httpx.Limits(max_connections=clients * 2)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            await one(client, ps[0][:8])  # warm-up
            t = time.perf_counter()
            res = await asyncio.gather(*(client_loop(client, i) for i in range(clients)))
            return time.perf_counter() - t, [r for rs in res for r in rs]

    wall, results = asyncio.run(main())
    ttfts = sorted(s[0] - t0 for t0, s in results if s)
    itls = sorted(b - a for _, s in results for a, b in zip(s, s[1:], strict=False))
    n = sum(len(s) for _, s in results)
    return {"server_tps": n / wall, "ttft_med_ms": 1e3 * statistics.median(ttfts),
            "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "itl_med_ms": 1e3 * statistics.median(itls), "chunks": n}


def server_ladle(path, dtype, ps, parallel, out_tokens, rounds, log_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "serve", str(path), "--port",
           str(port), "--dtype", dtype, "--max-num-seqs", str(parallel), "--max-model-len", "512",
           "--kv-cache-memory", "2GiB", "--disable-access-log", "--uvicorn-log-level", "warning"]
    proc = start_server(cmd, url, log_dir / "ladle-serve.log")
    try:
        return drive_streams(url, ps, parallel, rounds, out_tokens)
    finally:
        stop_server(proc)


def server_llama(gguf_path, ps, parallel, out_tokens, rounds, log_dir, allow_serial=False):
    """llama-server with `parallel` slots; without that binary, llama-cpp-python's server
    (one request at a time) when allow_serial, else None."""
    binary = LLAMA_DIR / "server-build" / "bin" / "llama-server"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if binary.exists():
        cmd = [str(binary), "-m", str(gguf_path), "--port", str(port), "--host", "127.0.0.1",
               "-np", str(parallel), "-c", str(parallel * 512), "-t", str(os.cpu_count()),
               "--cont-batching", "--no-webui", *(["--no-repack"] if os.environ.get(NO_REPACK_ENV)
                                                   else [])]
        ready = "/health"
    elif allow_serial:
        cmd = [str(LLAMA_DIR / "venv" / "bin" / "python"), "-m", "llama_cpp.server", "--model",
               str(gguf_path), "--port", str(port), "--host", "127.0.0.1", "--n_ctx", "2048",
               "--n_threads", str(os.cpu_count()), "--interrupt_requests", "False"]
        ready = "/v1/models"
    else:
        return None
    proc = start_server(cmd, url, log_dir / "llama-server.log", ready_path=ready)
    try:
        return drive_streams(url, ps, parallel, rounds, out_tokens)
    finally:
        stop_server(proc)


# --- Driver ----------------------------------------------------------------------------------

def guarded(fn, *args, **kw):
    """A failed case is reported and left out of the table; the run goes on."""
    try:
        return fn(*args, **kw)
    except Exception as e:
        print(f"  {fn.__name__} failed: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
        return None


def size_flags() -> list[str]:
    """The request sizes of this run, for the worker processes."""
    return ["--decode-tokens", str(DECODE_TOKENS), "--decode-context", str(DECODE_CONTEXT),
            "--batch-out", str(BATCH_OUT), "--server-out", str(SERVER_OUT)]


def run_worker(python: str, args: list[str], env=None) -> dict:
    out = subprocess.run([python, str(Path(__file__).resolve()), *size_flags(), "--worker", *args],
                         capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        print(f"  worker {args[:2]} failed:\n{out.stderr[-1500:]}", file=sys.stderr)
        return {}
    return json.loads(lines[-1])


# --- Bytes and FLOPs per token ---------------------------------------------------------------

@dataclass(frozen=True)
class Weights:
    """What one decode step reads (every matmul weight once) and multiplies."""

    bytes_per_token: float
    flops_per_token: float  # 2 x every matmul weight, the head included
    head_flops: float  # the head's share of that (a prefill runs it for the last token only)
    how: str  # how the bytes were counted, for the report
    # Per attention layer: (bytes of keys and values per cached token, sliding window or 0),
    # what a decode step reads of its KV cache besides the weights (with_kv_cache).
    kv_layers: tuple[tuple[int, int], ...] = ()

    def prefill_flops(self, tokens: int) -> float:
        return tokens * (self.flops_per_token - self.head_flops) + self.head_flops

    def kv_bytes(self, context: float) -> float:
        """Bytes of KV cache one decode step reads at `context` tokens."""
        return sum(b * (min(context, w) if w else context) for b, w in self.kv_layers)


def model_config(path: Path) -> dict:
    """A checkpoint's config.json, or the one ladle derives from a GGUF file's metadata."""
    if path.is_dir():
        return json.loads((path / "config.json").read_text())
    from ladle.models.gguf import open_gguf
    from ladle.models.gguf.mapping import hf_config_from_gguf

    return hf_config_from_gguf(open_gguf(path))


def with_kv_cache(w: Weights, cfg: dict, elem: int) -> Weights:
    """w with its KV cache's layers: `elem` bytes per cached value (2: a bfloat16 or float16
    cache, llama.cpp's default f16 included; 4: float32), sliding layers read their window."""
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv, d = cfg.get("num_key_value_heads") or H, cfg.get("head_dim") or cfg["hidden_size"] // H
    types = cfg.get("layer_types") or ["full_attention"] * L
    window = cfg.get("sliding_window") or 0
    return dataclasses.replace(w, kv_layers=tuple(
        (2 * kv * d * elem, window if t == "sliding_attention" else 0) for t in types))


def matmul_params(path: Path) -> tuple[int, int, int]:
    """(weights, output rows, head weights) of every matmul of a safetensors checkpoint, the
    head once."""
    cfg = json.loads((path / "config.json").read_text())
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d, H, KV = cfg.get("head_dim") or h // cfg["num_attention_heads"], \
        cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * (H + 2 * KV) * d + H * d * h + 3 * h * i
    rows = L * ((H + 2 * KV) * d + h + 2 * i + h) + cfg["vocab_size"]
    return L * per_layer + h * cfg["vocab_size"], rows, h * cfg["vocab_size"]


def weights_per_token(path: Path) -> Weights:
    """A safetensors checkpoint in its own dtype: 2 (bf16) or 4 (f32) bytes per weight."""
    cfg = json.loads((path / "config.json").read_text())
    n, _, head = matmul_params(path)
    elem = 2 if cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16" else 4
    return Weights(n * elem, 2.0 * n, 2.0 * head, f"{elem} B x {n / 1e6:.0f}M weights")


def int8_weights_per_token(path: Path) -> Weights:
    """--quantization int8: 1 byte per weight (the head included) + a float32 scale per row."""
    n, rows, head = matmul_params(path)
    return Weights(n + 4 * rows, 2.0 * n, 2.0 * head,
                   f"1 B x {n / 1e6:.0f}M weights + row scales")


def gguf_weights_per_token(path: Path, widened: bool = False) -> Weights:
    """A GGUF file's tensor bytes; token_embd counts once when it is also the output head (no
    output.weight), and not at all otherwise (the lookup reads one row per token). `widened`:
    as ladle holds them, a type rewritten at load at the size of the blocks it runs as (IQ4_XS in
    blocks of 32: models/gguf/quantized.py's WIDENED)."""
    from gguf import GGML_QUANT_SIZES

    from ladle.models.gguf import open_gguf
    from ladle.models.gguf.quantized import WIDENED
    from ladle.runner.quant import BLOCK_SIZES

    tensors = open_gguf(path).tensors
    head_name = "token_embd.weight" if "output.weight" not in tensors else "output.weight"
    nbytes = params = 0
    for name, t in tensors.items():
        if name == "token_embd.weight" and head_name != name:
            continue
        if widened and int(t.ggml_type) in WIDENED:
            values, size = BLOCK_SIZES[WIDENED[int(t.ggml_type)][0]]
            file_values, file_size = GGML_QUANT_SIZES[t.ggml_type]
            nbytes += t.data.nbytes // file_size * file_values // values * size
        else:
            nbytes += t.data.nbytes
        if len(t.shape) == 2:
            params += t.shape[0] * t.shape[1]
    head = tensors[head_name].shape
    return Weights(nbytes, 2.0 * params, 2.0 * head[0] * head[1],
                   f"{nbytes / 2**20:.0f} MiB of tensors, {8 * nbytes / params:.2f} bits/weight")


# --- The run ---------------------------------------------------------------------------------

def main():
    global DECODE_TOKENS, DECODE_CONTEXT, BATCH_OUT, SERVER_OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated, of: " + ", ".join(MODELS))
    ap.add_argument("--skip-batch", action="store_true", help=f"no {BATCH}-prompt batch rows")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-int8", action="store_true", help="no `ladle int8` column")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its extra weight buffers (repacking, AMX), as "
                         "llama-server's --no-repack: on a KVM Xeon its AMX buffers crashed "
                         "(general protection fault) on batches of 16+ rows of a Q8_0 file")
    ap.add_argument("--decode-turns", type=int, default=10,
                    help="alternating single-stream decode turns per system after the "
                         "repetitions (0: none); the decode ratios are taken from them")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS,
                    help="single-stream decode length (smaller: quick checks only)")
    ap.add_argument("--decode-context", type=int, default=DECODE_CONTEXT,
                    help="prompt tokens before each paired decode turn (default "
                         f"{DECODE_CONTEXT}; e.g. 2048: a long chat, where the decode step "
                         "also reads that many tokens of KV cache; the targets at the end are "
                         f"set for {PROMPT_LEN})")
    ap.add_argument("--batch-out", type=int, default=BATCH_OUT,
                    help=f"output tokens per request of the {BATCH}-prompt batch")
    ap.add_argument("--server-out", type=int, default=SERVER_OUT,
                    help="output tokens per server request")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    DECODE_TOKENS, BATCH_OUT, SERVER_OUT = args.decode_tokens, args.batch_out, args.server_out
    if not 16 <= args.decode_context <= 32768:
        ap.error(f"--decode-context: {args.decode_context} tokens; accepted: 16 to 32768")
    DECODE_CONTEXT = args.decode_context
    if args.llama_no_repack:
        os.environ[NO_REPACK_ENV] = "1"  # read by the llama workers and server_llama
    if args.worker:
        kind, *rest = args.worker
        if kind == "limits":
            res = worker_limits()
        elif kind == "quantize":
            res = worker_quantize(*rest)
        elif kind == "ladle":
            path, dtype, cases, quantization = rest
            res = worker_ladle(Path(path), dtype, cases.split(","),
                               None if quantization == "-" else quantization)
        else:
            path, dtype, cases = rest
            fn = {"hf": worker_hf, "llama": worker_llama}[kind]
            res = fn(Path(path), dtype, cases.split(","))
        if res is not None:  # (paired mode answers its turns itself)
            print(json.dumps(res))
        return

    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; accepted: {', '.join(MODELS)}")
    llama_py = LLAMA_DIR / "venv" / "bin" / "python"
    if not (LLAMA_DIR / "server-build" / "bin" / "llama-server").exists():
        print("llama-server not built: no llama.cpp batched row; its server row is "
              "llama-cpp-python's server, which runs one request at a time")
    has_llama = not args.skip_llama and llama_py.exists() and subprocess.run(
        [str(llama_py), "-c", "import llama_cpp"], capture_output=True).returncode == 0
    if not args.skip_llama and not has_llama:
        print(f"llama-cpp-python not found under {LLAMA_DIR}; run benchmarks/build_llama_cpp.sh")
    load = os.getloadavg()
    print(f"cores={os.cpu_count()} load average={load[0]:.1f} (other processes share the CPU; "
          f"only ratios within this run count)", flush=True)
    if args.llama_no_repack:
        print("llama.cpp runs without its extra weight buffers (--llama-no-repack: no repacking, "
              "no AMX)", flush=True)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    limits = run_worker(sys.executable, ["limits"])
    int8 = limits.get("peak_int8_gops")
    print(f"measured: read {limits['read_gbs']:.1f} GB/s, matmul peak bf16 "
          f"{limits['peak_bf16_gflops']:.0f} GFLOP/s, int8 "
          f"{'n/a' if int8 is None else f'{int8:.0f}'} GOPS ({limits['peak_int8_how']}), f32 "
          f"{limits['peak_f32_gflops']:.0f} GFLOP/s", flush=True)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        res = guarded(run_model, name, MODELS[name], args, has_llama, llama_py, limits, log_dir)
        if res:
            summary[name] = res
    print_targets(summary)


def run_model(name: str, spec: Spec, args, has_llama: bool, llama_py: Path, limits: dict,
              log_dir: Path) -> dict[str, dict[str, float]] | None:
    """One model's interleaved repetitions and its table; returns the medians by system."""
    path = checkpoint(spec.source)
    model_gguf = None  # the file llama.cpp runs (and ladle too when spec.ladle_on_gguf)
    if spec.gguf == "packaged":
        model_gguf = path
    elif has_llama:
        made = spec.gguf in QUANT_FTYPES or spec.gguf in IMATRIX_FTYPES
        model_gguf = quantized_gguf(path, spec.gguf, llama_py) if made else gguf(path, spec.gguf)
    elif spec.ladle_on_gguf:
        print(f"[{name}] skipped: its GGUF file is made with llama.cpp's converter and quantize "
              "API (run benchmarks/build_llama_cpp.sh)")
        return None
    ladle_path = model_gguf if spec.ladle_on_gguf else path
    ladle_q = "-"  # ladle's default quantization: gguf (the blocks kept) for a .gguf file
    weights = {"ladle": gguf_weights_per_token(ladle_path, widened=True) if spec.ladle_on_gguf
               else weights_per_token(path)}
    systems = ["ladle"]
    if spec.int8 and not args.skip_int8:
        systems.append("ladle int8")
        weights["ladle int8"] = int8_weights_per_token(path)
    if spec.hf and not args.skip_hf:
        systems.append("transformers")
        weights["transformers"] = weights["ladle"]
    if has_llama:
        systems.append("llama.cpp")
        weights["llama.cpp"] = gguf_weights_per_token(model_gguf)
    # The KV cache a decode step reads: ladle's (and transformers') in --dtype, llama.cpp's f16.
    cfg = model_config(ladle_path)
    for s in weights:
        elem = 2 if s == "llama.cpp" or spec.dtype != "float32" else 4
        weights[s] = with_kv_cache(weights[s], cfg, elem)
    results: dict[str, list[dict]] = {s: [] for s in systems}
    batch = "batch" in spec.cases and not args.skip_batch
    server = "server" in spec.cases and not args.skip_server
    inproc = "single,batch" if batch else "single"
    texts = (text_prompts(path, max(BATCH, SERVER_CLIENTS * SERVER_ROUNDS))
             if batch or server else None)  # the checkpoint's tokenizer
    print(f"[{name}] ladle runs {ladle_path}" + (f", llama.cpp {model_gguf}" if has_llama else ""),
          flush=True)
    int8_unavailable = None
    for rep in range(args.reps):
        print(f"[{name}] repetition {rep + 1}/{args.reps}", flush=True)
        results["ladle"].append(run_worker(sys.executable, ["ladle", str(ladle_path), spec.dtype,
                                                            inproc, ladle_q]))
        if "ladle int8" in results:
            r = {"unavailable": int8_unavailable} if int8_unavailable else run_worker(
                sys.executable, ["ladle", str(path), spec.dtype, "single", "int8"])
            int8_unavailable = r.get("unavailable")
            results["ladle int8"].append(r)
        if "transformers" in results:
            results["transformers"].append(run_worker(sys.executable,
                                                      ["hf", str(path), spec.dtype, inproc]))
        if has_llama:
            r = run_worker(str(llama_py), ["llama", str(model_gguf), spec.gguf, "single"])
            if batch:
                b = guarded(server_llama, model_gguf, texts, BATCH, BATCH_OUT, 1, log_dir)
                if b:
                    r["batch_tps"] = b["server_tps"]
            results["llama.cpp"].append(r)
        if server:
            s = guarded(server_ladle, ladle_path, spec.dtype, texts, SERVER_CLIENTS, SERVER_OUT,
                        SERVER_ROUNDS, log_dir)
            results["ladle"][-1].update({"srv_" + k: v for k, v in (s or {}).items()})
            if has_llama:
                s = guarded(server_llama, model_gguf, texts, SERVER_CLIENTS, SERVER_OUT,
                            SERVER_ROUNDS, log_dir, allow_serial=True)
                if s:
                    results["llama.cpp"][-1].update({"srv_" + k: v for k, v in s.items()})
        for system, runs in results.items():  # raw numbers as they come
            if runs:
                print(f"  {system}: " + json.dumps({k: round(v, 2) if isinstance(v, float)
                                                   else v for k, v in runs[-1].items()}),
                      flush=True)
    paired = None
    if args.decode_turns > 0 and "single" in spec.cases:
        entries = {"ladle": (sys.executable, ["ladle", str(ladle_path), spec.dtype, "paired",
                                              ladle_q])}
        if "ladle int8" in results and not int8_unavailable:
            entries["ladle int8"] = (sys.executable, ["ladle", str(path), spec.dtype, "paired",
                                                      "int8"])
        if has_llama:
            entries["llama.cpp"] = (str(llama_py), ["llama", str(model_gguf), spec.gguf, "paired"])
        if len(entries) > 1:
            print(f"[{name}] paired decode: {args.decode_turns} alternating turns", flush=True)
            paired = guarded(paired_decode, entries, args.decode_turns,
                             log_dir / f"compare-paired-{name}.log")
    return report(name, spec, results, limits, weights, paired)


def rows() -> list[tuple[str, str, bool]]:
    return [
        # key, label, higher is better
        ("decode_tps", f"single-stream decode, tok/s ({DECODE_TOKENS} tokens)", True),
        ("decode_bw", "  decode: share of read bandwidth", True),
        ("read_gbs", "  read bandwidth beside that decode, GB/s", True),
        ("ttft_ms", f"TTFT, {PROMPT_LEN}-token prompt, ms", False),
        ("batch_tps", f"{BATCH} x ({PROMPT_LEN} in, {BATCH_OUT} out), tok/s", True),
        ("srv_server_tps", f"server, {SERVER_CLIENTS} streaming clients: aggregate tok/s", True),
        ("srv_ttft_med_ms", "server: median TTFT, ms", False),
        ("srv_ttft_p90_ms", "server: p90 TTFT, ms", False),
        ("srv_itl_med_ms", "server: median inter-token latency, ms", False),
    ]


# Ratio columns: (label, numerator system, denominator system), shown where both ran.
RATIOS = [("ladle/llama.cpp", "ladle", "llama.cpp"),
          ("ladle/transformers", "ladle", "transformers"),
          ("int8/ladle bf16", "ladle int8", "ladle")]


def report(name, spec, results, limits, weights: dict[str, Weights],
           paired: dict[str, list[dict]] | None = None) -> dict[str, dict]:
    def med(system, key):
        vals = [r[key] for r in results[system] if key in r]
        return statistics.median(vals) if vals else None

    for s, reps in results.items():  # each decode against the bandwidth measured beside it
        for r in reps:
            if "decode_tps" in r:
                r["decode_bw"] = r["decode_tps"] * weights[s].bytes_per_token / 1e9 / \
                    r.get("read_gbs", limits["read_gbs"])
    meds = {s: {k: med(s, k) for k, _, _ in rows() if med(s, k) is not None} for s in results}
    quantized = spec.ladle_on_gguf and spec.gguf not in ("bf16", "f16", "f32")
    peak_key = ("peak_int8_gops" if quantized and limits.get("peak_int8_gops") else
                "peak_bf16_gflops" if spec.dtype == "bfloat16" else "peak_f32_gflops")
    peak = limits[peak_key] * 1e9
    peak_name = peak_key.split("_")[1]
    systems = list(results)
    ratios = [r for r in RATIOS if r[1] in results and r[2] in results]
    unavailable = {s: next((r["unavailable"] for r in rs if "unavailable" in r), None)
                   for s, rs in results.items()}
    print(f"\n{name} ({spec.dtype}"
          + (f", {spec.gguf} GGUF" if spec.ladle_on_gguf else "")
          + f"); medians of {len(results['ladle'])} interleaved repetitions")
    for s in systems:
        print(f"  {s}: {weights[s].how} read per token")
    widths = [max(9, len(s)) for s in systems]
    print(f"| {'':48} | " + " | ".join(f"{s:>{w}}" for s, w in zip(systems, widths, strict=True))
          + "".join(f" | {r[0]}" for r in ratios) + " | ladle share of limit |")
    print("|" + "---|" * (2 + len(systems) + len(ratios)))
    def cell(vals, key, s, w):
        v = vals[s]
        if v is None:
            return f"{'n/a' if unavailable[s] else '-':>{w}}"
        return f"{v:>{w}.0%}" if key == "decode_bw" else f"{v:>{w}.1f}"

    def ratio(vals, key, num, den, label):
        if vals[num] is None or vals[den] is None or key in ("decode_bw", "read_gbs"):
            return f"{'-':>{len(label)}}"
        return f"{vals[num] / vals[den]:>{len(label) - 1}.2f}x"

    for key, label, _ in rows():
        vals = {s: meds[s].get(key) for s in systems}
        if vals["ladle"] is None:
            continue
        share = ""
        if key == "ttft_ms":  # the prefill's matmuls alone, against the time to first token
            flops = weights["ladle"].prefill_flops(PROMPT_LEN)
            share = f"{flops / (vals['ladle'] / 1e3) / peak:.0%} of {peak_name} matmul peak"
        elif key in ("batch_tps", "srv_server_tps"):
            share = f"{vals['ladle'] * weights['ladle'].flops_per_token / peak:.0%} of " \
                    f"{peak_name} matmul peak"
        print(f"| {label:48} | "
              + " | ".join(cell(vals, key, s, w) for s, w in zip(systems, widths, strict=True))
              + "".join(f" | {ratio(vals, key, n, d, lab)}" for lab, n, d in ratios)
              + f" | {share} |")
    print("(TTFT and latency rows: lower is better, so a ratio below 1 favours the numerator)")
    for s, why in unavailable.items():
        if why:
            print(f"{s}: n/a ({why})")
    itl, llama_tps = meds["ladle"].get("srv_itl_med_ms"), meds.get("llama.cpp", {}).get(
        "decode_tps")
    if itl is not None and llama_tps:
        # What one client waits per token while 8 share ladle, against one alone on llama.cpp.
        print(f"server median inter-token latency / llama.cpp single-stream inter-token latency: "
              f"{itl:.1f} / {1e3 / llama_tps:.1f} ms = {itl * llama_tps / 1e3:.2f}x")
    if paired:
        meds["paired ratio"] = report_paired(paired, weights)
    sys.stdout.flush()
    return meds


def report_paired(paired: dict[str, list[dict]], weights: dict[str, Weights]) -> dict[str, float]:
    """The alternating turns' tok/s and share of the read bandwidth measured beside each turn per
    system, and each RATIOS pair's median of per-turn ratios (both measured in the same turn,
    seconds apart). Returns {"num/den": ratio, "system share": median share}."""
    turns = {s: v for s, v in paired.items() if not s.startswith("_")}
    n = max(len(v) for v in turns.values())
    context = DECODE_CONTEXT + (DECODE_TOKENS + 1) / 2  # a timed step's mean context
    print(f"single-stream decode in {n} alternating turns (each system once per turn, a new "
          f"{DECODE_CONTEXT}-token prompt per turn; tok/s, and share of the read bandwidth "
          f"measured beside each turn, counting weight bytes only, then also the KV cache a "
          f"step reads at its mean context of {context:.0f} tokens):")
    out = {}
    for s, v in turns.items():
        tps = [r["decode_tps"] for r in v if "decode_tps" in r]
        shares = [r["decode_tps"] * weights[s].bytes_per_token / 1e9 / r["read_gbs"]
                  for r in v if "decode_tps" in r and r.get("read_gbs")]
        if tps:
            print(f"  {s:12} median {statistics.median(tps):6.1f}   turns: "
                  + " ".join(f"{x:.1f}" for x in tps))
        if shares:
            out[f"{s} share"] = statistics.median(shares)
            print(f"  {'':12} median {out[f'{s} share']:6.0%}   turns: "
                  + " ".join(f"{x:.0%}" for x in shares))
            kv = weights[s].kv_bytes(context)
            if kv:
                with_kv = [x * (1 + kv / weights[s].bytes_per_token) for x in shares]
                out[f"{s} share with KV"] = statistics.median(with_kv)
                print(f"  {'':12} median {out[f'{s} share with KV']:6.0%}   with the KV cache "
                      f"({kv / 1e6:.1f} MB a step)   turns: "
                      + " ".join(f"{x:.0%}" for x in with_kv))
    for s, v in turns.items():
        ttft = [r["ttft_ms"] for r in v if "ttft_ms" in r]
        if ttft:
            print(f"  {s:12} TTFT of a {PROMPT_LEN}-token prompt, ms: median "
                  f"{statistics.median(ttft):.0f}   turns: " + " ".join(f"{x:.0f}" for x in ttft))
    for label, num, den in RATIOS:
        a, b = turns.get(num), turns.get(den)
        if a and b:
            per_turn = [x["decode_tps"] / y["decode_tps"] for x, y in zip(a, b, strict=False)
                        if "decode_tps" in x and "decode_tps" in y]
            if per_turn:
                out[f"{num}/{den}"] = statistics.median(per_turn)
                print(f"  {label}: median of per-turn ratios {out[f'{num}/{den}']:.2f}x "
                      f"(turns {min(per_turn):.2f}-{max(per_turn):.2f}x)")
            # TTFT both ways round: the targets put either system on top.
            pairs = [(x["ttft_ms"], y["ttft_ms"]) for x, y in zip(a, b, strict=False)
                     if "ttft_ms" in x and "ttft_ms" in y]
            if pairs:
                out[f"ttft {num}/{den}"] = statistics.median(x / y for x, y in pairs)
                out[f"ttft {den}/{num}"] = statistics.median(y / x for x, y in pairs)
                print(f"  {label} TTFT: median of per-turn ratios "
                      f"{out[f'ttft {num}/{den}']:.2f}x (turns "
                      f"{min(x / y for x, y in pairs):.2f}-{max(x / y for x, y in pairs):.2f}x)")
    idle = paired.get("_idle", [{}])[0].get("cores", 0.0)
    print(f"  the waiting workers used at most {idle:.0%} of a core during another's turn")
    return out


# Issue 21's acceptance numbers: (label, model, key, numerator, (model, system) denominator,
# target, higher is better).
TARGETS = [
    ("0.6B Q8_0 decode / llama.cpp", "0.6b-q8_0", "decode_tps", "ladle", ("0.6b-q8_0", "llama.cpp"),
     1.3, True),
    ("0.6B Q4_K_M decode / llama.cpp", "0.6b-q4_k_m", "decode_tps", "ladle",
     ("0.6b-q4_k_m", "llama.cpp"), 1.2, True),
    ("Gemma 3 270M Q4_K_M decode / llama.cpp", "gemma", "decode_tps", "ladle",
     ("gemma", "llama.cpp"), 1.2, True),
    ("0.6B Q8_0 TTFT / llama.cpp", "0.6b-q8_0", "ttft_ms", "ladle", ("0.6b-q8_0", "llama.cpp"),
     0.4, False),
    ("0.6B Q8_0 TTFT / ladle bf16 TTFT", "0.6b-q8_0", "ttft_ms", "ladle", ("0.6b", "ladle"),
     1.0, False),
    ("0.6B Q8_0 batch of 32 / llama-server", "0.6b-q8_0", "batch_tps", "ladle",
     ("0.6b-q8_0", "llama.cpp"), 2.5, True),
    ("0.6B Q8_0 8-client server / llama-server", "0.6b-q8_0", "srv_server_tps", "ladle",
     ("0.6b-q8_0", "llama.cpp"), 3.0, True),
    ("0.6B int8 prefill speed (bf16 TTFT / int8 TTFT)", "0.6b", "ttft_ms", "ladle",
     ("0.6b", "ladle int8"), 1.6, True),
    ("0.6B int8 decode / ladle bf16", "0.6b", "decode_tps", "ladle int8", ("0.6b", "ladle"),
     1.6, True),
    ("0.6B bf16 decode: share of read bandwidth", "0.6b", "decode_bw", "ladle", None, 0.9, True),
]


def print_targets(summary: dict[str, dict[str, dict[str, float]]]) -> None:
    """Issue 21's targets beside this run's numbers, where the run measured both sides."""
    lines = []
    for label, model, key, num, den, target, higher in TARGETS:
        v = summary.get(model, {}).get(num, {}).get(key)
        how = ""
        if v is not None and den is not None:
            d = summary.get(den[0], {}).get(den[1], {}).get(key)
            v = None if not d else v / d
        pairs = summary.get(model, {}).get("paired ratio", {})
        paired = pairs.get(f"{num} share" if den is None else f"{num}/{den[1]}")
        if key == "ttft_ms" and den is not None:
            paired = pairs.get(f"ttft {num}/{den[1]}")
        if key in ("decode_tps", "decode_bw", "ttft_ms") and (den is None or den[0] == model) \
                and paired is not None:
            v, how = paired, " (alternating turns)"  # rather than one run minutes apart
        if v is None:
            continue
        met = v >= target if higher else v <= target
        fmt = (lambda x: f"{x:.0%}") if key == "decode_bw" else (lambda x: f"{x:.2f}x")
        lines.append(f"  {label}{how}: {fmt(v)} (target {'>=' if higher else '<='} {fmt(target)})"
                     f"{'' if met else '  -- not met'}")
    if lines:
        print("\nissue 21 targets, this run:")
        if DECODE_CONTEXT != PROMPT_LEN:
            print(f"  (the decode turns started from {DECODE_CONTEXT} tokens of context; the "
                  f"targets are set for {PROMPT_LEN})")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
