"""POST /v1/chat/completions: messages (and tools) -> the chat template -> one processed request
(n choices) -> a response or an SSE stream whose first chunk per choice carries the role and whose
last carries only its finish_reason (common.ending_apart). With a reasoning parser or tools, each
choice's text goes through a ChoiceOutputParser (parsers/choice.py) into reasoning, content and
tool calls, the same way for both. Also the server-wide chat settings: --chat-template, its
content format, and the default template kwargs."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ladle.entrypoints.common import (
    SSE_DONE,
    ServerState,
    as_request_error,
    base_request_id,
    check_engine_error,
    ending_apart,
    log_request_fields,
    sse,
    sse_error,
    unique_id,
    until_disconnect,
    with_kv_transfer_params,
)
from ladle.entrypoints.harmony import HarmonyPrompt, harmony_constraint, render_harmony
from ladle.entrypoints.logprobs import TokenNames, chat_logprobs, prompt_logprobs
from ladle.entrypoints.tools import ToolPlan, plan_tools
from ladle.frontend.output_processor import TokenLogprob
from ladle.frontend.processor import ProcessedRequest
from ladle.parsers.choice import ChoiceOutputParser, output_starts_in_reasoning
from ladle.parsers.harmony import START
from ladle.parsers.types import DeltaMessage as ParsedDelta
from ladle.parsers.types import merge_deltas, merge_pieces
from ladle.protocol.chat import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from ladle.protocol.common import PromptTokensDetails, RequestError, UsageInfo, effort_thinks
from ladle.protocol.sampling import to_sampling_params

logger = logging.getLogger("ladle.server")


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a template (has Jinja
    markup). ValueError for a path that does not exist."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def resolve_content_format(fmt: str, template: str | None) -> str:
    """--chat-template-content-format auto: "openai" (content as a list of parts) when the
    template loops over a message's content, else "string" (text parts joined)."""
    if fmt != "auto":
        return fmt
    loops = re.search(r"for\s+\w+\s+in\s+\w+(?:\.content|\[['\"]content['\"]\])", template or "")
    return "openai" if loops else "string"


def template_messages(server: ServerState, request: ChatCompletionRequest) -> list[dict]:
    messages = request.template_messages()  # checks that every part is text
    if server.chat_template_content_format == "openai":  # each text part kept as a part
        for msg, original in zip(messages, request.messages, strict=True):
            if isinstance(original.content, list):
                msg["content"] = [{"type": "text", "text": p["text"]} for p in original.content]
            elif isinstance(msg.get("content"), str):
                msg["content"] = [{"type": "text", "text": msg["content"]}]
    return messages


def template_kwargs(server: ServerState, request: ChatCompletionRequest) -> dict:
    """The server's defaults, then reasoning_effort's thinking switch, then the request's own."""
    kwargs = dict(server.default_chat_template_kwargs)
    if request.reasoning_effort is not None:
        kwargs["enable_thinking"] = effort_thinks(request.reasoning_effort)
    return kwargs | request.template_kwargs()


def harmony_prompt(server: ServerState, request: ChatCompletionRequest) -> HarmonyPrompt:
    """A chat in harmony, for a model that speaks it (server.harmony): the template kwargs
    reasoning_effort (the request's, unless chat_template_kwargs has one) and model_identity
    (the gpt-oss template's) reach its system message."""
    kwargs = template_kwargs(server, request)
    return render_harmony(
        request.template_messages(), tools=request.tools, tokenizer=server.engine.tokenizer,
        tokens=server.harmony, reasoning_effort=kwargs.get("reasoning_effort"),
        model_identity=kwargs.get("model_identity"),
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message)


