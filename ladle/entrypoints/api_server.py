"""The API process: the FastAPI app (routes, OpenAI-shaped errors, Bearer auth on /v1/*) and
`run_server`, which starts the engine process, serves until a signal or until the engine dies,
and returns the exit code (non-zero when the engine died)."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

import ladle
from ladle.config import EngineConfig
from ladle.entrypoints.common import (
    ServerState,
    as_request_error,
    error_body,
    error_response,
    request_error_response,
)
from ladle.entrypoints.serving_chat import (
    create_chat_completion,
    harmony_prompt,
    resolve_content_format,
)
from ladle.entrypoints.serving_completion import create_completion
from ladle.entrypoints.serving_messages import count_tokens, create_message
from ladle.entrypoints.serving_responses import (
    ResponseStore,
    cancel_response,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from ladle.frontend.async_llm import AsyncLLM, OverloadedError
from ladle.frontend.detokenizer import token_to_str
from ladle.frontend.engine_client import EngineDeadError
from ladle.native_memory import freeze_startup_heap
from ladle.protocol.anthropic import anthropic_error_body
from ladle.protocol.chat import ChatCompletionRequest
from ladle.protocol.common import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
)
from ladle.protocol.completion import CompletionRequest
from ladle.protocol.responses import ResponsesRequest
from ladle.reasoning import REASONING_PARSERS as ENGINE_REASONING
from ladle.tokenizer import generation_defaults

logger = logging.getLogger("ladle.server")
PLAYGROUND_DIR = Path(__file__).parent / "playground"
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}


def build_app(server: ServerState, root_path: str = "", cors: dict | None = None) -> FastAPI:
    """cors: CORSMiddleware's options (allow_origins, ...), None for no CORS headers."""
    app = FastAPI(title="ladle", version=ladle.__version__, docs_url=None, redoc_url=None)
    app.state.server = server
    _add_error_handlers(app)
    app.add_middleware(_AuthAndRequestId, api_key=server.api_key)
    app.add_middleware(_BodyChecks, max_bytes=server.max_request_body_bytes,
                       on_disconnect=lambda: server.engine.metrics.record_body_disconnect())
    if root_path:
        app.add_middleware(_PrefixedPaths, root_path=root_path)
    if cors is not None:  # outermost: preflights are answered before auth looks at them
        app.add_middleware(CORSMiddleware, **cors)
    engine = server.engine

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return error_response(f"the engine is not running: {engine.dead_error}", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": ladle.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.model_path,
                                         max_model_len=engine.max_model_len)
                               for name in server.served_model_names])

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await create_completion(server, request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(server, request, raw)

    # The Responses API (OpenAI) and the Messages API (Anthropic; its own error shape).
    if server.response_store is None:
        server.response_store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest, raw: Request) -> Response:
        return await create_response(server, request, raw)

    @app.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str) -> Response:
        return get_response(server, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def responses_input_items(response_id: str, raw: Request) -> Response:
        return list_input_items(server, response_id, raw.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str) -> Response:
        return delete_response(server, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def responses_cancel(response_id: str) -> Response:
        return await cancel_response(server, response_id)

    @app.post("/v1/messages")
    async def messages(raw: Request) -> Response:
        return await create_message(server, raw)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(raw: Request) -> Response:
        return await count_tokens(server, raw)

    # The web playground: one static page that talks to /v1/chat/completions.
    if server.enable_playground:
        @app.get("/", include_in_schema=False)
        async def playground() -> FileResponse:
            return FileResponse(PLAYGROUND_DIR / "index.html")

        app.mount("/playground", StaticFiles(directory=PLAYGROUND_DIR), name="playground")

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        server.check_model(request.model)
        server.check_chat_template(request.chat_template)
        return await server.run_blocking(_tokenize, request)

    def _tokenize(request: TokenizeRequest) -> TokenizeResponse:
        processor = engine.processor
        try:
            if request.messages is not None and server.harmony is not None:
                chat = ChatCompletionRequest.model_validate({
                    "messages": request.messages, "tools": request.tools,
                    "add_generation_prompt": request.add_generation_prompt,
                    "continue_final_message": request.continue_final_message,
                    "chat_template_kwargs": request.chat_template_kwargs})
                ids = harmony_prompt(server, chat).token_ids
                return _tokenized(ids, request)
            if request.messages is not None:
                text = processor.render_chat(
                    request.messages, tools=request.tools,
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    chat_template=request.chat_template,
                    chat_template_kwargs=(server.default_chat_template_kwargs
                                          | (request.chat_template_kwargs or {})))
                add_special = bool(request.add_special_tokens)
            else:
                text = request.prompt
                add_special = request.add_special_tokens is not False
        except ValueError as e:
            raise as_request_error(e) from e
        return _tokenized(processor.encode(text, add_special_tokens=add_special), request)

    def _tokenized(ids: list[int], request: TokenizeRequest) -> TokenizeResponse:
        strs = [token_to_str(engine.tokenizer, t) for t in ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < engine.processor.vocab_size]
        if bad:
            raise RequestError(f"tokens: token id(s) {bad[:5]} outside the vocabulary (0 to "
                               f"{engine.processor.vocab_size - 1})", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(request.tokens))

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, e: RequestError) -> JSONResponse:
        return request_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        original = first.get("ctx", {}).get("error")
        if isinstance(original, RequestError):  # raised by a validator with its own param
            return request_error_response(original)
        # ("body", "messages", 0, "role") -> "messages.0.role"; union branches that pydantic
        # adds to the location ("str", "list[int]", "function-after[...]") are left out.
        loc = [str(x) for x in first.get("loc", ())[1:]
               if isinstance(x, int) or (x.isidentifier() and x not in _TYPE_NAMES)]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            param = None
        elif first.get("type") == "missing" and not loc:
            message = "the body must be a JSON object"
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(
                first.get("msg", "invalid request"))
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error(s))"
        return error_response(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(str(e.detail), e.status_code, headers=e.headers)

    @app.exception_handler(OverloadedError)
    async def on_overloaded(_: Request, e: OverloadedError) -> JSONResponse:
        return error_response(str(e), 503, code="overloaded",
                              headers={"Retry-After": str(e.retry_after_s)})

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(f"the engine failed: {e}", 500, code="engine_dead")

    @app.exception_handler(Exception)
    async def on_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


class _AuthAndRequestId:
    """ASGI middleware: Bearer auth on /v1/* when an API key is set, and X-Request-Id echoed
    on the response. Plain ASGI (no BaseHTTPMiddleware) so streams pass through untouched."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        # The route's path: behind --root-path the scope's path starts with the prefix.
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if self.api_key is not None and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.api_key}"
            # Anthropic's clients send the key as x-api-key.
            x_api_key = headers.get(b"x-api-key", b"").decode("latin-1")
            if not (hmac.compare_digest(auth.encode(), expected.encode())
                    or hmac.compare_digest(x_api_key.encode(), self.api_key.encode())):
                message = ("invalid or missing API key: send 'Authorization: Bearer <key>' or "
                           "'x-api-key: <key>'")
                body = (anthropic_error_body(message, 401)
                        if scope["path"].startswith("/v1/messages")
                        else error_body(message, 401, code="invalid_api_key"))
                response = JSONResponse(body, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        request_id = headers.get(b"x-request-id")
        if request_id is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        return await self.app(scope, receive, send_with_id)


class _PrefixedPaths:
    """--root-path: uvicorn reports every path under the prefix, so a proxy that strips the
    prefix works as it is; this also serves a proxy that forwards the prefix (/llm/v1/models)."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            route = scope["path"].removeprefix(scope.get("root_path", "") or "")
            if route == self.root_path or route.startswith(self.root_path + "/"):
                scope = dict(scope, path=scope["path"][: len(scope["path"]) - len(route)]
                             + (route[len(self.root_path):] or "/"))
        return await self.app(scope, receive, send)
class _BodyChecks:
    """ASGI middleware for request bodies, before any handler (or JSON parser) sees them: a
    body larger than max_bytes gets 413 (a declared Content-Length is checked at once; a
    chunked body is read up to the limit), and a POST whose Content-Type is not JSON gets 415.
    A body is read whole here and replayed to the app, so a client that disconnects mid-body
    is one abort in one place for every route (counted by `on_disconnect`, logged at debug,
    nothing sent): no handler sees a half body or starlette's ClientDisconnect."""

    def __init__(self, app, max_bytes: int, on_disconnect: Callable[[], None] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        kind = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and kind != b"application/json" and not kind.endswith(
                b"+json"):
            body = error_body(f"Content-Type {kind.decode('latin-1')!r} is not supported; send "
                              "the body as JSON with 'Content-Type: application/json'", 415,
                              code="unsupported_media_type")
            return await JSONResponse(body, status_code=415)(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._reject(scope, receive, send)
        if length in (None, b"0") and b"chunked" not in headers.get(b"transfer-encoding", b""):
            return await self.app(scope, receive, send)  # no body
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                logger.debug("client disconnected mid-body: %s %s", scope["method"],
                             scope["path"])
                if self.on_disconnect is not None:
                    self.on_disconnect()
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._reject(scope, receive, send)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send):
        body = error_body(f"the request body is larger than the server's limit of "
                          f"{self.max_bytes} bytes (--max-request-body-bytes)", 413,
                          code="request_too_large")
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(
            scope, receive, send)


# ---- running ----------------------------------------------------------------------------------
def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_state_slots=args.prefix_state_slots,
        batch_invariant=args.batch_invariant,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        scheduling_policy=args.scheduling_policy,
        logits_processors=list(args.logits_processors or []),
        structured_outputs_backend=args.structured_outputs_backend,
        structured_outputs_compile_timeout=args.structured_outputs_compile_timeout,
        structured_outputs_cache_bytes=args.structured_outputs_cache_bytes,
        # The engine knows the built-in reasoning formats only (a plugin's tags are text to it).
        reasoning_parser=(args.reasoning_parser if args.reasoning_parser in ENGINE_REASONING
                          else None),
        speculative_config=getattr(args, "speculative_config", None),
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pp_layer_partition=args.pp_layer_partition,
        distributed_executor_backend=args.distributed_executor_backend,
        distributed_timeout=args.distributed_timeout,
        kv_transfer_config=args.kv_transfer_config,
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn, with a drain on SIGTERM/SIGINT: stop accepting connections, let in-flight
    requests finish for `shutdown_timeout` seconds, then end the rest with an OpenAI-shaped 503
    (an SSE error event for streams) so every client gets an answer. A second signal exits at
    once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
            return super().handle_exit(sig, frame)
        super().handle_exit(sig, frame)  # uvicorn stops accepting and waits for the requests
        error = RequestError("the server is shutting down; retry on another instance",
                             status_code=503, type="server_error", code="server_shutting_down")
        self.engine.refusing = error
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, self.shutdown_timeout,
                                           self._end_in_flight, error)
        logger.info("shutting down: waiting up to %.0f s for %d request(s) in flight",
                    self.shutdown_timeout, self.engine.num_in_flight)

    def _end_in_flight(self, error: RequestError) -> None:
        n = self.engine.fail_in_flight(error)
        if n:
            logger.warning("shutdown grace period over: ended %d request(s) with an error", n)


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads (as vLLM does): a port in
    use fails at once instead of after minutes of loading, and nothing that starts meanwhile
    (the engine's own sockets, any outgoing connection's ephemeral port) can take it."""
    if not 0 <= port <= 65535:  # getaddrinfo would wrap 70000 to 4464 without a word
        raise ValueError(f"--port {port}: must be in 0..65535 (0: any free port)")
    # The family as uvicorn picks it: IPv6 for an address with ':', else IPv4 ("localhost" is
    # 127.0.0.1 even where the resolver lists ::1 first).
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, family=socket.AF_INET6 if ":" in host else socket.AF_INET,
            type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: not an address this machine can bind ({e})") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); "
                         "pass a free --port, or 0 for any") from e
    return sock


async def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or until the engine process dies (1)."""
    names = args.served_model_name or [args.model]
    try:
        chat_template, generation = check_frontend_args(args)
        sock = listen_socket(args.host, args.port)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    try:
        return await _serve(args, names, chat_template, generation, sock)
    finally:
        sock.close()


async def _serve(args: argparse.Namespace, names: list[str], chat_template, generation,
                 sock: socket.socket) -> int:
    config = engine_config_from_args(args)
    try:
        engine = await AsyncLLM.start(config, model_name=names[0])
    except (EngineDeadError, ValueError) as e:  # names the engine, the checkpoint's file at
        # fault (ModelLoadError, from the checks while the engine starts) or the flag
        logger.error("%s", e)
        return 1
    try:
        engine.processor.generation_defaults = generation_defaults(
            engine.model_path, generation[0], generation[1])
    except ValueError as e:
        logger.error("%s", e)
        await engine.shutdown()
        return 2
    logger.info("sampling defaults from --generation-config %s: %s", generation[0],
                engine.processor.generation_defaults or "none (ladle's own)")
    if chat_template is not None:  # every chat render (and /tokenize) uses it from now on
        engine.tokenizer.chat_template = chat_template
    try:
        harmony = _harmony_tokens(engine, args, chat_template)
    except ValueError as e:
        logger.error("%s", e)
        await engine.shutdown()
        return 2
    server = ServerState(
        engine=engine, served_model_names=names, api_key=args.api_key,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        structured_outputs_backend=args.structured_outputs_backend,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        force_include_usage=args.enable_force_include_usage,
        logprobs_mode=args.logprobs_mode, log_requests=args.enable_log_requests,
        keep_parser_markers=_markers_are_special(engine.tokenizer, args),
        harmony=harmony,
        chat_template_content_format=resolve_content_format(
            args.chat_template_content_format, engine.tokenizer.chat_template),
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_playground=not args.disable_playground,
    )
    # Every engine runs --max-num-seqs; the waiting allowance is the server's, not per engine.
    engine.max_in_flight = (config.data_parallel_size * config.max_num_seqs
                            + args.max_waiting_requests)
    cors = None
    if args.allowed_origins is not None:
        cors = {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
                "allow_headers": args.allowed_headers,
                "allow_credentials": args.allow_credentials}
    app = build_app(server, root_path=args.root_path or "", cors=cors)
    freeze_startup_heap()  # the tokenizer, templates and the app: walked by no collection
    uv = _DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log,
        # uvicorn cancels what is still running after this; the drain ends it first, cleanly.
        timeout_graceful_shutdown=args.shutdown_timeout + 5, timeout_keep_alive=30,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
    ), engine, args.shutdown_timeout)
    stats_task = None if args.disable_log_stats else asyncio.create_task(_log_stats(engine))

    def stop_after_engine_death() -> None:
        # In-flight requests were just failed; give their error bodies a moment to go out.
        asyncio.get_running_loop().call_later(0.5, setattr, uv, "should_exit", True)

    engine.on_dead(stop_after_engine_death)
    logger.info("serving %s (%s) on %s://%s:%d%s", names[0], engine.model_path,
                "https" if args.ssl_certfile else "http", args.host, sock.getsockname()[1],
                args.root_path or "")
    # uvicorn handles SIGINT/SIGTERM while it serves, then re-raises the signal under the
    # handler that was there before; make that one a no-op so the engine is shut down here.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        await uv.serve(sockets=[sock])
    finally:
        if stats_task is not None:
            stats_task.cancel()
        await engine.shutdown()
    if engine.dead_error is not None:
        logger.error("exiting: %s", engine.dead_error)
        return 1
    return 0


