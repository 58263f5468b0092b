"""ladle against llama.cpp and transformers on the same random checkpoints and requests, in one
table of ratios.

Models: a random-weight checkpoint shaped like Qwen3-0.6B in bfloat16, and a tiny Qwen3 (hidden
128, 4 layers, Qwen's 152k vocabulary) in float32, where framework overhead dominates. Both carry
Qwen's tokenizer, so llama.cpp's own HF -> GGUF converter (shipped in the llama-cpp-python sdist
that benchmarks/build_llama_cpp.sh builds) converts them. Cases:
  - single-stream decode tok/s and TTFT of a 128-token prompt (in process: ladle's LLM,
    transformers' generate, llama-cpp-python's Llama);
  - 32 x (128 in, 128 out) output tok/s (ladle's LLM, transformers' generate on the batch of 32,
    llama.cpp's llama-server with 32 parallel slots);
  - server to server, 8 streaming clients each sending 128-token prompts for 64 tokens:
    aggregate tok/s, median/p90 TTFT and median inter-token latency (`ladle serve` against
    llama-server with 8 parallel slots).
Each system runs in its own process, and the systems are interleaved within every repetition
(reported: the median over repetitions), since this machine's speed drifts with other load.
Physical limits printed beside: the read bandwidth and the bf16/f32 matmul peak measured here.

    nice -n 19 benchmarks/build_llama_cpp.sh          # once, many minutes
    python benchmarks/compare.py [--reps 3] [--models 0.6b,tiny] [--skip-server] [--skip-hf]
"""

from __future__ import annotations

import argparse
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
SERVER_CLIENTS, SERVER_OUT, SERVER_ROUNDS = 8, 64, 2

TINY_QWEN3 = dict(
    vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def cache_root() -> Path:
    return Path(os.environ.get("LADLE_CACHE_DIR", Path.home() / ".cache" / "ladle"))


def tiny_checkpoint() -> Path:
    path = cache_root() / "qwen3-tiny-random-f32"
    if (path / "model.safetensors").exists():
        return path
    import torch
    import transformers as tf

    from ladle.models.qwen_tokenizer import write_qwen_tokenizer

    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY_QWEN3, torch_dtype="float32"))
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    write_qwen_tokenizer(tmp, TINY_QWEN3["max_position_embeddings"])
    tmp.rename(path)
    return path


MODELS = {
    # name: (checkpoint builder, torch dtype name, GGUF outtype)
    "0.6b": ("qwen3_06b", "bfloat16", "bf16"),
    "tiny": ("tiny", "float32", "f32"),
}


def checkpoint(name: str) -> Path:
    if name == "0.6b":
        sys.path.insert(0, str(HERE))
        from throughput import qwen3_06b_checkpoint

        return qwen3_06b_checkpoint()
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

def worker_ladle(path, dtype, cases):
    from ladle import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, max_num_seqs=BATCH, max_model_len=512,
              max_num_batched_tokens=2048, kv_cache_memory="2GiB")
    p, single = prompts(BATCH), single_prompts()

    def run(ps, n):
        return llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    run([single.warm_up], 4)
    out = {}
    if "single" in cases:
        ttft = _median_over(lambda q: run([q], 1), single.ttft)
        t = time.perf_counter()
        run([single.decode], DECODE_TOKENS + 1)
        out["ttft_ms"] = ttft * 1e3
        out["decode_tps"] = DECODE_TOKENS / (time.perf_counter() - t - ttft)
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
        t = time.perf_counter()
        run([single.decode], DECODE_TOKENS + 1)
        out["ttft_ms"] = ttft * 1e3
        out["decode_tps"] = DECODE_TOKENS / (time.perf_counter() - t - ttft)
    if "batch" in cases:
        t = time.perf_counter()
        run(p, BATCH_OUT)
        out["batch_tps"] = BATCH * BATCH_OUT / (time.perf_counter() - t)
    return out


