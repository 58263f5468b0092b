"""What the endpoint handlers share: the server's state, OpenAI-shaped error bodies, SSE
framing, merging the streams of a batch of prompts, and cancelling a non-streaming request
when its client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ladle.frontend.async_llm import AsyncLLM
from ladle.frontend.engine_client import EngineDeadError
from ladle.frontend.output_processor import ChoiceDelta
from ladle.protocol.common import ErrorInfo, ErrorResponse, RequestError
from ladle.protocol.sampling import SamplingFields, _param_of

logger = logging.getLogger("ladle.server")
T = TypeVar("T")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error",
                422: "invalid_request_error", 500: "server_error", 503: "server_error"}


@dataclass
class ServerState:
    """Everything a handler needs, made once at startup (app.state.server)."""

    engine: AsyncLLM
    served_model_names: list[str]
    api_key: str | None = None
    # Chat: tool calls (tool_choice "auto" needs both), reasoning, and the structured-output
    # backend the API process checks constraints with.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    structured_outputs_backend: str = "auto"
    # vLLM's server-wide request defaults (ladle serve --help, Frontend group).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template_content_format: str = "auto"  # auto | string | openai
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False  # streams end with usage without stream_options
    logprobs_mode: str = "raw_logprobs"
    log_requests: bool = False  # one log line per request (--enable-log-requests)
    # The tokenizer marks a parser's tags as special tokens: parsed requests keep special tokens
    # in the text (skip_special_tokens off) so the parsers see the tags.
    keep_parser_markers: bool = False
    # The model speaks harmony (gpt-oss): its marker ids (entrypoints/harmony.HarmonyTokens);
    # chats are rendered, constrained and parsed per that format. None: it does not.
    harmony: Any = None
    # Limits (README: "Limits and errors").
    max_request_body_bytes: int = 4 * 2**20
    trust_request_chat_template: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Template rendering, tokenization and constraint checks of a request run here, off the
    # event loop, so one large request cannot stall every other stream.
    preprocess_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="ladle-preprocess"))

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) in the preprocessing threads."""
        return await asyncio.get_running_loop().run_in_executor(self.preprocess_pool, fn, *args)

    def check_chat_template(self, template: str | None) -> None:
        """A request's own chat_template is Jinja the server would run: only with
        --trust-request-chat-template (vLLM's flag)."""
        if template is not None and not self.trust_request_chat_template:
            raise RequestError("chat_template: a per-request chat template needs the server "
                               "flag --trust-request-chat-template; accepted: leave it out",
                               param="chat_template")
    # The Responses API's stored responses (serving_responses.ResponseStore; build_app makes it)
    # and the web playground at / (--disable-playground turns it off).
    response_store: Any = None
    enable_playground: bool = True

    def check_model(self, model: str | None) -> str:
        """The served name the response reports; RequestError 404 for an unknown model."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise RequestError(f"model: the model `{model}` does not exist (served: "
                               f"{', '.join(self.served_model_names)})", param="model",
                               status_code=404, code="model_not_found")
        return model


def error_body(message: str, status_code: int, param: str | None = None,
               code: str | int | None = None, type: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=type or _ERROR_TYPES.get(status_code, "server_error"),
                     param=param, code=code if code is not None else status_code)
    return ErrorResponse(error=info).model_dump()


def error_response(message: str, status_code: int, param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param, code), status_code=status_code,
                        headers=headers)


def request_error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.status_code, e.param, e.code, e.type),
                        status_code=e.status_code, headers=e.headers)


def with_kv_transfer_params(body: dict, states) -> dict:
    """A response body with the prefill server's `kv_transfer_params` (vLLM's top-level field),
    when the engine gave them (a request sent with do_remote_decode to a prefill server)."""
    for state in states:
        if state.kv_transfer_params is not None:
            return {**body, "kv_transfer_params": state.kv_transfer_params}
    return body


def as_request_error(e: ValueError) -> RequestError:
    """A ValueError from input processing (its message starts with the field name)."""
    if isinstance(e, RequestError):
        return e
    return RequestError(str(e), param=_param_of(str(e)))


def check_engine_error(d: ChoiceDelta) -> None:
    """Raise the error a choice ended with: 400 when the request was at fault (the engine checks
    again what this process checked), 500 when ladle was (a crash in its step)."""
    if d.error is None:
        return
    if d.is_server_error:
        raise RequestError(d.error, status_code=500, type="server_error", code="engine_error")
    raise RequestError(d.error)


def base_request_id(raw: Request) -> str:
    """The client's X-Request-Id when it sent one, else a random id."""
    return raw.headers.get("x-request-id") or uuid.uuid4().hex


def unique_id(request_id: str) -> str:
    """The engine's id for a request: the response id plus a random part, since clients may
    reuse an X-Request-Id."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def log_request_fields(request: SamplingFields, request_id: str) -> None:
    """OpenAI fields with no effect on the output are accepted, and logged here."""
    set_fields = [n for n in getattr(request, "NO_EFFECT_FIELDS", ())
                  if getattr(request, n, None) is not None]
    if set_fields:
        logger.info("%s: accepted without effect: %s", request_id,
                    ", ".join(f"{n}={getattr(request, n)!r}" for n in set_fields))


# ---- SSE --------------------------------------------------------------------------------------
def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(e: BaseException) -> str:
    """The frame that ends a failed stream (the openai client raises APIError on it)."""
    if isinstance(e, RequestError):
        body = error_body(e.message, e.status_code, e.param, e.code, e.type)
    elif isinstance(e, EngineDeadError):
        body = error_body(f"the engine failed: {e}", 500, code="engine_dead")
    else:
        body = error_body(f"internal error: {type(e).__name__}: {e}", 500)
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

C = TypeVar("C", bound=BaseModel)


def ending_apart(choice: C, **blank: Any) -> list[C]:
    """The stream choices to send for one step of a choice. A choice ends with a chunk of its own
    that carries finish_reason (and stop_reason) and nothing else, after its last content, the
    way OpenAI ends one: the openai SDK's stream helper closes a choice on the chunk with
    finish_reason before it reads that chunk's tool calls, so a call sent with the end never
    gets its arguments.done event. blank: the content fields and their empty values (chat: an
    empty delta; completions: text ""); a last step with no content sends only the end."""
    if choice.finish_reason is None:
        return [choice]
    end = choice.model_copy(update=blank)
    body = choice.model_copy(update={"finish_reason": None, "stop_reason": None})
    if all(_carries_nothing(getattr(body, name)) for name in blank):
        return [end]
    return [body, end]


def _carries_nothing(value: Any) -> bool:
    if isinstance(value, BaseModel):
        return all(_carries_nothing(v) for v in value.__dict__.values())
    return not value


# ---- running requests -------------------------------------------------------------------------
async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) from several async iterators as items arrive. Closing this closes
    (and so aborts) the ones still running."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnect(raw: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler, cancelling it (which aborts its requests in the engine) as
    soon as the client disconnects."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.cancelled() and task.done():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let its cleanup (the engine abort) run
    logger.info("client disconnected; request aborted")
    return Response(status_code=499)