# ---- vLLM's launch flags: checks and notes ---------------------------------------------------
_NO_EFFECT_NOTES = {
    "trust_remote_code": "ladle never runs code from a checkpoint; only its own architectures "
                         "(Llama, Qwen2, Qwen3) load",
    "enforce_eager": "ladle always runs eagerly (it captures no CUDA graphs)",
    "enable_prompt_tokens_details": "usage always carries prompt_tokens_details.cached_tokens",
}


def check_frontend_args(args: argparse.Namespace) -> tuple[str | None, tuple[str, dict]]:
    """Settle the flags the API process owns before the engine starts: (the chat template text
    or None, (generation-config source, overrides)). Logs the flags that have no effect here and
    downloads a hub model at --revision into --download-dir. ValueError names the flag."""
    for name, note in _NO_EFFECT_NOTES.items():
        if getattr(args, name):
            logger.info("--%s: accepted, no effect: %s", name.replace("_", "-"), note)
    if args.allowed_origins is None:
        logger.info("CORS: off (vLLM allows every origin by default; pass --allowed-origins "
                    "to let browsers call ladle)")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile: give both to serve https://")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path: must start with '/', got {args.root_path!r}")
    _resolve_hub_model(args)
    chat_template = None
    if args.chat_template is not None:
        from ladle.entrypoints.serving_chat import load_chat_template
        chat_template = load_chat_template(args.chat_template)
    from ladle.parsers import load_plugins
    load_plugins(tool_parser_plugin=args.tool_parser_plugin,
                 reasoning_parser_plugin=args.reasoning_parser_plugin,
                 tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    source = args.generation_config
    if source not in ("auto", "vllm") and not Path(source).is_dir():
        raise ValueError(f"--generation-config: {source!r} is not auto, vllm, or a directory")
    generation_defaults(Path(source), "vllm", args.override_generation_config)  # checks the keys
    from ladle.parsers.reasoning import ReasoningParserManager

    is_harmony = getattr(ReasoningParserManager.parsers.get(args.reasoning_parser), "is_harmony",
                         False)
    if (args.reasoning_parser is not None and args.reasoning_parser not in ENGINE_REASONING
            and not is_harmony):
        logger.info("--reasoning-parser %s: a plugin; thinking_token_budget and structured "
                    "outputs after the reasoning need a built-in one (%s)", args.reasoning_parser,
                    ", ".join(ENGINE_REASONING))
    return chat_template, (source, args.override_generation_config or {})


def _resolve_hub_model(args: argparse.Namespace) -> None:
    """--revision / --download-dir apply to a hub id; the engine then loads the local copy."""
    local = Path(args.model).expanduser().is_dir() or args.model == "ladle-demo"
    if local:
        for flag in ("revision", "download_dir"):
            if getattr(args, flag) is not None:
                logger.info("--%s: no effect: the model is a local directory",
                            flag.replace("_", "-"))
        return
    if args.revision is None and args.download_dir is None:
        return  # the engine fetches it (default revision and cache)
    from huggingface_hub import snapshot_download
    try:
        path = snapshot_download(args.model, revision=args.revision, cache_dir=args.download_dir,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja",
                                                 "*.txt", "*.tiktoken"])
    except Exception as e:
        raise ValueError(f"--model {args.model} (revision {args.revision}): download failed "
                         f"({type(e).__name__}: {e})") from e
    if not args.served_model_name:
        args.served_model_name = [args.model]
    args.model = path