def worker_llama(path, outtype, cases):
    """llama-cpp-python in process: one sequence; its `eval` reuses a matching prefix, so every
    measurement starts from reset()."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=os.cpu_count(),
                verbose=False)
    single = single_prompts()

    def run(ids, n):
        llm.reset()
        r = llm.create_completion(prompt=ids, max_tokens=n, temperature=0.0)
        return r["usage"]["completion_tokens"]

    run(single.warm_up, 4)
    out = {}
    if "single" in cases:
        ttft = _median_over(lambda q: run(q, 1), single.ttft)
        t = time.perf_counter()
        n = run(single.decode, DECODE_TOKENS + 1)
        out["ttft_ms"] = ttft * 1e3
        out["decode_tps"] = (n - 1) / (time.perf_counter() - t - ttft)
    return out


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


def worker_limits():
    """This machine's read bandwidth (sum of a 1 GiB tensor) and matmul peaks."""
    import torch

    x = torch.ones(256 * 2**20)  # 1 GiB float32
    x.sum()
    bw = 4 * x.numel() / _median_time(lambda: x.sum())
    peaks = {}
    for name, dt in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        a, b = torch.randn(2048, 1024).to(dt), torch.randn(1024, 3072).to(dt)
        a @ b
        peaks[name] = 2 * 2048 * 1024 * 3072 / _median_time(lambda a=a, b=b: a @ b, reps=5)
    return {"read_gbs": bw / 1e9, "peak_bf16_gflops": peaks["bf16"] / 1e9,
            "peak_f32_gflops": peaks["f32"] / 1e9}


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
               "--cont-batching", "--no-webui"]
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

def run_worker(python: str, args: list[str], env=None) -> dict:
    out = subprocess.run([python, str(Path(__file__).resolve()), "--worker", *args],
                         capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        print(f"  worker {args[:2]} failed:\n{out.stderr[-1500:]}", file=sys.stderr)
        return {}
    return json.loads(lines[-1])


def weights_per_token(path: Path) -> tuple[float, float]:
    """(bytes read per decode step, FLOPs per token): every matmul weight once."""
    cfg = json.loads((path / "config.json").read_text())
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d, H, KV = cfg.get("head_dim") or h // cfg["num_attention_heads"], \
        cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * (H + 2 * KV) * d + H * d * h + 3 * h * i
    n = L * per_layer + h * cfg["vocab_size"]
    elem = 2 if cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16" else 4
    return n * elem, 2.0 * n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default="0.6b,tiny")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "limits":
            res = worker_limits()
        else:
            path, dtype, cases = rest
            fn = {"ladle": worker_ladle, "hf": worker_hf, "llama": worker_llama}[kind]
            res = fn(Path(path), dtype, cases.split(","))
        print(json.dumps(res))
        return

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
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    limits = run_worker(sys.executable, ["limits"])
    print(f"measured: read {limits['read_gbs']:.1f} GB/s, matmul peak bf16 "
          f"{limits['peak_bf16_gflops']:.0f} GFLOP/s, f32 {limits['peak_f32_gflops']:.0f} GFLOP/s",
          flush=True)
    for name in args.models.split(","):
        _, dtype, outtype = MODELS[name]
        path = checkpoint(name)
        model_gguf = gguf(path, outtype) if has_llama else None
        results: dict[str, list[dict]] = {"ladle": [], "transformers": [], "llama.cpp": []}
        texts = text_prompts(path, max(BATCH, SERVER_CLIENTS * SERVER_ROUNDS))
        for rep in range(args.reps):
            print(f"[{name}] repetition {rep + 1}/{args.reps}", flush=True)
            results["ladle"].append(run_worker(sys.executable,
                                               ["ladle", str(path), dtype, "single,batch"]))
            if not args.skip_hf:
                results["transformers"].append(run_worker(
                    sys.executable, ["hf", str(path), dtype, "single,batch"]))
            if has_llama:
                r = run_worker(str(llama_py), ["llama", str(model_gguf), outtype, "single"])
                b = guarded(server_llama, model_gguf, texts, BATCH, BATCH_OUT, 1, log_dir)
                if b:
                    r["batch_tps"] = b["server_tps"]
                results["llama.cpp"].append(r)
            if not args.skip_server:
                s = guarded(server_ladle, path, dtype, texts, SERVER_CLIENTS, SERVER_OUT,
                            SERVER_ROUNDS, log_dir)
                results["ladle"][-1].update({"srv_" + k: v for k, v in (s or {}).items()})
                if has_llama:
                    s = guarded(server_llama, model_gguf, texts, SERVER_CLIENTS, SERVER_OUT,
                                SERVER_ROUNDS, log_dir, allow_serial=True)
                    if s:
                        results["llama.cpp"][-1].update({"srv_" + k: v for k, v in s.items()})
            for system, runs in results.items():  # raw numbers as they come
                if runs:
                    print(f"  {system}: " + json.dumps({k: round(v, 2) for k, v in
                                                       runs[-1].items()}), flush=True)
        report(name, dtype, path, results, limits)


