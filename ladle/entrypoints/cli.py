"""The `ladle` command: `ladle serve [MODEL]`, `ladle bench serve`, `ladle bench throughput`.
Flags follow vLLM's names where vLLM has them."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys
from pathlib import Path

from ladle.config import EngineConfig

_DEFAULTS = EngineConfig()


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="ladle-demo",
                   help="checkpoint directory, hub id, or ladle-demo (default)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model` (default: the model argument)")
    p.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env LADLE_API_KEY)")
    p.add_argument("--tokenizer", default=None, help="default: the model's directory")
    p.add_argument("--dtype", default=_DEFAULTS.dtype,
                   choices=["auto", "bfloat16", "float16", "half", "float32", "float"])
    p.add_argument("--device", default=_DEFAULTS.device, help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's max_position_embeddings")
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.enable_prefix_caching)
    p.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV-cache size: bytes (4GiB, 512MB) or a fraction of free memory (0.3)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact KV-cache block count (overrides --kv-cache-memory)")
    p.add_argument("--max-logprobs", type=int, default=_DEFAULTS.max_logprobs)
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--logits-processors", nargs="+", default=None,
                   help="custom logits processors, as module:Class")
    p.add_argument("--structured-outputs-backend", default=_DEFAULTS.structured_outputs_backend,
                   choices=["auto", "xgrammar", "guidance"])
    p.add_argument("--reasoning-parser", default=None, help="e.g. qwen3, deepseek_r1")
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3}')
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser", default=None, help="e.g. hermes")
    # Limits and overload (README: "Limits and errors").
    p.add_argument("--max-n", type=int, default=_DEFAULTS.max_n,
                   help="most choices per request (n, best_of); OpenAI's limit is 128")
    p.add_argument("--scheduling-policy", default=_DEFAULTS.scheduling_policy,
                   choices=["fcfs", "priority"],
                   help="priority: requests' `priority` field orders the queue (lower first); "
                        "fcfs: a non-zero priority is a 400")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests that may wait beyond the --max-num-seqs running ones; past it "
                        "a request gets 503 with Retry-After")
    p.add_argument("--max-request-body-bytes", type=_size, default=4 * 2**20,
                   help="largest request body (bytes, or 4MiB, 512KB); larger gets 413")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (off: a 400)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-access-log", action="store_true",
                   help="no log line per HTTP request")
    p.add_argument("--disable-playground", action="store_true",
                   help="do not serve the web playground at /")


def _size(text: str) -> int:
    """A byte size for a flag: 4194304, 4MiB, 512KB."""
    from ladle.config import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_config(text: str):
    """The --speculative-config JSON, checked here so a bad field is a usage error."""
    from ladle.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_value(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_script(name: str, argv: list[str]) -> None:
    """Run benchmarks/<name>.py's main() with argv (the scripts stay runnable on their own)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    if not path.is_file():
        sys.exit(f"ladle bench: {path} not found (the benchmarks ship with the source tree)")
    spec = importlib.util.spec_from_file_location(f"ladle_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    sys.argv = [str(path), *argv]
    module.main()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ladle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="start the OpenAI-compatible server"))
    bench = sub.add_parser("bench", help="benchmarks (benchmarks/*.py)")
    bench.add_argument("which", choices=["serve", "throughput"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        _run_script(args.which, unknown + args.rest)
        return
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=os.environ.get("LADLE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [api] %(name)s: %(message)s")
    from ladle.entrypoints.api_server import run_server

    try:
        code = asyncio.run(run_server(args))
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
