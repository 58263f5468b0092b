"""Data-parallel overhead: output tokens/s of `ladle serve --data-parallel-size 2` (two engines,
each with half the cores) against `--data-parallel-size 1` (one engine with all of them), on the
same 32 concurrent streaming requests; prints the ratio, and -dp 1 with half the cores as a
control (thread scaling inside one engine apart from what a second process brings). On a host
whose cores are all busy already (this project's 2-core machine) the figures say more about
contention (OpenMP threads waiting for busy cores, a second engine loop competing with the API
process) than about scaling; on a host with idle cores, or one GPU per engine, the ratio is the
scaling itself.

    python benchmarks/parallel_dp.py [--model tiny|0.6b|ladle-demo|DIR] [--requests 32]

`run_dp(...)` is the same measurement for benchmarks/parallel.py to call."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare  # noqa: E402 - sibling scripts
from compare import free_port, stop_server  # noqa: E402
from serve import run_level, summarize, workload  # noqa: E402


def resolve_model(name: str) -> tuple[str, str]:
    """(checkpoint, dtype) for a name: tiny / 0.6b build random checkpoints once (as
    benchmarks/compare.py does); anything else is passed to `ladle serve` as it is."""
    if name in ("tiny", "0.6b"):
        return str(compare.checkpoint(name)), compare.MODELS[name][1]
    return name, "auto"


def start_server(model: str, dtype: str, dp: int, max_model_len: int,
                 env: dict[str, str] | None = None):
    port = free_port()
    cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "serve", model, "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--data-parallel-size",
           str(dp), "--disable-access-log", "--disable-log-stats", "--uvicorn-log-level",
           "warning"]
    log = Path(tempfile.mkdtemp(prefix="ladle-bench-")) / f"dp{dp}.log"
    url = f"http://127.0.0.1:{port}"
    return compare.start_server(cmd, url, log, env=env), url


async def one_pass(url: str, model: str, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once (concurrency = len(prompts)); fails on any request error."""
    results, wall = await run_level(url, model, None, prompts, output_len, len(prompts))
    row = summarize(results, wall)
    if row["errors"]:
        raise RuntimeError(f"{url}: {row['errors']} request(s) failed: "
                           f"{next(r.error for r in results if r.error)}")
    return row


def run_dp(model: str = "tiny", num_requests: int = 32, input_len: int = 64,
           output_len: int = 64, rounds: int = 3) -> dict:
    """Output tok/s of -dp 1 (all cores) and -dp 2 (half the cores per engine) on the same
    requests, and their ratio; also -dp 1 with half the cores, which tells thread scaling inside
    one engine apart from what a second process brings. The servers run for the whole
    measurement (an idle engine sleeps) and their passes alternate, so a change in the machine's
    other load falls on all; each keeps its best pass."""
    path, dtype = resolve_model(model)
    prompts = workload(num_requests, (input_len, input_len), seed=0)
    max_model_len = input_len + output_len
    cores = len(os.sched_getaffinity(0))
    layouts = {"dp1": (1, None), "dp1_half": (1, {"OMP_NUM_THREADS": str(max(1, cores // 2))}),
               "dp2": (2, None)}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    best: dict[str, dict] = {}
    try:
        for name, (dp, env) in layouts.items():
            servers[name] = start_server(path, dtype, dp, max_model_len, env)
        for _, url in servers.values():  # warm-up: first steps, kernel and cache setup
            asyncio.run(one_pass(url, path, prompts, 8))
        for _ in range(rounds):
            for name, (_, url) in servers.items():
                row = asyncio.run(one_pass(url, path, prompts, output_len))
                if name not in best or row["throughput_tok_s"] > best[name]["throughput_tok_s"]:
                    best[name] = row
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    out = {"model": model, "cores": cores, "requests": num_requests, "input_len": input_len,
           "output_len": output_len,
           "ratio": best["dp2"]["throughput_tok_s"] / best["dp1"]["throughput_tok_s"]}
    for name, row in best.items():
        out[f"{name}_tok_s"] = row["throughput_tok_s"]
        out[f"{name}_ttft_median_ms"] = row["ttft_median_ms"]
    return out


def report(r: dict) -> None:
    half = max(1, r["cores"] // 2)
    print(f"data parallel, {r['model']}: {r['requests']} concurrent requests x "
          f"({r['input_len']} in, {r['output_len']} out), {r['cores']} cores; output tok/s, "
          "best pass")
    for name, label in (("dp1", f"-dp 1, {r['cores']} threads"),
                        ("dp1_half", f"-dp 1, {half} thread(s)"),
                        ("dp2", f"-dp 2, {half} thread(s) per engine")):
        print(f"  {label:<30} {r[name + '_tok_s']:8.1f}  (TTFT median "
              f"{r[name + '_ttft_median_ms']:.0f} ms)")
    print(f"  ratio -dp 2 / -dp 1: {r['ratio']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny",
                    help="tiny, 0.6b (random checkpoints with those shapes), ladle-demo, or a "
                         "checkpoint directory")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="measured passes of each (best kept)")
    args = ap.parse_args()
    report(run_dp(args.model, args.requests, args.input_len, args.output_len, args.rounds))


if __name__ == "__main__":
    main()
