"""One chat turn run on the engine, the entry the Responses and Messages APIs share: `ChatTurn`
(admission, chat's preprocessing off the event loop, the per-choice output parser), the
`ChatStep` it yields, and the helpers that translate those APIs' fields into chat's and chat's
errors back into their field names."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ladle.entrypoints.common import ServerState, check_engine_error
from ladle.entrypoints.harmony import reasoning_token_count
from ladle.entrypoints.serving_chat import choice_parser, process_chat
from ladle.parsers.types import DeltaToolCall, merge_pieces
from ladle.protocol.chat import ChatCompletionRequest
from ladle.protocol.common import RequestError
from ladle.protocol.responses import MAX_TEXT_CHARS


@dataclass(slots=True)
class ChatStep:
    """What one engine step added to the (single) choice, split by the chat output parser."""

    reasoning: str | None
    content: str | None
    tool_calls: list[DeltaToolCall]  # pieces; a call's first piece has its id and name
    finish_reason: str | None = None  # on the last step: stop, length, tool_calls, abort
    stop_reason: int | str | None = None  # the stop string or token id that ended it


class ChatTurn:
    """A chat request with one choice, run on the engine; its text is split into reasoning,
    content and tool calls by chat's per-choice parser. Construction checks the request (chat's
    RequestErrors, naming chat's fields)."""

    def __init__(self, server: ServerState, chat: ChatCompletionRequest, request_id: str):
        self.server = server
        self.chat = chat
        self.processed, self.plan = process_chat(server, chat, request_id)
        self.num_prompt_tokens = len(self.processed.prompt_token_ids)
        self.num_cached_tokens = 0
        self.output_token_ids: list[int] = []

    @classmethod
    async def start(cls, server: ServerState, chat: ChatCompletionRequest,
                    request_id: str) -> ChatTurn:
        """Admission control, then the preprocessing off the event loop (as chat does)."""
        with server.engine.admitting(1):
            return await server.run_blocking(cls, server, chat, request_id)

    async def steps(self) -> AsyncIterator[ChatStep]:
        """Leaving the loop early aborts the request in the engine."""
        parser = choice_parser(self.server, self.processed, self.plan, self.chat)
        async for update in self.server.engine.generate(self.processed):
            self.num_cached_tokens = update.state.num_cached_tokens
            for d in update.deltas:
                check_engine_error(d)
                self.output_token_ids += d.token_ids
                parsed = parser.feed(d.text)
                if d.finish_reason is not None:
                    parsed = merge_pieces(parsed, parser.finish())
                finish = parser.finish_reason(d.finish_reason)
                if parsed.is_empty and finish is None:
                    continue  # text held back (a possible stop string or tag)
                yield ChatStep(parsed.reasoning, parsed.content, parsed.tool_calls, finish,
                               d.stop_reason)

    def num_reasoning_tokens(self, has_reasoning: bool) -> int:
        """Output tokens up to and including the one that ends thinking."""
        if not has_reasoning:
            return 0
        if self.server.harmony is not None:
            return reasoning_token_count(self.output_token_ids, self.server.harmony)
        end = self.server.engine.tokenizer.convert_tokens_to_ids("</think>")
        ids = self.output_token_ids
        return ids.index(end) + 1 if end in ids else len(ids)


def renamed_error(e: RequestError, names: list[tuple[str, str]]) -> RequestError:
    """A chat RequestError with chat's field names replaced by this API's ((regex, repl), first
    match wins), in the param and at the start of the message."""
    param = e.param
    for pattern, repl in names:
        if param is not None and re.fullmatch(pattern, param):
            new = re.sub(pattern, repl, param)
            message = new + e.message[len(param):] if e.message.startswith(param) else e.message
            return RequestError(message, param=new, status_code=e.status_code, type=e.type,
                                code=e.code)
    return e


def chat_request(fields: dict[str, Any], param: str) -> ChatCompletionRequest:
    """The chat request made of translated fields; a field chat rejects is named by `param`."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise RequestError(f"{param}: {loc}: {first.get('msg')}", param=param) from e


def checked_text(value: Any, path: str) -> str:
    """`value` as text of at most MAX_TEXT_CHARS characters, else a RequestError on `path`
    (shared with the Messages API)."""
    if not isinstance(value, str):
        raise RequestError(f"{path}: must be a string", param=path)
    if len(value) > MAX_TEXT_CHARS:
        raise RequestError(f"{path}: {len(value)} characters; at most {MAX_TEXT_CHARS}",
                           param=path)
    return value