ROWS = [
    # key, label, higher is better
    ("decode_tps", f"single-stream decode, tok/s ({DECODE_TOKENS} tokens)", True),
    ("ttft_ms", f"TTFT, {PROMPT_LEN}-token prompt, ms", False),
    ("batch_tps", f"{BATCH} x ({PROMPT_LEN} in, {BATCH_OUT} out), tok/s", True),
    ("srv_server_tps", f"server, {SERVER_CLIENTS} streaming clients: aggregate tok/s", True),
    ("srv_ttft_med_ms", "server: median TTFT, ms", False),
    ("srv_ttft_p90_ms", "server: p90 TTFT, ms", False),
    ("srv_itl_med_ms", "server: median inter-token latency, ms", False),
]


def report(name, dtype, path, results, limits):
    def med(system, key):
        vals = [r[key] for r in results[system] if key in r]
        return statistics.median(vals) if vals else None

    bytes_tok, flops_tok = weights_per_token(path)
    peak = limits["peak_bf16_gflops" if dtype == "bfloat16" else "peak_f32_gflops"] * 1e9
    print(f"\n{name} ({dtype}); medians of {len(results['ladle'])} interleaved repetitions")
    print(f"| {'':48} | {'ladle':>8} | {'transformers':>12} | {'llama.cpp':>9} | ladle/llama.cpp "
          f"| ladle/transformers | ladle share of limit |")
    print("|" + "---|" * 7)
    for key, label, higher in ROWS:
        vals = {s: med(s, key) for s in results}
        if vals["ladle"] is None:
            continue

        def ratio(peer, vals=vals, higher=higher):
            if vals[peer] is None:
                return "-"
            r = vals["ladle"] / vals[peer]
            return f"{r:.2f}x" + ("" if higher else " (lower is better)")

        share = ""
        if key == "decode_tps":
            share = f"{vals['ladle'] * bytes_tok / 1e9 / limits['read_gbs']:.0%} of read bandwidth"
        elif key in ("batch_tps", "srv_server_tps"):
            share = f"{vals['ladle'] * flops_tok / peak:.0%} of matmul peak"
        cells = [f"{v:8.1f}" if v is not None else f"{'-':>8}" for v in vals.values()]
        print(f"| {label:48} | {cells[0]} | {cells[1]:>12} | {cells[2]:>9} | {ratio('llama.cpp'):>15}"
              f" | {ratio('transformers'):>18} | {share} |")
    itl, llama_tps = med("ladle", "srv_itl_med_ms"), med("llama.cpp", "decode_tps")
    if itl is not None and llama_tps:
        # What one client waits per token while 8 share ladle, against one alone on llama.cpp.
        print(f"server median inter-token latency / llama.cpp single-stream inter-token latency: "
              f"{itl:.1f} / {1e3 / llama_tps:.1f} ms = {itl * llama_tps / 1e3:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
