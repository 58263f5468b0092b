"""POST /v1/completions: prompts -> processed requests -> a response or an SSE stream (each
choice's last chunk carries only its finish_reason: common.ending_apart)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

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
    merge_streams,
    sse,
    sse_error,
    unique_id,
    until_disconnect,
    with_kv_transfer_params,
)
from ladle.entrypoints.logprobs import TokenNames, completion_logprobs, prompt_logprobs
from ladle.frontend.output_processor import RequestState, TokenLogprob
from ladle.frontend.processor import ProcessedRequest
from ladle.protocol.common import PromptTokensDetails, UsageInfo
from ladle.protocol.completion import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from ladle.protocol.sampling import to_sampling_params

logger = logging.getLogger("ladle.server")


def process_completion(server: ServerState, request: CompletionRequest,
                       request_id: str) -> list[ProcessedRequest]:
    """One processed request per prompt of the batch; every prompt is checked before any runs.
    The caller has run request.check_supported()."""
    engine = server.engine
    processor = engine.processor
    processed = []
    internal_id = unique_id(request_id)
    try:
        for i, prompt in enumerate(request.prompts()):
            text, ids = processor.tokenize(prompt, request.add_special_tokens)
            if request.truncate_prompt_tokens is not None and len(ids) > request.truncate_prompt_tokens:
                ids, text = ids[-request.truncate_prompt_tokens:], None
            processor.check_prompt(ids)  # before max_tokens is fitted to what is left
            params = to_sampling_params(
                request, num_prompt_tokens=len(ids), max_model_len=engine.max_model_len,
                defaults=processor.generation_defaults, limits=processor.limits,
                structured_outputs_backend=server.structured_outputs_backend)
            params.logprobs_mode = server.logprobs_mode  # --logprobs-mode
            if request.echo and params.logprobs is not None and params.prompt_logprobs is None:
                params.prompt_logprobs = params.logprobs  # echoed tokens carry logprobs too
            processed.append(processor.process(
                f"{internal_id}-{i}", {"prompt": text, "prompt_token_ids": ids}, params,
                priority=request.priority, cache_salt=request.cache_salt,
                kv_transfer_params=request.kv_transfer_params))
        if request.kv_transfer_params is not None and len(processed) > 1:
            raise ValueError("kv_transfer_params: with one prompt per request only (the "
                             "prefill server's handle is one prompt's KV)")
    except ValueError as e:
        raise as_request_error(e) from e
    return processed


async def create_completion(server: ServerState, request: CompletionRequest,
                            raw: Request) -> Response:
    model = server.check_model(request.model)
    request_id = f"cmpl-{base_request_id(raw)}"
    log_request_fields(request, request_id)
    request.check_supported()
    with server.engine.admitting(request.num_candidates(), len(request.prompts())):
        processed = await server.run_blocking(process_completion, server, request, request_id)
    if server.log_requests:  # --enable-log-requests
        logger.info("%s: %d prompt(s), %s", request_id, len(processed), processed[0].params)
    writer = _Writer(server, request, processed, request_id, model)
    if request.stream:
        return StreamingResponse(writer.stream(), media_type="text/event-stream")
    return await until_disconnect(raw, writer.full())


@dataclass
class _Choice:
    """A choice being gathered for the non-streaming response."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Writer:
    """Writes one request's choices as a response or as SSE chunks. Choice i of prompt p has
    index p * n + i."""

    def __init__(self, server: ServerState, request: CompletionRequest,
                 processed: list[ProcessedRequest], request_id: str, model: str):
        self.engine = server.engine
        self.force_include_usage = server.force_include_usage
        self.request = request
        self.processed = processed
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.n = request.n
        self.num_top = processed[0].params.logprobs  # None: no logprobs asked for
        as_ids = (request.return_tokens_as_token_ids
                  if "return_tokens_as_token_ids" in request.model_fields_set
                  else server.return_tokens_as_token_ids)  # --return-tokens-as-token-ids
        self.names = TokenNames(self.engine.tokenizer, as_ids)

    def _usage(self, num_completion: int, num_cached: int) -> UsageInfo:
        num_prompt = sum(len(p.prompt_token_ids) for p in self.processed)
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached))

    def _echo(self, p: ProcessedRequest, state: RequestState
              ) -> tuple[str, list[int], list[TokenLogprob | None]]:
        """The echoed prompt: its text, token ids and logprob entries (first one None)."""
        text = p.prompt
        if text is None:
            text = self.engine.tokenizer.decode(p.prompt_token_ids, skip_special_tokens=False)
        entries = list(state.prompt_logprobs or [])
        entries += [None] * (len(p.prompt_token_ids) - len(entries))
        return text, p.prompt_token_ids, entries

    def _logprobs(self, token_ids: list[int], entries: list, offset: int):
        return completion_logprobs(self.names, token_ids, entries, self.num_top or 0, offset)

    # ---- non-streaming ----------------------------------------------------------------------
    async def full(self) -> Response:
        choices: dict[int, _Choice] = {}
        states: dict[int, RequestState] = {}
        async for i, update in merge_streams([self.engine.generate(p) for p in self.processed]):
            states[i] = update.state
            for d in update.deltas:
                check_engine_error(d)
                c = choices.setdefault(i * self.n + d.index, _Choice())
                c.text.append(d.text)
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs or []
                if d.finish_reason is not None:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        out = []
        for index in sorted(choices):
            c, p, state = choices[index], self.processed[index // self.n], states[index // self.n]
            text, ids, entries = "".join(c.text), list(c.token_ids), list(c.logprobs)
            if self.request.echo:
                prompt_text, prompt_ids, prompt_entries = self._echo(p, state)
                text, ids, entries = prompt_text + text, prompt_ids + ids, prompt_entries + entries
            returns_ids = self.request.return_token_ids
            out.append(CompletionResponseChoice(
                index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=None if self.num_top is None else self._logprobs(ids, entries, 0)[0],
                token_ids=c.token_ids if returns_ids else None,
                prompt_token_ids=p.prompt_token_ids if returns_ids else None,
                prompt_logprobs=(None if p.params.prompt_logprobs is None
                                 else prompt_logprobs(self.names, state.prompt_logprobs)),
            ))
        num_completion = sum(s.num_output_tokens for s in states.values())  # best_of: all
        num_cached = sum(s.num_cached_tokens for s in states.values())
        response = CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=out, usage=self._usage(num_completion, num_cached))
        return JSONResponse(with_kv_transfer_params(response.model_dump(), states.values()))

    # ---- streaming --------------------------------------------------------------------------
    async def stream(self):
        request = self.request
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage) or self.force_include_usage
        continuous = bool(opts and opts.continuous_usage_stats)
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        num_tokens: dict[int, int] = {}  # choice index -> tokens so far
        cached: dict[int, int] = {}  # prompt -> cached prompt tokens
        try:
            streams = [self.engine.generate(p) for p in self.processed]
            async for i, update in merge_streams(streams):
                cached[i] = update.state.num_cached_tokens
                for d in update.deltas:
                    check_engine_error(d)
                    index = i * self.n + d.index
                    text, ids, entries = d.text, d.token_ids, d.logprobs or []
                    first = index not in offsets
                    if first:
                        offsets[index] = 0
                        if request.echo:
                            prompt_text, prompt_ids, prompt_entries = self._echo(
                                self.processed[i], update.state)
                            text, ids = prompt_text + text, prompt_ids + ids
                            entries = prompt_entries + entries
                    num_tokens[index] = num_tokens.get(index, 0) + len(d.token_ids)
                    if not (text or d.finish_reason or first or
                            (self.num_top is not None and entries)):
                        continue  # tokens whose text is held back (a possible stop string)
                    choice = CompletionResponseStreamChoice(
                        index=index, text=text, logprobs=None, finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason)
                    if self.num_top is not None:
                        choice.logprobs, offsets[index] = self._logprobs(ids, entries,
                                                                         offsets[index])
                    if request.return_token_ids:
                        choice.token_ids = d.token_ids
                        if first:
                            choice.prompt_token_ids = self.processed[i].prompt_token_ids
                    for part in ending_apart(choice, text="", logprobs=None, token_ids=None,
                                             prompt_token_ids=None):
                        chunk = CompletionStreamResponse(id=self.request_id, created=self.created,
                                                         model=self.model, choices=[part])
                        if continuous:
                            chunk.usage = self._usage(sum(num_tokens.values()),
                                                      sum(cached.values()))
                        yield sse(chunk)
            if include_usage:
                yield sse(CompletionStreamResponse(
                    id=self.request_id, created=self.created, model=self.model, choices=[],
                    usage=self._usage(sum(num_tokens.values()), sum(cached.values()))))
        except Exception as e:
            yield sse_error(e)
        yield SSE_DONE