def _harmony_tokens(engine: AsyncLLM, args: argparse.Namespace, chat_template: str | None):
    """The harmony marker ids when the model speaks harmony (gpt-oss), else None; ValueError
    when it does and its tokenizer lacks a marker."""
    from ladle.entrypoints.harmony import HarmonyTokens, harmony_reason

    why = harmony_reason(engine.model_path, args.reasoning_parser, args.tool_call_parser)
    if why is None:
        return None
    tokens = HarmonyTokens.from_tokenizer(engine.tokenizer, why)
    logger.info("%s: the model speaks harmony: chats are rendered in harmony, their channels "
                "parsed into reasoning, content and tool calls", why)
    if chat_template is not None:
        logger.info("--chat-template: no effect on chats: the model speaks harmony")
    return tokens


def _markers_are_special(tokenizer, args: argparse.Namespace) -> bool:
    """Whether the tokenizer marks a parser's tags as special tokens (skip_special_tokens would
    delete them from the text before the parser sees them)."""
    from ladle.parsers.choice import parser_markers

    markers = set(parser_markers(args.reasoning_parser, args.tool_call_parser))
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    hit = sorted(markers & special)
    if hit:
        logger.info("the tokenizer marks %s as special tokens: parsed chat requests keep "
                    "special tokens in their text", ", ".join(hit))
    return bool(hit)


async def _log_stats(engine: AsyncLLM, interval: float = 10.0) -> None:
    """vLLM's periodic stats line (off with --disable-log-stats), while there is traffic; one
    per engine when there are several."""
    last = None
    while True:
        await asyncio.sleep(interval)
        all_stats = engine.metrics.engine_stats
        tokens = engine.metrics.num_generation_tokens
        if tokens == last and not any(s.get("num_running", 0) or s.get("num_waiting", 0)
                                      for s in all_stats):
            continue
        for i, s in enumerate(all_stats):
            logger.info("%srunning: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
                        "prefix-cache hit rate: %.1f%%, generated tokens: %d",
                        f"engine {i}: " if len(all_stats) > 1 else "",
                        s.get("num_running", 0), s.get("num_waiting", 0),
                        100 * s.get("kv_cache_usage", 0.0),
                        100 * s.get("prefix_cache_hits", 0)
                        / max(s.get("prefix_cache_queries", 0), 1), tokens)
        last = tokens
