"""Memory under a long mixed run (issue 24, point 2): does a server's resident memory depend on
the history of its traffic, or only on its configuration?

Starts `ladle serve` (ladle-demo by default; extra arguments after `--` go to it), then sends
--requests mixed requests, --concurrency at a time:
  - routes: /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages;
  - streamed or not; n of 1-4 (chat, completions); logprobs (chat, completions);
  - a json_schema response format on a fifth of them (a few schemas, so compiles are cached);
  - stop strings; max_tokens 1-64;
  - prompts of 1 to --max-prompt tokens;
  - --disconnect-share of them (20%) dropped by the client mid-body or mid-stream.
Every --every requests it samples the resident memory (VmRSS) of the API process and of each
engine process, and prints it; at the end, each process's growth from request --warmup (500) to
the end, against the --budget-mib (32) the issue allows.

    python benchmarks/memory_soak.py [--requests 3000] [-- --batch-invariant]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

WORDS = ("the river stone blue seven apple run north quiet table window green paper song light "
         "market ocean city train garden winter music letter bridge cloud").split()
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                "maxItems": 3}}, "required": ["items"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "number"}}, "required": ["ok"]},
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def request(rng: random.Random, max_prompt: int) -> tuple[str, dict, bool]:
    """(path, body, stream) of one random request."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_prompt)))
    route = rng.choice(("chat", "completions", "responses", "messages"))
    stream = rng.random() < 0.5
    max_tokens = rng.randint(1, 64)
    schema = rng.choice(SCHEMAS) if rng.random() < 0.2 else None
    stop = [rng.choice(WORDS)] if rng.random() < 0.3 else None
    sampling = {"temperature": rng.choice((0.0, 0.7, 1.0)), "seed": rng.randrange(1000)}
    if route == "chat":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "n": rng.randint(1, 4), "stream": stream, "stop": stop, **sampling}
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
        if schema:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": schema}}
        return "/v1/chat/completions", body, stream
    if route == "completions":
        body = {"prompt": text, "max_tokens": max_tokens, "n": rng.randint(1, 4),
                "stream": stream, "stop": stop, **sampling}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        return "/v1/completions", body, stream
    if route == "responses":
        body = {"input": text, "max_output_tokens": max(16, max_tokens), "stream": stream,
                "store": False, "temperature": sampling["temperature"]}
        if schema:
            body["text"] = {"format": {"type": "json_schema", "name": "s", "schema": schema}}
        return "/v1/responses", body, stream
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream, "temperature": sampling["temperature"]}
    if stop:
        body["stop_sequences"] = stop
    return "/v1/messages", body, stream


async def send(client: httpx.AsyncClient, path: str, body: dict, stream: bool,
               disconnect: bool, rng: random.Random) -> str:
    """Returns "ok", "disconnected" or an error description."""
    try:
        if disconnect and rng.random() < 0.5:
            # mid-body: a declared length, then only part of the body, then gone
            raw = json.dumps(body).encode()
            reader, writer = await asyncio.open_connection(client.base_url.host,
                                                           client.base_url.port)
            writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Authorization: Bearer k\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
                         + raw[: len(raw) // 2])
            await writer.drain()
            writer.close()
            return "disconnected"
        if stream:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    return f"{r.status_code} {(await r.aread())[:200]!r}"
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if disconnect and n >= 3:
                        return "disconnected"  # leaving the block closes the stream
            return "ok"
        if disconnect:
            try:
                await client.post(path, json=body, timeout=0.05)
            except httpx.TimeoutException:
                return "disconnected"
            return "ok"
        r = await client.post(path, json=body)
        return "ok" if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


async def soak(url: str, pids: dict[str, int], args) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    trend: dict[str, list[float]] = {name: [] for name in pids}
    outcomes: dict[str, int] = {}
    done = 0
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits,
                                 headers={"Authorization": "Bearer k"}) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        queue: asyncio.Queue = asyncio.Queue()
        for _ in range(args.requests):
            path, body, stream = request(rng, args.max_prompt)
            queue.put_nowait((path, body | {"model": model}, stream,
                              rng.random() < args.disconnect_share))

        async def worker(wrng: random.Random):
            nonlocal done
            while not queue.empty():
                path, body, stream, disconnect = queue.get_nowait()
                result = await send(client, path, body, stream, disconnect, wrng)
                key = result if result in ("ok", "disconnected") else "error"
                outcomes[key] = outcomes.get(key, 0) + 1
                if key == "error" and outcomes[key] <= 5:
                    print("  error:", path, result, flush=True)
                done += 1
                if done % args.every == 0:
                    row = {name: rss_mib(pid) for name, pid in pids.items()}
                    for name, v in row.items():
                        trend[name].append(v)
                    print(f"{done:6} requests  " + "  ".join(f"{n} {v:7.1f} MiB"
                                                             for n, v in row.items())
                          + f"  {outcomes}", flush=True)

        t = time.perf_counter()
        await asyncio.gather(*(worker(random.Random(args.seed * 1000 + i))
                               for i in range(args.concurrency)))
        print(f"{args.requests} requests in {time.perf_counter() - t:.0f} s: {outcomes}")
    return trend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ladle-demo")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--disconnect-share", type=float, default=0.2)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--budget-mib", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_args", nargs="*", help="after --: more `ladle serve` arguments")
    args = ap.parse_args()
    from test_server import RemoteServer  # tests/: `ladle serve` on a free port, by PID

    server = RemoteServer("--api-key", "k", "--disable-log-stats", "--disable-access-log",
                          "--max-model-len", "4096", *args.serve_args, model=args.model,
                          timeout=300)
    try:
        pids = {"api": server.proc.pid}
        for i, pid in enumerate(server.engine_pids()):
            pids[f"engine{i}"] = pid
        print(f"ladle serve {args.model} {' '.join(args.serve_args)}: pids {pids}; "
              f"{args.requests} requests, {args.concurrency} at a time", flush=True)
        trend = asyncio.run(soak(server.url, pids, args))
        start = args.warmup // args.every - 1
        ok = True
        for name, values in trend.items():
            if len(values) <= start:
                continue
            growth = values[-1] - values[start]
            peak = max(values[start:]) - values[start]
            ok &= growth <= args.budget_mib
            print(f"{name}: {values[start]:.1f} MiB after {args.warmup} requests, "
                  f"{values[-1]:.1f} at the end: {growth:+.1f} MiB (peak {peak:+.1f}; budget "
                  f"{args.budget_mib:.0f})")
        print("within budget" if ok else "OVER BUDGET")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
