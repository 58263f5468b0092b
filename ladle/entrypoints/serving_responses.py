"""POST /v1/responses (OpenAI's Responses API), GET / DELETE /v1/responses/{id} and POST
/v1/responses/{id}/cancel. A request becomes a chat request (input items -> messages, function
tools -> chat tools, text.format -> response_format) and runs on chat's path through `chat_turn.ChatTurn`, the
one place this module and the Messages API touch chat's processing and output parsing. Parsed
output becomes output items through `_OutputBuilder`, whose events are the stream and whose
items are the response, so the two always agree. Responses are kept in a `ResponseStore`
(bounded in count and bytes, oldest evicted) for GET and previous_response_id."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
from ladle.protocol.common import RequestError, effort_thinks, unsupported
from ladle.protocol.responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)

logger = logging.getLogger("ladle.server")

STORE_MAX_RESPONSES = 1024
STORE_MAX_BYTES = 64 * 2**20


# ---- Responses -> chat ------------------------------------------------------------------------
_CHAT_NAMES = [
    (r"max_tokens", "max_output_tokens"),
    (r"messages.*", "input"),
    (r"response_format\.json_schema\.schema", "text.format.schema"),
    (r"response_format.*", "text.format"),
    (r"tools\.(\d+)\.function\.(.*)", r"tools.\1.\2"),
    (r"thinking_token_budget", "thinking_token_budget"),
    (r"reasoning_effort", "reasoning.effort"),
]
_UNSUPPORTED_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


def _content_text(content: Any, path: str) -> str:
    """Message content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return checked_text(content, path)
    if not isinstance(content, list):
        raise RequestError(f"{path}: must be a string or a list of content parts", param=path)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _UNSUPPORTED_PARTS:
            raise unsupported(f"{path}.{j}", f"{_UNSUPPORTED_PARTS[kind]} inputs are not "
                              "supported by ladle (text only)")
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise RequestError(f"{path}.{j}.type: {kind!r} is not a content part ladle knows; "
                               "accepted: input_text, output_text", param=f"{path}.{j}.type")
        texts.append(checked_text(part.get("refusal" if kind == "refusal" else "text"),
                                  f"{path}.{j}"))
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]], history: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """The request's input as chat messages (after `history`, which only seeds known call
    ids). function_call items join the assistant message before them; reasoning items become
    the next assistant message's reasoning_content."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    known_calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    prev_kind = None
    for i, item in enumerate(items):
        path = f"input.{i}"
        if not isinstance(item, dict):
            raise RequestError(f"{path}: must be an object", param=path)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{path}.role: {role!r}; accepted: user, system, developer, "
                                   "assistant", param=f"{path}.role")
            msg = {"role": "system" if role == "developer" else role,
                   "content": _content_text(item.get("content"), f"{path}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            call_id = checked_text(item.get("call_id"), f"{path}.call_id")
            call = {"id": call_id, "type": "function", "function": {
                "name": checked_text(item.get("name"), f"{path}.name"),
                "arguments": checked_text(item.get("arguments"), f"{path}.arguments")}}
            known_calls.add(call_id)
            if prev_kind in ("message", "function_call") and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            call_id = checked_text(item.get("call_id"), f"{path}.call_id")
            if call_id not in known_calls:
                raise RequestError(f"{path}.call_id: no function_call with call_id {call_id!r} "
                                   "comes before it (in input or the previous response)",
                                   param=f"{path}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _content_text(item.get("output"), f"{path}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise RequestError(f"{path}.content: must be a list", param=f"{path}.content")
            reasoning = "".join(checked_text(p.get("text") if isinstance(p, dict) else None,
                                      f"{path}.content.{j}") for j, p in enumerate(parts))
        else:
            raise unsupported(f"{path}.type", f"input items of type {kind!r} are not supported "
                              "by ladle (message, function_call, function_call_output, "
                              "reasoning)")
        prev_kind = kind
    return messages


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                   "reasoning": "rs"}


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input (already checked by input_messages) as the items OpenAI lists for a
    response: each with an id (the client's, or a new one) and a status, a message's string
    content as one input_text (output_text for an assistant) part."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        record = {**item, "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):
            part = ({"type": "output_text", "text": item["content"], "annotations": []}
                    if item.get("role") == "assistant"
                    else {"type": "input_text", "text": item["content"]})
            record["content"] = [part]
        out.append({"id": item.get("id") or _new_id(_ITEM_ID_PREFIX[kind]), **record,
                    "status": item.get("status") or "completed"})
    return out


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(f"tools.{i}.type", f"built-in tool {kind!r} is not supported by "
                              "ladle (function tools only)")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", f"{choice!r}: only none, auto, required and "
                      '{"type": "function", "name": ...} are supported by ladle')


def check_request(request: ResponsesRequest) -> None:
    request.check_bounds()
    for name in ("conversation", "prompt", "top_logprobs"):
        if getattr(request, name) is not None:
            raise unsupported(name)
    if request.truncation == "auto":
        raise unsupported("truncation", '"auto" is not supported (only "disabled")')
    if request.include:
        raise unsupported("include", f"{request.include}: ladle has no extra output to include")
    if request.text is not None and request.text.verbosity is not None:
        raise unsupported("text.verbosity")
    if request.background and not request.store:
        raise RequestError("background: needs store to be true", param="background")
    if request.background and request.stream:
        raise unsupported("background", "cannot be combined with stream in ladle")
    unknown = set(request.stream_options or {}) - {"include_obfuscation"}
    if unknown:
        raise RequestError(f"stream_options: unknown field(s) {sorted(unknown)}; accepted: "
                           "include_obfuscation", param="stream_options")


def to_chat(request: ResponsesRequest, history: list[dict[str, Any]]
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the chat request's fields, the conversation without instructions: what a later
    previous_response_id continues)."""
    check_request(request)
    conversation = history + input_messages(request.input, history)
    messages = conversation
    if request.instructions is not None:
        messages = [{"role": "system", "content": request.instructions}, *conversation]
    fields: dict[str, Any] = {"model": request.model, "messages": messages}
    fields.update(request.sampling_extras())
    for name in ("temperature", "top_p", "parallel_tool_calls", "stop"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.max_output_tokens is not None:
        fields["max_tokens"] = request.max_output_tokens
    if request.tools:
        fields["tools"] = _chat_tools(request.tools)
    if request.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(request.tool_choice)
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "schema", "schema": fmt.schema_, "strict": fmt.strict}}
    kwargs = dict(request.chat_template_kwargs or {})
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is not None:  # chat maps it to the thinking switch (protocol.common.effort_thinks)
        fields["reasoning_effort"] = effort
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    return fields, conversation


