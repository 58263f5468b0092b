"""`ladle proxy`: an OpenAI-compatible front for prefill/decode disaggregation.

Each /v1/completions or /v1/chat/completions request goes first to a prefill server (round
robin over --prefill) as a one-token, non-streamed request carrying
`kv_transfer_params: {"do_remote_decode": true}`; the prefill server computes the prompt, keeps
its KV for the decode side and answers with `kv_transfer_params`. Then the original request,
unchanged but for those params, goes to a decode server (round robin over --decode), whose
answer (JSON or the SSE stream, byte for byte) is the client's. What the prefill request drops:
streaming, n / best_of / beam search, logprobs, stop strings, min_tokens, echo and structured
outputs stay (a grammar is compiled on both sides); the decode server samples every output
token. A request asking for prompt logprobs needs every prompt position's logits, so it goes to
the decode server alone. Other routes (/v1/models, /tokenize, ...) go to a decode server.

Headers pass through (Authorization included); a prefill server's error is the client's
answer, with its status.
"""


import argparse
import asyncio
import itertools
import logging

logger = logging.getLogger("ladle.proxy")

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# Request fields the prefill request leaves out (it returns one token that nobody reads).
_PREFILL_DROPS = ("stream", "stream_options", "n", "best_of", "use_beam_search", "logprobs",
                  "top_logprobs", "stop", "min_tokens", "echo", "max_completion_tokens",
                  "kv_transfer_params")
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the log says "
                   "which)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill servers (ladle serve with a producer --kv-transfer-config)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode servers (ladle serve with a consumer --kv-transfer-config)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one upstream request may take")


def prefill_body(body: dict) -> "dict | None":
    """The prefill server's request for `body`; None when the request must skip prefill."""
    if body.get("prompt_logprobs") is not None:
        return None
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out["max_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def build_app(prefill: list[str], decode: list[str], timeout_s: float):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="ladle proxy")
    prefills = itertools.cycle([u.rstrip("/") for u in prefill])
    decodes = itertools.cycle([u.rstrip("/") for u in decode])
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
    app.state.counts = {"prefill": 0, "decode": 0, "skipped_prefill": 0}

    def headers_of(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}

    async def forward(request: Request, url: str, body: bytes | None = None):
        """The upstream answer as the client's: JSON or bytes, or the SSE stream as it comes."""
        upstream = client.build_request(request.method, url, headers=headers_of(request),
                                        content=await request.body() if body is None else body,
                                        params=request.query_params)
        response = await client.send(upstream, stream=True)
        kind = response.headers.get("content-type", "")
        if kind.startswith("text/event-stream"):
            async def chunks():
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()  # a client that left: the decode server aborts
            return StreamingResponse(chunks(), status_code=response.status_code,
                                     media_type="text/event-stream")
        content = await response.aread()
        await response.aclose()
        return Response(content, status_code=response.status_code, media_type=kind or None)

    async def generate(request: Request):
        import json

        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the request body is not JSON",
                                           "type": "BadRequestError", "param": None,
                                           "code": 400}}, status_code=400)
        if not isinstance(body, dict):
            return await forward(request, next(decodes) + request.url.path)
        p_body = prefill_body(body)
        if p_body is None:
            app.state.counts["skipped_prefill"] += 1
        else:
            app.state.counts["prefill"] += 1
            answer = await client.post(next(prefills) + request.url.path, json=p_body,
                                       headers=headers_of(request))
            if answer.status_code != 200:
                return Response(answer.content, status_code=answer.status_code,
                                media_type=answer.headers.get("content-type"))
            params = answer.json().get("kv_transfer_params")
            if params is not None:
                body = {**body, "kv_transfer_params": params}
        app.state.counts["decode"] += 1
        return await forward(request, next(decodes) + request.url.path,
                             json.dumps(body).encode())

    async def guarded(request: Request):
        """An upstream server that cannot be reached or breaks off is a 502 naming it."""
        try:
            return await generate(request)
        except httpx.HTTPError as e:
            url = str(e.request.url) if getattr(e, "_request", None) is not None else "upstream"
            logger.warning("upstream %s failed: %s: %s", url, type(e).__name__, e)
            return JSONResponse({"error": {
                "message": f"ladle proxy: {url} failed ({type(e).__name__}: {e})",
                "type": "BadGatewayError", "param": None, "code": 502}}, status_code=502)

    for route in GENERATION_ROUTES:
        app.add_api_route(route, guarded, methods=["POST"])

    @app.get("/proxy/stats")
    async def stats():
        return app.state.counts

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(path: str, request: Request):
        return await forward(request, f"{next(decodes)}/{path}")

    @app.on_event("shutdown")
    async def close_client():
        await client.aclose()

    return app


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from ladle.entrypoints.api_server import listen_socket

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s [proxy] %(name)s: %(message)s")
    try:
        sock = listen_socket(args.host, args.port)
    except ValueError as e:
        print(f"ladle proxy: error: {e}")
        return 2
    # Listening from now on: a client that connects while the app starts waits in the backlog
    # instead of being refused (the log line below is what scripts wait for).
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    logger.info("proxy serving on http://%s:%d (prefill %s; decode %s)", host, port,
                ", ".join(args.prefill), ", ".join(args.decode))
    app = build_app(args.prefill, args.decode, args.timeout)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    asyncio.run(server.serve(sockets=[sock]))
    return 0
