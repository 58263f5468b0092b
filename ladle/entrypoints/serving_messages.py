"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API). A request becomes a
chat request (system and content blocks -> messages, tools with input_schema -> chat tools,
tool_choice any -> required, thinking -> enable_thinking and the thinking budget) and runs on
chat's path through `ChatTurn`. Parsed output becomes content blocks through `_BlockBuilder`,
whose events are the stream and whose blocks are the message. Errors on these routes are
Anthropic-shaped. A tool_result with is_error reaches the model as "Error: " + its content.
`thread` (the SDK's message threads) keeps each threaded conversation under its reply's id in a
`ResponseStore` of its own, so a continue sends only the new messages."""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ladle.entrypoints.chat_turn import (
    ChatStep,
    ChatTurn,
    chat_request,
    checked_text,
    renamed_error,
)
from ladle.entrypoints.common import (
    ServerState,
    base_request_id,
    log_request_fields,
    until_disconnect,
)
from ladle.entrypoints.serving_chat import harmony_prompt
from ladle.entrypoints.serving_responses import (
    STORE_MAX_BYTES,
    STORE_MAX_RESPONSES,
    ResponseStore,
    StoredResponse,
)
from ladle.frontend.async_llm import OverloadedError
from ladle.frontend.engine_client import EngineDeadError
from ladle.protocol.anthropic import (
    MAX_BLOCKS,
    CountTokensRequest,
    InputMessage,
    Message,
    MessagesRequest,
    Usage,
    anthropic_error_body,
)
from ladle.protocol.common import RequestError, unsupported
from ladle.protocol.responses import MAX_INPUT_ITEMS

logger = logging.getLogger("ladle.server")

_CHAT_NAMES = [
    (r"max_tokens", "max_tokens"),
    (r"messages.*", "messages"),
    (r"response_format.*", "output_config.format"),
    (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
    (r"tools\.(\d+)\.function\.(.*)", r"tools.\1.\2"),
    (r"stop", "stop_sequences"),
    (r"thinking_token_budget", "thinking"),
]
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
_UNSUPPORTED_BLOCKS = {"image": "image inputs", "document": "document inputs",
                       "search_result": "search results", "redacted_thinking":
                       "redacted thinking (ladle cannot decrypt it)"}


# ---- errors -----------------------------------------------------------------------------------
def anthropic_error(e: BaseException) -> JSONResponse:
    headers = error_code = None
    if isinstance(e, RequestError):
        status, message, headers = e.status_code, e.message, e.headers
        if e.code == THREAD_NOT_FOUND:
            error_code = e.code
    elif isinstance(e, OverloadedError):  # Anthropic's overload status
        status, message = 529, str(e)
        headers = {"Retry-After": str(e.retry_after_s)}
    elif isinstance(e, EngineDeadError):
        status, message = 500, f"the engine failed: {e}"
    else:
        logger.exception("internal error")
        status, message = 500, f"internal error: {type(e).__name__}: {e}"
    return JSONResponse(anthropic_error_body(message, status, error_code), status_code=status,
                        headers=headers)


def _validation_error(e: ValidationError) -> RequestError:
    first = e.errors()[0]
    original = first.get("ctx", {}).get("error")
    if isinstance(original, RequestError):  # RequestModel's text check names its own field
        return original
    loc = ".".join(str(x) for x in first.get("loc", ()) if not str(x).startswith(
        ("str", "list[", "function-", "constrained-")))
    if first.get("type") == "missing" and not loc:
        return RequestError("the body must be a JSON object")
    more = f" (and {len(e.errors()) - 1} more error(s))" if len(e.errors()) > 1 else ""
    return RequestError(f"{loc}: {first.get('msg')}{more}", param=loc or None)


async def _parse(raw: Request, cls: type) -> Any:
    try:
        body = json.loads(await raw.body())
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from e


# ---- Messages -> chat -------------------------------------------------------------------------
def _blocks(content: str | list[Any], path: str) -> str | list[Any]:
    if isinstance(content, str):
        return checked_text(content, path)
    if not isinstance(content, list):
        raise RequestError(f"{path}: must be a string or a list of blocks", param=path)
    if len(content) > MAX_BLOCKS:
        raise RequestError(f"{path}: {len(content)} blocks; at most {MAX_BLOCKS}", param=path)
    return content


def _blocks_text(content: str | list[Any], path: str) -> str:
    """Text blocks (or a string) as one string."""
    if isinstance(_blocks(content, path), str):
        return content
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise unsupported(f"{path}.{j}.type", f"{kind!r} blocks are not supported here "
                              "(text only)")
        texts.append(checked_text(block.get("text"), f"{path}.{j}.text"))
    return "".join(texts)


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """system and messages as chat messages: tool_use blocks become the assistant's tool
    calls, tool_result blocks become tool messages, thinking blocks the reasoning."""
    out: list[dict[str, Any]] = []
    if request.system is not None:
        out.append({"role": "system", "content": _blocks_text(request.system, "system")})
    known_calls: set[str] = set()
    for i, message in enumerate(request.messages):
        path = f"messages.{i}.content"
        blocks = _blocks(message.content, path)
        if isinstance(blocks, str) or message.role == "system":
            out.append({"role": message.role, "content": _blocks_text(blocks, path)})
            continue
        texts, calls, reasoning = [], [], None
        for j, block in enumerate(blocks):
            where = f"{path}.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(checked_text(block.get("text"), f"{where}.text"))
            elif kind == "tool_use" and message.role == "assistant":
                call_id = checked_text(block.get("id"), f"{where}.id")
                args = block.get("input")
                if not isinstance(args, dict):
                    raise RequestError(f"{where}.input: must be an object", param=f"{where}.input")
                known_calls.add(call_id)
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": checked_text(block.get("name"), f"{where}.name"),
                    "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and message.role == "user":
                call_id = checked_text(block.get("tool_use_id"), f"{where}.tool_use_id")
                if call_id not in known_calls:
                    raise RequestError(f"{where}.tool_use_id: no tool_use block with id "
                                       f"{call_id!r} comes before it", param=f"{where}.tool_use_id")
                content = _blocks_text(block.get("content") or "", f"{where}.content")
                if block.get("is_error"):
                    content = "Error: " + content
                out.append({"role": "tool", "tool_call_id": call_id, "content": content})
            elif kind == "thinking" and message.role == "assistant":
                reasoning = checked_text(block.get("thinking"), f"{where}.thinking")
            elif kind in _UNSUPPORTED_BLOCKS:
                raise unsupported(where, f"{_UNSUPPORTED_BLOCKS[kind]} are not supported by "
                                  "ladle")
            else:
                raise unsupported(f"{where}.type", f"{kind!r} blocks are not supported in "
                                  f"{message.role} messages by ladle")
        if message.role == "user" and not texts:
            continue  # tool results only
        msg: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise unsupported(f"tools.{i}.type", f"server tool {kind!r} is not supported by "
                              "ladle (custom tools with input_schema only)")
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise RequestError(f"tools.{i}.name: must match ^[a-zA-Z0-9_-]{{1,128}}$",
                               param=f"tools.{i}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise RequestError(f"tools.{i}.input_schema: required, a JSON Schema object",
                               param=f"tools.{i}.input_schema")
        fn = {"name": name, "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def to_chat(request: CountTokensRequest) -> dict[str, Any]:
    """The chat request's fields."""
    if request.container is not None or request.mcp_servers is not None:
        raise unsupported("container" if request.container is not None else "mcp_servers")
    fields: dict[str, Any] = {"model": request.model, "messages": chat_messages(request)}
    fields.update(request.sampling_extras())
    if request.tools:
        fields["tools"] = _chat_tools(request.tools)
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise RequestError("tool_choice.name: required when type is tool",
                                   param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    kwargs = dict(request.chat_template_kwargs or {})
    thinking = request.thinking
    if thinking is not None and thinking.type == "adaptive":
        raise unsupported("thinking", 'type "adaptive" is not supported (use "enabled" with '
                          "budget_tokens, or \"disabled\")")
    if thinking is not None and thinking.display == "omitted":
        raise unsupported("thinking.display", '"omitted" is not supported (ladle returns the '
                          "thinking text)")
    is_thinking = thinking is not None and thinking.type == "enabled"
    kwargs.setdefault("enable_thinking", is_thinking)
    if is_thinking:
        if thinking.budget_tokens is None:
            raise RequestError("thinking.budget_tokens: required when type is enabled",
                               param="thinking.budget_tokens")
        if request.thinking_token_budget is not None:
            raise RequestError("thinking_token_budget: give thinking.budget_tokens instead",
                               param="thinking_token_budget")
        fields["thinking_token_budget"] = thinking.budget_tokens
    fields["chat_template_kwargs"] = kwargs
    out = request.output_config
    if out is not None:
        if out.effort is not None:
            raise unsupported("output_config.effort")
        if out.format is not None:
            if out.format.get("type") != "json_schema" or not isinstance(
                    out.format.get("schema"), dict):
                raise RequestError('output_config.format: must be {"type": "json_schema", '
                                   '"schema": {...}}', param="output_config.format")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": out.format["schema"]}}
    return fields


def to_chat_message_request(request: MessagesRequest) -> dict[str, Any]:
    fields = to_chat(request)
    fields["max_tokens"] = request.max_tokens
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled" and (
            thinking.budget_tokens or 0) >= request.max_tokens:
        raise RequestError(f"thinking.budget_tokens: must be less than max_tokens "
                           f"({request.max_tokens})", param="thinking.budget_tokens")
    for name in ("temperature", "top_p"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.stop_sequences:
        fields["stop"] = request.stop_sequences
    return fields


# ---- threads: conversations kept by message id -----------------------------------------------
THREAD_NOT_FOUND = "thread_not_found"
"""error.details.error_code of a continue from a reply ladle does not keep: the SDK then resends
the whole conversation under a new thread."""


class StoredThread(BaseModel):
    """A threaded conversation through one reply: what a continue from that reply prepends.
    The store bounds it by its JSON size."""

    id: str
    """The reply's message id (the key)."""
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    messages: list[InputMessage]
    """Every request's messages and every reply (as blocks), through this reply."""


def thread_store(server: ServerState) -> ResponseStore:
    """The kept threads: a ResponseStore of their own, so bounded as stored responses are
    (STORE_MAX_RESPONSES replies, STORE_MAX_BYTES, oldest evicted); made on first use."""
    if "message_threads" not in server.extra:
        server.extra["message_threads"] = ResponseStore(STORE_MAX_RESPONSES, STORE_MAX_BYTES)
    return server.extra["message_threads"]


def continued(store: ResponseStore, request: MessagesRequest) -> MessagesRequest:
    """The request with the thread it continues in front: the thread's messages, system and
    tools (a continue leaves system and tools out: they are the thread's, as Anthropic's)."""
    for name in ("system", "tools"):
        if getattr(request, name) is not None:
            raise RequestError(f"{name}: a thread continue takes {name} from the thread; leave "
                               "it out, or create a new thread to change it", param=name)
    previous_id = request.thread.previous_message_id
    record = store.get(previous_id)
    if record is None:
        raise RequestError(
            f"thread.previous_message_id: no kept thread ends with message {previous_id!r} "
            f"(never created, or evicted: ladle keeps the last {store.max_responses} threaded "
            f"replies, {store.max_bytes // 2**20} MiB in all); send the whole conversation "
            'with thread {"type": "create"}', param="thread.previous_message_id",
            status_code=404, code=THREAD_NOT_FOUND)
    held: StoredThread = record.response
    messages = [*held.messages, *request.messages]
    if len(messages) > MAX_INPUT_ITEMS:
        raise RequestError(f"messages: the thread and the request hold {len(messages)} "
                           f"messages; at most {MAX_INPUT_ITEMS}", param="messages")
    return request.model_copy(update={"messages": messages, "system": held.system,
                                      "tools": held.tools})


def keep_thread(store: ResponseStore, request: MessagesRequest, message: Message) -> None:
    """Keep a threaded request's conversation and its finished reply under the reply's id."""
    if request.thread is None:
        return
    reply = InputMessage(role="assistant", content=message.content)
    store.put(StoredResponse(response=StoredThread(
        id=message.id, system=request.system, tools=request.tools,
        messages=[*request.messages, reply])))


# ---- content blocks and their events ----------------------------------------------------------
def _stop_reason(finish: str | None, stop: int | str | None) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class _BlockBuilder:
    """Parsed steps -> content blocks, and the stream events that build them
    (content_block_start, content_block_delta, content_block_stop)."""

    def __init__(self):
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> tool_use block
        self.arguments: dict[int, str] = {}  # block index -> the input JSON so far

    def add(self, step: ChatStep) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if step.reasoning:
            index = self._block({"type": "thinking", "thinking": "", "signature": ""}, events)
            self.blocks[index]["thinking"] += step.reasoning
            events.append(self._delta(index, {"type": "thinking_delta",
                                              "thinking": step.reasoning}))
        if step.content:
            index = self._block({"type": "text", "text": ""}, events)
            self.blocks[index]["text"] += step.content
            events.append(self._delta(index, {"type": "text_delta", "text": step.content}))
        for piece in step.tool_calls:
            if piece.id is not None:
                block = {"type": "tool_use", "id": piece.id, "name": piece.name or "",
                         "input": {}}
                self._block(block, events, force=True)
                self.calls[piece.index] = block
            block = self.calls.get(piece.index)
            if block is not None and piece.arguments:
                index = self.blocks.index(block)
                self.arguments[index] = self.arguments.get(index, "") + piece.arguments
                events.append(self._delta(index, {"type": "input_json_delta",
                                                  "partial_json": piece.arguments}))
        return events

    def finish(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self._close(events)
        for index, text in self.arguments.items():
            try:
                self.blocks[index]["input"] = json.loads(text)
            except ValueError:  # cut by max_tokens
                logger.info("tool_use input is not complete JSON: %r", text[:200])
        return events

    def _block(self, block: dict[str, Any], events: list[dict[str, Any]],
               force: bool = False) -> int:
        if force or self.open is None or self.open["type"] != block["type"]:
            self._close(events)
            self.blocks.append(block)
            self.open = block
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                           "content_block": dict(block)})
        return self.blocks.index(self.open)

    def _delta(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": delta}

    def _close(self, events: list[dict[str, Any]]) -> None:
        if self.open is not None:
            events.append({"type": "content_block_stop",
                           "index": self.blocks.index(self.open)})
            self.open = None


# ---- the endpoints ----------------------------------------------------------------------------
def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def create_message(server: ServerState, raw: Request) -> Response:
    try:
        request = await _parse(raw, MessagesRequest)
        model = server.check_model(request.model)
        store = thread_store(server)
        if request.thread is not None and request.thread.type == "continue":
            request = continued(store, request)
        message_id = f"msg_{uuid.uuid4().hex}"
        log_request_fields(request, message_id)
        if request.thinking is not None and request.thinking.display == "summarized":
            logger.info("%s: accepted without effect: thinking.display (the thinking blocks "
                        "hold the full thinking text)", message_id)
        fields = to_chat_message_request(request)
        try:
            turn = await ChatTurn.start(server, chat_request(fields, "messages"),
                                        f"{message_id}-{base_request_id(raw)}")
        except RequestError as e:
            raise renamed_error(e, _CHAT_NAMES) from e
        message = Message(id=message_id, model=model, usage=_usage(turn))
        keep = functools.partial(keep_thread, store, request)
        if request.stream:
            return StreamingResponse(_stream(turn, message, keep),
                                     media_type="text/event-stream")
        return await until_disconnect(raw, _full(turn, message, keep))
    except Exception as e:
        return anthropic_error(e)


async def _full(turn: ChatTurn, message: Message, keep: Callable[[Message], None]
                ) -> Response:
    builder = _BlockBuilder()
    finish = stop = None
    async for step in turn.steps():
        builder.add(step)
        if step.finish_reason is not None:
            finish, stop = step.finish_reason, step.stop_reason
    builder.finish()
    _finish_message(message, turn, builder, finish, stop)
    keep(message)
    return JSONResponse(message.model_dump())


def _finish_message(message: Message, turn: ChatTurn, builder: _BlockBuilder,
                    finish: str | None, stop: int | str | None) -> None:
    message.content = builder.blocks
    message.stop_reason, message.stop_sequence = _stop_reason(finish, stop)
    message.usage = _usage(turn)


def _usage(turn: ChatTurn) -> Usage:
    """The turn's usage so far, in Anthropic's accounting: the input fields are disjoint, so
    input_tokens + cache_read_input_tokens + cache_creation_input_tokens is the whole prompt (what
    count_tokens returns). Before the engine's first output nothing is known to be cached.
    ladle's prefix cache fills itself, with no cache_control breakpoints, so no token counts as
    cache creation (as with OpenAI's cached_tokens)."""
    return Usage(input_tokens=turn.num_prompt_tokens - turn.num_cached_tokens,
                 output_tokens=len(turn.output_token_ids),
                 cache_read_input_tokens=turn.num_cached_tokens)


async def _stream(turn: ChatTurn, message: Message, keep: Callable[[Message], None]
                  ) -> AsyncIterator[str]:
    try:
        yield _sse({"type": "message_start", "message": message.model_dump()})
        yield _sse({"type": "ping"})
        builder = _BlockBuilder()
        finish = stop = None
        async for step in turn.steps():
            for event in builder.add(step):
                yield _sse(event)
            if step.finish_reason is not None:
                finish, stop = step.finish_reason, step.stop_reason
        for event in builder.finish():
            yield _sse(event)
        _finish_message(message, turn, builder, finish, stop)
        keep(message)  # before message_stop: a client that saw it may continue at once
        yield _sse({"type": "message_delta",
                    "delta": {"stop_reason": message.stop_reason,
                              "stop_sequence": message.stop_sequence},
                    # cumulative, as Anthropic's: clients read the input counts here
                    "usage": message.usage.model_dump()})
        yield _sse({"type": "message_stop"})
    except Exception as e:
        body = json.loads(anthropic_error(e).body)
        yield f"event: error\ndata: {json.dumps(body)}\n\n"


async def count_tokens(server: ServerState, raw: Request) -> Response:
    """The prompt's token count: what the chat template makes of system, messages and tools."""
    try:
        request = await _parse(raw, CountTokensRequest)
        server.check_model(request.model)
        fields = to_chat(request)
        processor = server.engine.processor

        def render_and_count() -> int:  # in the preprocessing threads, off the event loop
            try:
                chat = chat_request(fields, "messages")
                if server.harmony is not None:  # gpt-oss: harmony, not a template
                    return len(harmony_prompt(server, chat).token_ids)
                prompt = processor.render_chat(chat.template_messages(), tools=chat.tools,
                                               chat_template_kwargs=chat.template_kwargs())
            except RequestError as e:
                raise renamed_error(e, _CHAT_NAMES) from e
            except ValueError as e:
                raise RequestError(str(e), param="messages") from e
            return len(processor.encode(prompt, add_special_tokens=chat.add_special_tokens))

        return JSONResponse({"input_tokens": await server.run_blocking(render_and_count)})
    except Exception as e:
        return anthropic_error(e)