# ---- output items and their events ------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _OutputBuilder:
    """Parsed steps -> the response's output items, and the stream events that build them (in
    OpenAI's order: item added, content part added, deltas, text done, part done, item done)."""

    def __init__(self):
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.calls: dict[int, FunctionCallItem] = {}  # the parser's call index -> item

    def add(self, step: ChatStep) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if step.reasoning:
            item = self._item(ReasoningItem, events)
            item.content[0].text += step.reasoning
            events.append(self._text_event("response.reasoning_text.delta", item,
                                           delta=step.reasoning))
        if step.content:
            item = self._item(OutputMessage, events)
            item.content[0].text += step.content
            events.append(self._text_event("response.output_text.delta", item,
                                           delta=step.content, logprobs=[]))
        for piece in step.tool_calls:
            if piece.id is not None:
                self._close(events, "completed")
                call = FunctionCallItem(id=_new_id("fc"), call_id=piece.id, name=piece.name or "")
                self._open(call, events)
                self.calls[piece.index] = call
            call = self.calls.get(piece.index)
            if call is not None and piece.arguments:
                call.arguments += piece.arguments
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": call.id, "output_index": self.items.index(call),
                               "delta": piece.arguments})
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self._close(events, status)
        return events

    def _item(self, cls: type, events: list[dict[str, Any]]):
        if not isinstance(self.open, cls):
            self._close(events, "completed")
            item = cls(id=_new_id("rs" if cls is ReasoningItem else "msg"))
            self._open(item, events)
            part = ReasoningText(text="") if cls is ReasoningItem else OutputText(text="")
            item.content.append(part)
            events.append({"type": "response.content_part.added", "item_id": item.id,
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "part": part.model_dump()})
        return self.open

    def _open(self, item: OutputItem, events: list[dict[str, Any]]) -> None:
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": item.model_dump()})

    def _text_event(self, kind: str, item: OutputMessage | ReasoningItem, **fields) -> dict:
        return {"type": kind, "item_id": item.id, "output_index": self.items.index(item),
                "content_index": 0, **fields}

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item.status = status
        index = self.items.index(item)
        if isinstance(item, FunctionCallItem):
            events.append({"type": "response.function_call_arguments.done", "item_id": item.id,
                           "output_index": index, "name": item.name,
                           "arguments": item.arguments})
        else:
            part = item.content[0]
            done = ("response.reasoning_text.done" if isinstance(item, ReasoningItem)
                    else "response.output_text.done")
            extra = {} if isinstance(item, ReasoningItem) else {"logprobs": []}
            events.append(self._text_event(done, item, text=part.text, **extra))
            events.append(self._text_event("response.content_part.done", item,
                                           part=part.model_dump()))
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": item.model_dump()})