def process_chat(server: ServerState, request: ChatCompletionRequest,
                 request_id: str) -> tuple[ProcessedRequest, ToolPlan]:
    engine = server.engine
    processor = engine.processor
    request.check_supported()
    server.check_chat_template(request.chat_template)
    harmony = server.harmony
    if request.thinking_token_budget is not None and (server.reasoning_parser is None
                                                      or harmony is not None):
        raise RequestError("thinking_token_budget: needs a reasoning parser with think tags "
                           "(start the server with --reasoning-parser; a harmony model, "
                           "gpt-oss, has no thinking budget)", param="thinking_token_budget")
    try:
        plan = plan_tools(request, enable_auto_tool_choice=server.enable_auto_tool_choice,
                          tool_call_parser=server.tool_call_parser,
                          backend=server.structured_outputs_backend,
                          harmony=harmony is not None)
        constraint = plan.constraint
        if harmony is not None:  # rendered and constrained per the format, not a template
            if request.chat_template is not None:
                raise RequestError("chat_template: this model speaks harmony (gpt-oss): its "
                                   "prompt is rendered in harmony, not by a template",
                                   param="chat_template")
            rendered = harmony_prompt(server, request)
            prompt, ids = rendered.text, rendered.token_ids
            constraint = harmony_constraint(request, plan, server.structured_outputs_backend)
        else:
            prompt = processor.render_chat(
                template_messages(server, request),
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                chat_template_kwargs=template_kwargs(server, request),
            )
            ids = processor.encode(prompt, add_special_tokens=request.add_special_tokens)
        if request.truncate_prompt_tokens is not None and len(ids) > request.truncate_prompt_tokens:
            ids, prompt = ids[-request.truncate_prompt_tokens:], None
        try:  # before max_tokens is fitted to what is left
            processor.check_prompt(ids)
        except ValueError as e:  # the prompt is the rendered conversation
            raise RequestError("messages" + str(e).removeprefix("prompt"), param="messages") from e
        params = to_sampling_params(
            request, num_prompt_tokens=len(ids), max_model_len=engine.max_model_len,
            defaults=processor.generation_defaults, limits=processor.limits,
            structured_outputs_backend=server.structured_outputs_backend,
            structured_outputs=constraint)
        params.logprobs_mode = server.logprobs_mode
        if harmony is not None:
            # The parser reads the channels from the markers, which are special tokens; the
            # turn ends on <|call|> or <|return|>, whatever generation_config lists.
            params.skip_special_tokens = False
            stops = list(params.stop_token_ids or [])
            params.stop_token_ids = stops + [t for t in harmony.stop_token_ids if t not in stops]
        elif server.keep_parser_markers and (server.reasoning_parser is not None
                                             or plan.mode == "auto"):
            # This tokenizer marks the parsers' tags as special tokens: keep them in the text.
            params.skip_special_tokens = False
        processed = processor.process(unique_id(request_id),
                                      {"prompt": prompt, "prompt_token_ids": ids}, params,
                                      priority=request.priority, cache_salt=request.cache_salt,
                                      kv_transfer_params=request.kv_transfer_params)
        return processed, plan
    except ValueError as e:
        raise as_request_error(e) from e


def choice_parser(server: ServerState, processed: ProcessedRequest, plan: ToolPlan,
                  request: ChatCompletionRequest | None = None, *,
                  starts_in_reasoning: bool | None = None) -> ChoiceOutputParser:
    """The parser of one choice's text (chat, and the Responses and Messages APIs).
    starts_in_reasoning: when the caller already decided it for the request's prompt."""
    include_reasoning = request.include_reasoning if request is not None else True
    if server.harmony is not None:
        return ChoiceOutputParser(tool_mode=plan.mode, is_parallel=plan.is_parallel,
                                  include_reasoning=include_reasoning, harmony=True,
                                  harmony_prefix=_harmony_prefix(server, processed))
    if starts_in_reasoning is None:
        starts_in_reasoning = output_starts_in_reasoning(
            server.reasoning_parser, processed.prompt_token_ids, server.engine.tokenizer,
            processed.prompt)
    return ChoiceOutputParser(
        reasoning_parser=server.reasoning_parser, tool_parser=server.tool_call_parser,
        tool_mode=plan.mode, named_function=plan.named, is_parallel=plan.is_parallel,
        tools=list(request.tools or []) if request is not None else [],
        starts_in_reasoning=starts_in_reasoning, include_reasoning=include_reasoning)


