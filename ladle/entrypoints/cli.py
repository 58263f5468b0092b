"""The `ladle` command: `ladle serve [MODEL]`, `ladle bench serve`, `ladle bench throughput`.
Flags follow vLLM's names and meanings, grouped in --help as vLLM groups them; a vLLM flag that
cannot apply on ladle is accepted and logged as having no effect (see docs/coming-from-vllm.md)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path

from ladle.config import QUANTIZATIONS, EngineConfig

_DEFAULTS = EngineConfig()


def human_readable_int(value: str) -> int:
    """vLLM's size syntax: 4096, 32k (= 32,000), 32K (= 32,768), 1m, 1.5M, 1g."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number (e.g. 4096, 32k, 32K, 1m)")
    number, unit = m.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    if "." in number and not unit:
        raise argparse.ArgumentTypeError(f"{value!r}: a fraction needs a unit (e.g. 1.5k)")
    return int(float(number) * scale)


def max_model_len(value: str) -> int:
    """--max-model-len: a size (human_readable_int), or auto / -1: the model's context length,
    shrunk to what the KV cache can hold (vLLM's meaning)."""
    if value.strip().lower() in ("auto", "-1"):
        return -1
    return human_readable_int(value)


def json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"key\": 1}'")
    return parsed


def json_list(value: str) -> list[str]:
    """CORS lists as vLLM takes them: a JSON list ('["*"]'); a bare word is a one-item list."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return [value]
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. \'["*"]\'')
    return parsed


def fraction(value: str) -> float:
    f = float(value)
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"{value}: must be in (0, 1]")
    return f


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, hub id, or ladle-demo (default)")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="read flags from a YAML file (keys are flag names); flags given on the "
                        "command line win")

    g = p.add_argument_group("Frontend", "the HTTP server and the OpenAI API")
    g.add_argument("--host", default="127.0.0.1",
                   help="bind address (vLLM binds every interface; ladle only the local one "
                        "unless --host 0.0.0.0)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env LADLE_API_KEY)")
    g.add_argument("--root-path", default=None,
                   help="the path prefix a reverse proxy serves ladle under (e.g. /llm)")
    g.add_argument("--allowed-origins", type=json_list, default=None,
                   help='CORS: origins allowed to call from a browser, e.g. \'["*"]\' (default: '
                        "no CORS headers)")
    g.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS methods")
    g.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--ssl-keyfile", default=None, help="serve https:// with this private key")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate chain")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client certs")
    g.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="client certificates: 0 none, 1 optional, 2 required (ssl.CERT_*)")
    g.add_argument("--chat-template", default=None,
                   help="the server's chat template: a file, or the template text itself")
    g.add_argument("--chat-template-content-format", default="auto",
                   choices=["auto", "string", "openai"],
                   help="how message content reaches the template: 'string' joins text parts; "
                        "'openai' keeps the list of parts; 'auto' picks from the template")
    g.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   help='template variables for every request, e.g. \'{"enable_thinking": '
                        "false}'; a request's chat_template_kwargs win")
    g.add_argument("--response-role", default="assistant",
                   help="the role of generated messages")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens as 'token_id:N' unless a request says otherwise")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="(always on in ladle: usage has prompt_tokens_details.cached_tokens)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="streams end with a usage chunk even without stream_options")
    g.add_argument("--enable-auto-tool-choice", action="store_true")
    g.add_argument("--tool-call-parser", default=None,
                   help="hermes, llama3_json, mistral, pythonic, qwen3_coder, openai (gpt-oss's "
                        "harmony), or a plugin's name")
    g.add_argument("--tool-parser-plugin", default=None, metavar="FILE.py",
                   help="a Python file that registers tool parsers with "
                        "@ToolParserManager.register_module(NAME)")
    g.add_argument("--reasoning-parser", default=None,
                   help="qwen3, deepseek_r1, openai_gptoss (gpt-oss's harmony), or a plugin's "
                        "name")
    g.add_argument("--reasoning-parser-plugin", default=None, metavar="FILE.py",
                   help="a Python file that registers reasoning parsers with "
                        "@ReasoningParserManager.register_module(NAME)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", "--disable-access-log",
                   dest="disable_access_log", action="store_true",
                   help="no log line per HTTP request")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request's id, sampling parameters and prompt length")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="(the default) do not log requests")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput / queue log line")
    g.add_argument("--disable-playground", action="store_true",
                   help="do not serve the web playground at /")

    g = p.add_argument_group("ModelConfig")
    g.add_argument("--model", default=None,
                   help="the same as the positional MODEL (vLLM's spelling)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model` (default: the model argument)")
    g.add_argument("--tokenizer", default=None, help="default: the model's directory")
    g.add_argument("--revision", default=None, help="hub branch, tag or commit to download")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; ladle never runs a checkpoint's code (only its own "
                        "architectures load)")
    g.add_argument("--dtype", default=_DEFAULTS.dtype,
                   choices=["auto", "bfloat16", "float16", "half", "float32", "float"])
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                   help="gguf: weights from a GGUF file (the default for one); none: its "
                        "blocks dequantized into --dtype at load; int8: a safetensors "
                        "checkpoint's weights quantized at load to int8 per output channel, "
                        "with int8 activations per token (W8A8; the default for a "
                        "compressed-tensors int8 checkpoint)")
    g.add_argument("--max-model-len", type=max_model_len, default=None,
                   help="context length: 4096, 32k, 32K, 1m, or auto (default: the model's)")
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the checkpoint's generation_config.json), "
                        "vllm (ignore it), or a directory holding one")
    g.add_argument("--override-generation-config", type=json_object, default=None,
                   help='sampling defaults on top, e.g. \'{"temperature": 0.2}\'')
    g.add_argument("--enforce-eager", action="store_true",
                   help="accepted; ladle always runs eagerly (no CUDA graphs)")
    g.add_argument("--max-logprobs", type=int, default=_DEFAULTS.max_logprobs)
    g.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "raw_logits", "processed_logprobs",
                            "processed_logits"],
                   help="what logprobs report: before or after the sampling transforms")
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    g.add_argument("--logits-processors", nargs="+", default=None,
                   help="custom logits processors, as module:Class")

    g = p.add_argument_group("LoadConfig")
    g.add_argument("--download-dir", default=None, help="where hub downloads go")

    g = p.add_argument_group("DeviceConfig")
    g.add_argument("--device", default=_DEFAULTS.device, help="auto, cpu, cuda, cuda:1, ...")

    g = p.add_argument_group("ParallelConfig", "docs/scaling.md")
    g.add_argument("--data-parallel-size", "-dp", type=_positive_int,
                   default=_DEFAULTS.data_parallel_size,
                   help="engine-core processes behind the one API process, each a full engine "
                        "with its own KV cache; requests go to the least loaded (README: "
                        '"Data parallel")')
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int,
                   default=_DEFAULTS.tensor_parallel_size,
                   help="ranks that each hold 1/N of every layer (one process per rank)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int,
                   default=_DEFAULTS.pipeline_parallel_size,
                   help="stages that each hold a contiguous run of the layers (x -tp ranks "
                        "each; one process per rank); the last stage samples")
    g.add_argument("--pp-layer-partition", type=_layer_partition, default=None,
                   metavar="N,N,...",
                   help="layers of each pipeline stage, first to last (default: even, earlier "
                        "stages taking the remainder)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"],
                   default=_DEFAULTS.distributed_executor_backend,
                   help="how tensor/pipeline-parallel workers start: mp (processes on this host) or ray "
                        "(actors on a Ray cluster: RAY_ADDRESS, `ray start`, or a local one)")
    g.add_argument("--distributed-timeout", type=float, default=_DEFAULTS.distributed_timeout,
                   help="seconds a collective may take before the engine stops (startup: 10x)")

    g = p.add_argument_group("CacheConfig", "the KV cache")
    g.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    g.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                   help="fraction of the device's memory (host memory on CPU) ladle may use; "
                        "the KV cache gets what remains after the weights")
    g.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory",
                   default=None,
                   help="KV-cache size: bytes (4GiB, 512MB) or a fraction of free memory (0.3)")
    g.add_argument("--num-gpu-blocks-override", "--num-kv-blocks", dest="num_kv_blocks",
                   type=int, default=None, help="exact KV-cache block count (wins over the rest)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.enable_prefix_caching)
    g.add_argument("--prefix-state-slots", type=int, default=_DEFAULTS.prefix_state_slots,
                   help="hybrid models: linear-layer state snapshots the prefix cache keeps "
                        "(each the size of one request's state, inside the KV-cache memory); "
                        "default max-num-seqs, 0 turns prefix caching off for them")

    g = p.add_argument_group("ModelConfig (numerics)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.batch_invariant,
                   help="every row's numbers independent of the batch, the prefill chunking, "
                        "the prefix cache and speculation (CPU kernels; README: 'Same request, "
                        "same tokens')")

    g = p.add_argument_group("SchedulerConfig")
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=human_readable_int,
                   default=_DEFAULTS.max_num_batched_tokens)

    g = p.add_argument_group("StructuredOutputsConfig")
    g.add_argument("--structured-outputs-backend", default=_DEFAULTS.structured_outputs_backend,
                   choices=["auto", "xgrammar", "guidance"])
    g.add_argument("--structured-outputs-compile-timeout", type=float,
                   default=_DEFAULTS.structured_outputs_compile_timeout,
                   help="seconds a grammar compile may run before its request fails")
    g.add_argument("--structured-outputs-cache-bytes", type=int,
                   default=_DEFAULTS.structured_outputs_cache_bytes,
                   help="bytes of compiled grammars kept for reuse (LRU; 0 = no cache)")

    g = p.add_argument_group("SpeculativeConfig")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3} or '
                        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}')

    g = p.add_argument_group("KVTransferConfig", "prefill/decode disaggregation "
                             '(docs/scaling.md; README: "Prefill/decode disaggregation")')
    g.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                   help='JSON as vLLM\'s, e.g. {"kv_connector": "SharedStorageConnector", '
                        '"kv_role": "kv_both", "kv_connector_extra_config": '
                        '{"shared_storage_path": "/tmp/ladle-kv"}}')

    g = p.add_argument_group("Limits and overload", 'README: "Limits and errors"')
    g.add_argument("--max-n", type=int, default=_DEFAULTS.max_n,
                   help="most choices per request (n, best_of); OpenAI's limit is 128")
    g.add_argument("--scheduling-policy", default=_DEFAULTS.scheduling_policy,
                   choices=["fcfs", "priority"],
                   help="priority: requests' `priority` field orders the queue (lower first); "
                        "fcfs: a non-zero priority is a 400")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests that may wait beyond the --max-num-seqs running ones; past it "
                        "a request gets 503 with Retry-After")
    g.add_argument("--max-request-body-bytes", type=_size, default=4 * 2**20,
                   help="largest request body (bytes, or 4MiB, 512KB); larger gets 413")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (off: a 400)")


def _layer_partition(text: str) -> list[int]:
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if not parts or any(n < 1 for n in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: layers per stage as positive "
                                         "integers separated by commas, e.g. 14,14")
    return parts


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


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


def _kv_transfer_config(text: str):
    from ladle.distributed.kv_transfer import KVTransferConfig

    try:
        return KVTransferConfig.from_value(text)
    except ValueError as e:
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


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the `ladle` parser, its `serve` subparser)."""
    parser = argparse.ArgumentParser(prog="ladle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    add_serve_args(serve)
    proxy = sub.add_parser("proxy", help="prefill/decode disaggregation: an OpenAI-compatible "
                           "front for prefill and decode servers")
    from ladle.entrypoints.proxy import add_proxy_args

    add_proxy_args(proxy)
    bench = sub.add_parser("bench", help="benchmarks (benchmarks/*.py)")
    bench.add_argument("which", choices=["serve", "throughput"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    return parser, serve


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`ladle serve` flags (argv without "serve"), with --config's file read in: the file's
    settings come first, so the command line wins. Exits with a usage error on a bad flag."""
    from ladle.entrypoints.config_file import config_file_argv

    _, serve = build_parser()
    args = serve.parse_args(argv)
    if args.config is not None:
        try:
            file_argv = config_file_argv(args.config, serve)
        except ValueError as e:
            serve.error(str(e))
        args = serve.parse_args([*file_argv, *argv])
    if args.model is not None and args.model_tag is not None and args.model != args.model_tag:
        serve.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model or args.model_tag or "ladle-demo"
    args.command = "serve"
    # The model file's and the engine settings' own checks (EngineConfig) as usage errors now,
    # not a traceback when the server builds its engine. A broken checkpoint is one line that
    # names the file (the usage text would only bury it).
    from ladle.models.loader import ModelLoadError

    try:
        _check_model_file(args.model, args.quantization, args.tensor_parallel_size)
        from ladle.entrypoints.api_server import engine_config_from_args

        engine_config_from_args(args)
    except ModelLoadError as e:
        serve.exit(2, f"{serve.prog}: error: {e}\n")
    except ValueError as e:
        serve.error(str(e))
    return args


def _check_model_file(model: str, quantization: str | None, tensor_parallel_size: int) -> None:
    """A GGUF file's header, metadata and tensor table are read now (milliseconds, memory-
    mapped), so a truncated, corrupt or unsupported file is a usage error naming the file
    before any process starts; the engine reads it again to load. So is a --quantization the
    local checkpoint cannot take, or a quantization_config ladle cannot run. (The rest of a
    local checkpoint, its weights' headers and its tokenizer, is checked by the API process
    while the engine starts: AsyncLLM.start.)"""
    path = Path(model).expanduser()
    from ladle.models.loader import check_quantization

    if path.is_file():
        from ladle.models.gguf import hf_config_from_gguf, open_gguf

        hf_config_from_gguf(open_gguf(path))
        check_quantization(path, quantization)
    elif (path / "config.json").is_file():
        from ladle.models.loader import read_hf_config

        check_quantization(path, quantization, read_hf_config(path), tensor_parallel_size)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        from ladle.entrypoints.proxy import run_proxy

        sys.exit(run_proxy(build_parser()[0].parse_args(argv)))
    if argv[:1] != ["serve"]:  # bench, --help, or a usage error
        args, unknown = build_parser()[0].parse_known_args(argv)
        _run_script(args.which, unknown + args.rest)
        return
    args = parse_serve_args(argv[1:])
    logging.basicConfig(level=os.environ.get("LADLE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s [api] %(name)s: %(message)s")
    from ladle.entrypoints.api_server import run_server
    from ladle.lifetime import end_process

    def serve() -> None:
        try:
            code = asyncio.run(run_server(args))
        except KeyboardInterrupt:
            code = 130
        sys.exit(code)

    end_process(serve)  # (the engines are stopped by run_server's lifespan)


if __name__ == "__main__":
    main()