def assistant_message(items: list[OutputItem]) -> dict[str, Any]:
    """The output as a chat message (for the next turn of previous_response_id)."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if isinstance(item, ReasoningItem):
            msg["reasoning_content"] = "".join(p.text for p in item.content)
        elif isinstance(item, OutputMessage):
            msg["content"] += "".join(p.text for p in item.content)
        else:
            msg.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}})
    return msg


# ---- the store --------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]] = field(default_factory=list)
    """Input and output as chat messages, without instructions: what previous_response_id
    continues (complete once the response has finished)."""
    task: asyncio.Task | None = None  # a background run
    num_bytes: int = 0
    input_items: list[dict[str, Any]] = field(default_factory=list)
    """The request's input as items with ids, oldest first: what GET .../input_items lists."""


class ResponseStore:
    """Stored responses in memory, bounded in count and in bytes (their JSON size); adding past
    either bound evicts the oldest (cancelling it if it still runs in the background)."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES,
                 max_bytes: int = STORE_MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.records: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def get(self, response_id: str) -> StoredResponse | None:
        return self.records.get(response_id)

    def put(self, record: StoredResponse) -> bool:
        """Add a record, or update one in place (it keeps its age); False when it alone is over
        the byte bound (then it is not kept)."""
        rid = record.response.id
        size = (len(record.response.model_dump_json()) + len(json.dumps(record.conversation))
                + len(json.dumps(record.input_items)))
        old = self.records.get(rid)
        if old is not None:
            self.num_bytes -= old.num_bytes
        if size > self.max_bytes:
            self.records.pop(rid, None)
            logger.warning("%s: %d bytes, over the response store's %d; not stored", rid, size,
                           self.max_bytes)
            return False
        record.num_bytes = size
        self.records[rid] = record  # an existing key keeps its place: eviction is by age
        self.num_bytes += size
        while len(self.records) > self.max_responses or self.num_bytes > self.max_bytes:
            victim = next(k for k in self.records if k != rid)
            self.pop(victim)
            logger.info("response store full: evicted %s", victim)
        return True

    def pop(self, response_id: str) -> StoredResponse | None:
        """Remove a record; a background run of it is cancelled (no one can fetch it any
        more)."""
        record = self.records.pop(response_id, None)
        if record is not None:
            self.num_bytes -= record.num_bytes
            if record.task is not None and not record.task.done():
                record.task.cancel()
        return record


# ---- the endpoints ----------------------------------------------------------------------------
def _not_found(response_id: str) -> RequestError:
    return RequestError(f"response_id: no stored response {response_id!r} (never stored, "
                        "evicted, or deleted)", param="response_id", status_code=404,
                        code="not_found")


def sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _ResponseRun:
    """One response being made: its stream events (numbered), and its record in the store."""

    def __init__(self, server: ServerState, turn: ChatTurn, record: StoredResponse,
                 is_stored: bool):
        self.store = server.response_store
        self.turn = turn
        self.record = record
        self.response = record.response
        self.conversation = record.conversation  # the input; the output is added at the end
        self.is_stored = is_stored
        self.has_been_stored = False
        self.num_events = 0

    def _numbered(self, event: dict[str, Any]) -> dict[str, Any]:
        event["sequence_number"] = self.num_events
        self.num_events += 1
        return event

    def _save(self) -> None:
        """Store the record (again: its bytes change), unless it was evicted or deleted since
        it was first stored."""
        rid = self.response.id
        if self.is_stored and (not self.has_been_stored or self.store.get(rid) is self.record):
            self.has_been_stored = True
            self.store.put(self.record)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        r = self.response
        r.status = "in_progress"
        self._save()
        try:
            yield self._numbered({"type": "response.created", "response": r.model_dump()})
            yield self._numbered({"type": "response.in_progress", "response": r.model_dump()})
            builder = _OutputBuilder()
            r.output = builder.items
            finish = None
            async for step in self.turn.steps():
                for event in builder.add(step):
                    yield self._numbered(event)
                finish = step.finish_reason or finish
            status = "incomplete" if finish == "length" else "completed"
            for event in builder.finish(status):
                yield self._numbered(event)
            turn = self.turn
            num_output = len(turn.output_token_ids)
            num_reasoning = turn.num_reasoning_tokens(
                any(isinstance(i, ReasoningItem) for i in builder.items))
            r.usage = ResponseUsage(
                input_tokens=turn.num_prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=turn.num_cached_tokens),
                output_tokens=num_output,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=num_reasoning),
                total_tokens=turn.num_prompt_tokens + num_output)
            if status == "incomplete":
                r.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            r.status = status
            self.record.conversation = [*self.conversation, assistant_message(builder.items)]
            self._save()
            yield self._numbered({"type": f"response.{status}", "response": r.model_dump()})
        except Exception as e:
            r.status = "failed"
            code = "invalid_request" if isinstance(e, RequestError) else "server_error"
            r.error = ResponseError(code=code, message=str(e))
            self._save()
            raise
        finally:
            if r.status in ("queued", "in_progress"):  # the client left, or a cancel
                r.status = "cancelled"
                self._save()

    async def stream(self) -> AsyncIterator[str]:
        try:
            async for event in self.events():
                yield sse_event(event)
        except Exception:
            logger.exception("%s failed", self.response.id)
            yield sse_event(self._numbered({"type": "response.failed",
                                            "response": self.response.model_dump()}))

    async def full(self) -> Response:
        async for _ in self.events():
            pass
        return JSONResponse(self.response.model_dump())

    async def background(self) -> None:
        try:
            async for _ in self.events():
                pass
        except Exception:
            logger.exception("%s (background) failed", self.response.id)


async def create_response(server: ServerState, request: ResponsesRequest,
                          raw: Request) -> Response:
    model = server.check_model(request.model)
    response_id = _new_id("resp")
    log_request_fields(request, response_id)
    if request.reasoning is not None and (request.reasoning.summary
                                          or request.reasoning.generate_summary):
        logger.info("%s: accepted without effect: reasoning.summary (the reasoning item holds "
                    "the full reasoning text)", response_id)
    if (request.stream_options or {}).get("include_obfuscation") is not None:
        logger.info("%s: accepted without effect: stream_options.include_obfuscation (nothing "
                    "is padded)", response_id)
    effort = request.reasoning.effort if request.reasoning is not None else None
    if (effort is not None and effort_thinks(effort) and server.reasoning_parser is None
            and server.harmony is None):
        logger.info("%s: reasoning.effort %r turns thinking on, but without --reasoning-parser "
                    "the reasoning stays in the output text", response_id, effort)
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        previous = server.response_store.get(request.previous_response_id)
        if previous is None:
            error = _not_found(request.previous_response_id)
            error.param = "previous_response_id"
            raise error
        if previous.response.status not in ("completed", "incomplete"):
            raise RequestError(f"previous_response_id: response {previous.response.id!r} is "
                               f"{previous.response.status}; only a finished response can be "
                               "continued", param="previous_response_id")
        history = previous.conversation
    fields, conversation = to_chat(request, history)
    try:
        turn = await ChatTurn.start(server, chat_request(fields, "input"),
                                    f"{response_id}-{base_request_id(raw)}")
    except RequestError as e:
        raise renamed_error(e, _CHAT_NAMES) from e
    response = ResponseObject(
        id=response_id, status="queued", model=model, instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id, reasoning=request.reasoning,
        store=request.store, background=request.background,
        temperature=turn.processed.params.temperature, top_p=turn.processed.params.top_p,
        text={"format": (request.text.format.model_dump(by_alias=True, exclude_none=True)
                         if request.text is not None and request.text.format is not None
                         else {"type": "text"})},
        tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
        tools=[{**t, "strict": bool(t.get("strict"))} for t in request.tools or ()],
        user=request.user, metadata=request.metadata or {})
    record = StoredResponse(response, conversation, input_items=input_items(request.input))
    run = _ResponseRun(server, turn, record, is_stored=request.store)
    if request.background:
        run._save()
        record.task = asyncio.create_task(run.background())
        return JSONResponse(response.model_dump())
    if request.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream")
    return await until_disconnect(raw, run.full())


def get_response(server: ServerState, response_id: str) -> Response:
    record = server.response_store.get(response_id)
    if record is None:
        raise _not_found(response_id)
    return JSONResponse(record.response.model_dump())


# GET .../input_items: OpenAI's page size bounds (1-100, default 20), and ladle's bound on the
# `include` values it is sent (none changes a text-only input item).
INPUT_ITEMS_LIMIT, INPUT_ITEMS_MAX_LIMIT, INPUT_ITEMS_MAX_INCLUDE = 20, 100, 16


def list_input_items(server: ServerState, response_id: str, query) -> Response:
    """A stored response's input items, one page of OpenAI's cursor list: `order` (desc, the
    default: newest first, or asc), `limit` (1-100), `after` (an item id of this list)."""
    record = server.response_store.get(response_id)
    if record is None:
        raise _not_found(response_id)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError(f"order: {order!r}; accepted: asc, desc", param="order")
    raw_limit = query.get("limit", str(INPUT_ITEMS_LIMIT))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= INPUT_ITEMS_MAX_LIMIT:
        raise RequestError(f"limit: {raw_limit[:32]!r}; accepted: an integer from 1 to "
                           f"{INPUT_ITEMS_MAX_LIMIT}", param="limit")
    include = query.getlist("include") + query.getlist("include[]")
    if len(include) > INPUT_ITEMS_MAX_INCLUDE or any(len(v) > 100 for v in include):
        raise RequestError(f"include: at most {INPUT_ITEMS_MAX_INCLUDE} values of at most 100 "
                           "characters", param="include")
    if include:
        logger.info("%s: input_items include %s accepted without effect (text-only items have "
                    "nothing to add)", response_id, include)
    items = record.input_items if order == "asc" else record.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise RequestError(f"after: {after[:100]!r} is not an input item of response "
                               f"{response_id!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:int(raw_limit)]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > len(page)})


def delete_response(server: ServerState, response_id: str) -> Response:
    if server.response_store.pop(response_id) is None:
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(server: ServerState, response_id: str) -> Response:
    """Cancel a background response (its engine request is aborted); a finished one is
    returned as it is."""
    record = server.response_store.get(response_id)
    if record is None:
        raise _not_found(response_id)
    if not record.response.background:
        raise RequestError(f"response_id: {response_id!r} was not created with background: "
                           "true; only background responses can be cancelled",
                           param="response_id")
    task = record.task
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if record.response.status in ("queued", "in_progress"):  # cancelled before it started
        record.response.status = "cancelled"
    return JSONResponse(record.response.model_dump())