def _harmony_prefix(server: ServerState, processed: ProcessedRequest) -> str:
    """The prompt's last message, from its <|start|>: the output continues it."""
    if processed.prompt is not None:
        text = processed.prompt
        return text[text.rfind(START):] if START in text else ""
    ids = processed.prompt_token_ids  # truncated: only the ids are left
    start = server.harmony.ids[START]
    last = max((i for i, t in enumerate(ids) if t == start), default=-1)
    if last < 0:
        return ""
    return server.engine.tokenizer.decode(ids[last:], skip_special_tokens=False)


async def create_chat_completion(server: ServerState, request: ChatCompletionRequest,
                                 raw: Request) -> Response:
    model = server.check_model(request.model)
    request_id = f"chatcmpl-{base_request_id(raw)}"
    log_request_fields(request, request_id)
    with server.engine.admitting(request.num_candidates()):
        processed, plan = await server.run_blocking(process_chat, server, request, request_id)
    if server.log_requests:  # --enable-log-requests
        logger.info("%s: %d prompt tokens, %s", request_id, len(processed.prompt_token_ids),
                    processed.params)
    writer = _Writer(server, request, processed, plan, request_id, model)
    if request.stream:
        return StreamingResponse(writer.stream(), media_type="text/event-stream")
    return await until_disconnect(raw, writer.full())


