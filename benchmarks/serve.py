"""Serving benchmark: a concurrency sweep of streaming completion clients against `ladle serve`,
reporting time to first token, inter-token latency and output tokens/s (median and p99), with a
PNG plot; and, at the highest concurrency, serving throughput as a ratio of offline engine
throughput (ladle.LLM in its own process) on the same requests.

With a server it starts itself it also prints the CPU time the API process and the engine
process(es) spent per output token at each level (Linux /proc): the API's share is what the
serving path (HTTP, SSE, detokenizing, the output loop, ZMQ) costs beside the engine's step.
--reps R repeats the highest level and the offline run alternately R times (the machine's speed
drifts; the ratio printed is the median of the per-repetition ratios).

Prompts are random token ids (lengths drawn from --input-len), outputs are --output-len tokens
(greedy, ignore_eos), so every level does the same work per request.

    python benchmarks/serve.py [--url http://127.0.0.1:8000] [--concurrency 1 4 16 64]
    ladle bench serve --plot serve.png

Without --url it starts `ladle serve` itself (and stops it at the end).

--interference measures what heavy arrivals do to running streams: the p99 inter-token gap of 8
streams alone, then while 16 requests arrive (half with 100k-character prompts, which the API
process must tokenize, half with distinct 300-property JSON schemas, which must be checked and
compiled); it prints the ratio (near 1 when no request can stall the others).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)  # per token after the first
    e2e: float = 0.0
    num_tokens: int = 0
    error: str | None = None


def workload(n: int, input_len: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 100000) for _ in range(rng.randint(*input_len))]
            for _ in range(n)]


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int],
                      output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    res = RequestResult()
    t0 = last = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                if not n:
                    continue
                now = time.perf_counter()
                if res.num_tokens == 0:
                    res.ttft = now - t0
                    n_gaps = n - 1
                else:
                    n_gaps = n
                if n_gaps:  # a chunk may carry several tokens: share the gap between them
                    res.itls += [(now - last) / n_gaps] * n_gaps
                res.num_tokens += n
                last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    return res


async def run_level(url: str, model: str, api_key: str | None, prompts: list[list[int]],
                    output_len: int, concurrency: int) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []

    async def client(http):
        while not queue.empty():
            results.append(await one_request(http, model, queue.get_nowait(), output_len))

    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600)) as http:
        t = time.perf_counter()
        await asyncio.gather(*[client(http) for _ in range(concurrency)])
        wall = time.perf_counter() - t
    return results, wall


def heavy_request(i: int) -> dict:
    """Arrival i of the interference case: a 100k-character prompt (even i) or a distinct
    300-property JSON schema (odd i)."""
    if i % 2 == 0:
        text = " ".join(f"word{(i * 7919 + k) % 5000}" for k in range(12_500))[:100_000]
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    props = {f"field_{i}_{k}": {"type": "string" if k % 3 else "integer"} for k in range(300)}
    schema = {"type": "object", "properties": props, "required": list(props)[:3]}
    return {"messages": [{"role": "user", "content": f"fill the form {i}"}], "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": f"form{i}", "schema": schema}}}


async def interference(url: str, model: str, api_key: str | None, output_len: int,
                       kinds: str = "both") -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = workload(8, (64, 128), 7)
    alone, _ = await run_level(url, model, api_key, prompts, output_len, 8)
    codes: list[int] = []

    async def arrivals():
        async with httpx.AsyncClient(base_url=url, headers=headers,
                                     timeout=httpx.Timeout(600)) as http:
            async def one(i):
                if kinds != "both" and (i % 2 == 0) != (kinds == "prompts"):
                    i += 1  # only the kind asked for
                await asyncio.sleep(0.5 + 0.1 * i)  # once the streams are running
                r = await http.post("/v1/chat/completions", json={"model": model,
                                                                  **heavy_request(i)})
                codes.append(r.status_code)
            await asyncio.gather(*(one(i) for i in range(16)))

    (loaded, _), _ = await asyncio.gather(
        run_level(url, model, api_key, prompts, output_len, 8), arrivals())
    p99_alone = pct([g for r in alone for g in r.itls], 99) * 1e3
    p99_loaded = pct([g for r in loaded for g in r.itls], 99) * 1e3
    return {"itl_p99_alone_ms": p99_alone, "itl_p99_with_arrivals_ms": p99_loaded,
            "ratio": p99_loaded / p99_alone, "arrival_status_codes": sorted(codes),
            "errors": sum(r.error is not None for r in alone + loaded)}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    itls = [x for r in ok for x in r.itls]
    speeds = [(r.num_tokens - 1) / (r.e2e - r.ttft) for r in ok if r.num_tokens > 1]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_median_ms": 1000 * statistics.median([r.ttft for r in ok]),
        "ttft_p99_ms": 1000 * pct([r.ttft for r in ok], 99),
        "itl_median_ms": 1000 * statistics.median(itls),
        "itl_p90_ms": 1000 * pct(itls, 90),
        "itl_p99_ms": 1000 * pct(itls, 99),
        # Per request, after its first token; p99 is the slow tail (the 1st percentile).
        "req_tok_s_median": statistics.median(speeds),
        "req_tok_s_p99": pct(speeds, 1),
        "throughput_tok_s": sum(r.num_tokens for r in ok) / wall,
        "wall_s": wall,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; 0.0 elsewhere or once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def child_pids(pid: int) -> list[int]:
    """The direct children of a process (the server's engine-core processes)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


class CpuMeter:
    """CPU seconds the server's API process and its engine processes spend between start() and
    stop(), per output token: what serving costs beside the engine's step."""

    def __init__(self, server_pid: int):
        self.api_pid = server_pid
        self.engine_pids = child_pids(server_pid)

    def _now(self) -> tuple[float, float]:
        return cpu_seconds(self.api_pid), sum(cpu_seconds(p) for p in self.engine_pids)

    def start(self) -> None:
        self._start = self._now()

    def stop(self, num_tokens: int) -> dict:
        api, engine = (b - a for a, b in zip(self._start, self._now(), strict=True))
        per_token = 1e6 / max(num_tokens, 1)
        return {"api_cpu_us_per_token": api * per_token,
                "engine_cpu_us_per_token": engine * per_token}


_OFFLINE = """
import json, sys, time
from ladle import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
prompts = json.load(open(cfg.pop("prompts_file")))
output_len = cfg.pop("output_len")
llm = LLM(**cfg)
params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up
best = 0.0
for _ in range(2):  # the first full batch still meets new shapes: the faster of two runs
    t = time.perf_counter()
    out = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    best = max(best, sum(len(o.outputs[0].token_ids) for o in out) / dt)
print(json.dumps({"throughput_tok_s": best}))
"""


def offline_throughput(prompts: list[list[int]], output_len: int, engine_args: dict) -> float:
    """ladle.LLM on the same requests, in a separate process (nothing else running)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cfg = {**engine_args, "prompts_file": f.name, "output_len": output_len}
    out = subprocess.run([sys.executable, "-c", _OFFLINE, json.dumps(cfg)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["throughput_tok_s"]


def start_server(model: str, port: int, max_model_len: int, max_num_seqs: int):
    cmd = [sys.executable, "-m", "ladle.entrypoints.cli", "serve", model, "--port", str(port),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--disable-access-log", "--uvicorn-log-level", "warning"]
    log = tempfile.NamedTemporaryFile("w+", prefix="ladle-bench-serve-", suffix=".log",
                                      delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    sys.exit(f"server did not become healthy; see {log.name}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "ttft", "time to first token (ms)"),
                           (axes[1], "itl", "inter-token latency (ms)")):
        ax.plot(cs, [r[f"{key}_median_ms"] for r in rows], "o-", label="median")
        ax.plot(cs, [r[f"{key}_p99_ms"] for r in rows], "s--", label="p99")
        ax.set_title(title)
    axes[2].plot(cs, [r["throughput_tok_s"] for r in rows], "o-", label="server, all clients")
    axes[2].plot(cs, [r["req_tok_s_median"] for r in rows], "s--", label="per request, median")
    axes[2].set_title("output tokens/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def format_row(row: dict) -> str:
    line = (f"{row['concurrency']:>7} {row['requests']:>5} {row['ttft_median_ms']:>8.0f}/"
            f"{row['ttft_p99_ms']:<8.0f} {row['itl_median_ms']:>7.1f}/{row['itl_p90_ms']:.1f}/"
            f"{row['itl_p99_ms']:<8.1f} {row['req_tok_s_median']:>8.1f}/"
            f"{row['req_tok_s_p99']:<9.1f} {row['throughput_tok_s']:>11.1f}")
    if "api_cpu_us_per_token" in row:
        line += (f" {row['api_cpu_us_per_token']:>12.0f}/"
                 f"{row['engine_cpu_us_per_token']:<11.0f}")
    if row["errors"]:
        line += f"  ({row['errors']} errors)"
    return line


def main():
    ap = argparse.ArgumentParser(description="ladle serving benchmark (concurrency sweep)")
    ap.add_argument("--url", default=None, help="a running server; default: start one")
    ap.add_argument("--model", default="ladle-demo")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048, help="for a server started here")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="for a server started here")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    ap.add_argument("--reps", type=int, default=1,
                    help="run the highest level (and the offline comparison) this many times, "
                         "alternating; the ratio is the median")
    ap.add_argument("--plot", default="serve_bench.png")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interference", action="store_true",
                    help="only the interference case: 8 streams with and without 16 heavy "
                         "arrivals (100k-character prompts, 300-property schemas)")
    ap.add_argument("--arrivals", choices=["both", "prompts", "schemas"], default="both",
                    help="with --interference: which heavy arrivals to send")
    args = ap.parse_args()
    if args.interference:
        return run_interference(args)

    levels = sorted(args.concurrency)
    prompts = {c: workload(max(args.min_requests, c * args.requests_per_client),
                           tuple(args.input_len), args.seed + c) for c in levels}
    top = levels[-1]
    engine_args = {"model": args.model, "max_model_len": args.max_model_len,
                   "max_num_seqs": top}
    offline_args = (prompts[top], args.output_len, engine_args)
    compare_offline = not args.no_offline and args.url is None
    offlines: list[float] = []
    if compare_offline:
        # Before the server starts, so the two never share the CPU.
        offlines.append(offline_throughput(*offline_args))
        print(f"offline ladle.LLM on the {len(prompts[top])} requests of the {top}-client "
              f"level: {offlines[0]:.1f} output tok/s", flush=True)

    proc, url = server_for(args)
    meter = CpuMeter(proc.pid) if proc is not None and os.path.isdir("/proc") else None

    def level(c: int) -> dict:
        if meter is not None:
            meter.start()
        results, wall = asyncio.run(run_level(url, args.model, args.api_key, prompts[c],
                                              args.output_len, c))
        row = {"concurrency": c, **summarize(results, wall)}
        if meter is not None:
            row |= meter.stop(sum(r.num_tokens for r in results if r.error is None))
        return row

    try:
        rows = []
        print(f"{'clients':>7} {'reqs':>5} {'TTFT ms med/p99':>17} {'ITL ms med/p90/p99':>21} "
              f"{'req tok/s med/p99':>18} {'total tok/s':>11}"
              + (f" {'CPU us/token API/engine':>24}" if meter else ""))
        for c in levels:
            row = level(c)
            rows.append(row)
            print(format_row(row), flush=True)
        tops = [rows[-1]]
        for _ in range(args.reps - 1):  # the highest level again, alternating with offline
            if compare_offline:
                offlines.append(offline_throughput(*offline_args))
            tops.append(level(top))
            print(format_row(tops[-1]) + (f"  (offline {offlines[-1]:.1f} tok/s)"
                                          if compare_offline else ""), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if offlines:
        ratios = [t["throughput_tok_s"] / o for t, o in zip(tops, offlines, strict=True)]
        ratio = statistics.median(ratios)
        print(f"ratio serving ({top} clients) / offline ladle.LLM: {ratio:.2f}x (median of "
              f"{len(ratios)}: {', '.join(f'{r:.2f}' for r in ratios)}; last "
              f"{tops[-1]['throughput_tok_s']:.1f} / {offlines[-1]:.1f} tok/s)")
        rows[-1]["offline_tok_s"] = offlines
        rows[-1]["ratio_vs_offline"] = ratio
        rows[-1]["repetitions"] = tops[1:]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.plot:
        try:
            plot(rows, args.plot)
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[bench]'): no plot")


def server_for(args) -> tuple[subprocess.Popen | None, str]:
    """(the server process we started or None, its URL): --url, else a fresh `ladle serve`;
    warmed up with a few short requests either way."""
    proc, url = None, args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc, url = start_server(args.model, port, args.max_model_len, args.max_num_seqs)
    asyncio.run(run_level(url, args.model, args.api_key, workload(4, (16, 32), 99), 8, 4))
    return proc, url


def run_interference(args) -> None:
    proc, url = server_for(args)
    try:
        row = asyncio.run(interference(url, args.model, args.api_key, args.output_len,
                                       args.arrivals))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"8 streams, p99 inter-token gap: alone {row['itl_p99_alone_ms']:.1f} ms, with 16 "
          f"heavy arrivals {row['itl_p99_with_arrivals_ms']:.1f} ms -> ratio "
          f"{row['ratio']:.2f}x (arrivals answered {row['arrival_status_codes']}, stream "
          f"errors {row['errors']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
