"""Data-parallel overhead: output tokens/s of `ladle serve --data-parallel-size 2` (two engines,
each with half the cores) against `--data-parallel-size 1` (one engine with all of them), on the
same 32 concurrent streaming requests; prints the ratio. On a host whose cores are all busy
already (this project's 2-core machine) the ratio shows the cost of a second engine process
(routing, a second model copy, two smaller batches) more than any speedup; on a host with idle
cores, or one GPU per engine, it is the scaling itself.

    python benchmarks/parallel_dp.py [--model tiny|0.6b|ladle-demo|DIR] [--requests 32]

`run_dp(...)` is the same measurement for benchmarks/parallel.py to call."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve import run_level, summarize, workload  # noqa: E402 - a sibling script


def resolve_model(name: str) -> tuple[str, str]:
    """(checkpoint, dtype) for a name: tiny / 0.6b build random checkpoints once (as
    benchmarks/compare.py does); anything else is passed to `ladle serve` as it is."""
    if name in ("tiny", "0.6b"):
        from compare import MODELS, checkpoint

        return str(checkpoint(name)), MODELS[name][1]
    return name, "auto"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, dtype: str, dp: int, max_model_len: int):
    port = free_port()
    cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "serve", model, "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--data-parallel-size",
           str(dp), "--disable-access-log", "--disable-log-stats", "--uvicorn-log-level",
           "warning"]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"ladle-bench-dp{dp}-", suffix=".log",
                                      delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server (-dp {dp}) exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    sys.exit(f"server (-dp {dp}) did not become healthy; see {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(model: str, dtype: str, dp: int, prompts: list[list[int]], output_len: int,
            rounds: int) -> dict:
    """Best of `rounds` passes of all prompts at once (concurrency = len(prompts)), after one
    warm-up pass, against a fresh `-dp dp` server."""
    proc, url = start_server(model, dtype, dp, max_model_len=max(map(len, prompts)) + output_len)
    try:
        asyncio.run(run_level(url, model, None, prompts, 8, len(prompts)))  # warm-up
        best: dict | None = None
        for _ in range(rounds):
            results, wall = asyncio.run(run_level(url, model, None, prompts, output_len,
                                                  len(prompts)))
            row = summarize(results, wall)
            if row["errors"]:
                sys.exit(f"-dp {dp}: {row['errors']} request(s) failed")
            if best is None or row["throughput_tok_s"] > best["throughput_tok_s"]:
                best = row
        return best
    finally:
        stop_server(proc)


def run_dp(model: str = "tiny", num_requests: int = 32, input_len: int = 64,
           output_len: int = 64, rounds: int = 2) -> dict:
    """Output tok/s of -dp 1 and -dp 2 on the same requests, and their ratio."""
    path, dtype = resolve_model(model)
    prompts = workload(num_requests, (input_len, input_len), seed=0)
    cores = len(os.sched_getaffinity(0))
    dp1 = measure(path, dtype, 1, prompts, output_len, rounds)
    dp2 = measure(path, dtype, 2, prompts, output_len, rounds)
    return {"model": model, "cores": cores, "requests": num_requests, "input_len": input_len,
            "output_len": output_len, "dp1_tok_s": dp1["throughput_tok_s"],
            "dp2_tok_s": dp2["throughput_tok_s"],
            "ratio": dp2["throughput_tok_s"] / dp1["throughput_tok_s"],
            "dp1_ttft_median_ms": dp1["ttft_median_ms"],
            "dp2_ttft_median_ms": dp2["ttft_median_ms"]}


def report(r: dict) -> None:
    threads = os.environ.get("OMP_NUM_THREADS")
    per_engine = threads or str(max(1, r["cores"] // 2))
    print(f"data parallel, {r['model']}: {r['requests']} concurrent requests x "
          f"({r['input_len']} in, {r['output_len']} out), {r['cores']} cores")
    print(f"  -dp 1 ({threads or r['cores']} threads):          {r['dp1_tok_s']:8.1f} output "
          f"tok/s  (TTFT median {r['dp1_ttft_median_ms']:.0f} ms)")
    print(f"  -dp 2 ({per_engine} thread(s) per engine): {r['dp2_tok_s']:8.1f} output tok/s  "
          f"(TTFT median {r['dp2_ttft_median_ms']:.0f} ms)")
    print(f"  ratio dp2 / dp1: {r['ratio']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny",
                    help="tiny, 0.6b (random checkpoints with those shapes), ladle-demo, or a "
                         "checkpoint directory")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="measured passes (best kept)")
    args = ap.parse_args()
    report(run_dp(args.model, args.requests, args.input_len, args.output_len, args.rounds))


if __name__ == "__main__":
    main()