class _Writer:
    def __init__(self, server: ServerState, request: ChatCompletionRequest,
                 processed: ProcessedRequest, plan: ToolPlan, request_id: str, model: str):
        self.engine = server.engine
        self.server = server
        self.plan = plan
        # Plain text unless a reasoning parser, tool calls or harmony are in play.
        self.is_parsed = (server.reasoning_parser is not None or plan.mode != "none"
                          or server.harmony is not None)
        self.request = request
        self.processed = processed
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.num_top = processed.params.logprobs  # None: no logprobs asked for
        as_ids = (request.return_tokens_as_token_ids
                  if "return_tokens_as_token_ids" in request.model_fields_set
                  else server.return_tokens_as_token_ids)
        self.names = TokenNames(self.engine.tokenizer, as_ids)
        self.role = server.response_role
        # Decided once per request: every choice's output starts from the same prompt.
        self.starts_in_reasoning = output_starts_in_reasoning(
            server.reasoning_parser, processed.prompt_token_ids, self.engine.tokenizer,
            processed.prompt)
        # echo: the reply starts with the last message's content when it is the assistant's.
        last = request.messages[-1]
        self.echo_text = ""
        if request.echo and last.role == "assistant":
            self.echo_text = request.template_messages()[-1].get("content") or ""

    def _usage(self, num_completion: int, num_cached: int) -> UsageInfo:
        num_prompt = len(self.processed.prompt_token_ids)
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached))

    def _parser(self) -> ChoiceOutputParser:
        return choice_parser(self.server, self.processed, self.plan, self.request,
                             starts_in_reasoning=self.starts_in_reasoning)

    # ---- non-streaming ----------------------------------------------------------------------
    async def full(self) -> Response:
        n = self.processed.params.n  # choices returned (fewer than candidates with best_of)
        texts: list[list[str]] = [[self.echo_text] for _ in range(n)]
        parsers = [self._parser() for _ in range(n)]
        parsed: list[list[ParsedDelta]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finish: list[tuple] = [(None, None)] * n
        state = None
        async for update in self.engine.generate(self.processed):
            state = update.state
            for d in update.deltas:
                check_engine_error(d)
                texts[d.index].append(d.text)
                parsed[d.index].append(parsers[d.index].feed(d.text))
                if d.finish_reason is not None:
                    parsed[d.index].append(parsers[d.index].finish())
                token_ids[d.index] += d.token_ids
                logprobs[d.index] += d.logprobs or []
                if d.finish_reason is not None:
                    finish[d.index] = (d.finish_reason, d.stop_reason)
        choices = []
        for i in range(n):
            finish_reason = finish[i][0]
            if not self.is_parsed:
                message = ChatCompletionMessage(content="".join(texts[i]))
                message.role = self.role
            else:
                merged = merge_deltas(parsed[i])
                message = ChatCompletionMessage(
                    content=self.echo_text + (merged.content or "") or None,
                    reasoning_content=merged.reasoning, reasoning=merged.reasoning,
                    tool_calls=[ToolCall(id=c.id, function=FunctionCall(
                        name=c.name, arguments=c.arguments)) for c in merged.tool_calls])
                message.role = self.role
                finish_reason = parsers[i].finish_reason(finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=i,
                message=message,
                logprobs=(None if self.num_top is None
                          else chat_logprobs(self.names, logprobs[i], self.num_top)),
                finish_reason=finish_reason,
                stop_reason=finish[i][1],
                token_ids=token_ids[i] if self.request.return_token_ids else None,
            ))
        response = ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=self._usage(state.num_output_tokens, state.num_cached_tokens),  # best_of: all
            prompt_logprobs=(None if self.processed.params.prompt_logprobs is None else
                             [None if d is None else {k: v.model_dump() for k, v in d.items()}
                              for d in prompt_logprobs(self.names, state.prompt_logprobs) or []]),
            prompt_token_ids=(self.processed.prompt_token_ids if self.request.return_token_ids
                              else None),
        )
        return JSONResponse(with_kv_transfer_params(response.model_dump(), [state]))

    # ---- streaming --------------------------------------------------------------------------
    def _chunk(self, choice: ChatCompletionResponseStreamChoice) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created,
                                            model=self.model, choices=[choice])

    async def stream(self):
        request = self.request
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage) or self.server.force_include_usage
        continuous = bool(opts and opts.continuous_usage_stats)
        n = len(self.processed.child_ids)
        num_tokens = [0] * n
        num_cached = 0
        parsers = [self._parser() for _ in range(n)]
        try:
            # The first chunk of each choice: the role (and any echoed text).
            for i in range(n):
                chunk = self._chunk(ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(content=self.echo_text)))
                chunk.choices[0].delta.role = self.role
                if request.return_token_ids and i == 0:
                    chunk.prompt_token_ids = self.processed.prompt_token_ids
                if continuous:
                    chunk.usage = self._usage(0, 0)
                yield sse(chunk)
            async for update in self.engine.generate(self.processed):
                num_cached = update.state.num_cached_tokens
                for d in update.deltas:
                    check_engine_error(d)
                    num_tokens[d.index] += len(d.token_ids)
                    parser = parsers[d.index]
                    parsed = parser.feed(d.text)
                    if d.finish_reason is not None:  # the text the parser still holds
                        parsed = merge_pieces(parsed, parser.finish())
                    if not (not parsed.is_empty or d.finish_reason
                            or (self.num_top is not None and d.logprobs)):
                        continue  # text held back (a possible stop string or tag)
                    finish_reason = d.finish_reason
                    if finish_reason is not None and self.is_parsed:
                        finish_reason = parser.finish_reason(finish_reason)
                    choice = ChatCompletionResponseStreamChoice(
                        index=d.index, delta=_delta_message(parsed),
                        finish_reason=finish_reason, stop_reason=d.stop_reason)
                    if self.num_top is not None:
                        choice.logprobs = chat_logprobs(self.names, d.logprobs or [], self.num_top)
                    if request.return_token_ids:
                        choice.token_ids = d.token_ids
                    for part in ending_apart(choice, delta=DeltaMessage(), logprobs=None,
                                             token_ids=None):
                        chunk = self._chunk(part)
                        if continuous:
                            chunk.usage = self._usage(sum(num_tokens), num_cached)
                        yield sse(chunk)
            if include_usage:
                yield sse(ChatCompletionStreamResponse(
                    id=self.request_id, created=self.created, model=self.model, choices=[],
                    usage=self._usage(sum(num_tokens), num_cached)))
        except Exception as e:
            yield sse_error(e)
        yield SSE_DONE


def _delta_message(parsed: ParsedDelta) -> DeltaMessage:
    calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    return DeltaMessage(content=parsed.content, reasoning_content=parsed.reasoning,
                        reasoning=parsed.reasoning, tool_calls=calls or None)

