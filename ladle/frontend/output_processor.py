"""The one output loop: turns the engine's token outputs into text, per request.

For every engine output it runs the request's incremental detokenizer, checks stop strings (and
asks the engine to finish a request as soon as one matches, so its KV blocks are freed), and keeps
what the offline API and the server need: full text so far, the new delta, finish reason.
An n > 1 request is n child requests in the engine, gathered here under the parent id."""

from __future__ import annotations

from dataclasses import dataclass, field

from ladle.engine.request import FinishReason
from ladle.frontend.detokenizer import IncrementalDetokenizer
from ladle.messages import EngineCoreOutput
from ladle.outputs import CompletionOutput, RequestOutput
from ladle.sampling_params import SamplingParams


@dataclass
class ChildState:
    """One choice of a request: its own detokenizer and tokens."""

    req_id: str  # the engine's id for this choice
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_new_tokens: int = 0  # tokens since the last delta taken
    logprobs: list = field(default_factory=list)
    error: str | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(index=c.index, text=c.text, token_ids=list(c.token_ids),
                                 logprobs=c.logprobs or None, finish_reason=c.finish_reason,
                                 stop_reason=c.stop_reason)
                for c in self.children
            ],
            prompt_logprobs=self.prompt_logprobs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_of: dict[str, tuple[RequestState, ChildState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_ids: list[str], child_params: list[SamplingParams]) -> RequestState:
        children = [
            ChildState(cid, i, p, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
            ))
            for i, (cid, p) in enumerate(zip(child_ids, child_params, strict=True))
        ]
        state = RequestState(request_id, prompt, prompt_token_ids, children)
        self.requests[request_id] = state
        for c in children:
            self.child_of[c.req_id] = (state, c)
        return state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Apply one step of engine outputs. Returns the requests that changed and the engine
        ids of children that a stop string finished (the caller aborts them in the engine)."""
        changed: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.child_of.get(out.req_id)
            if entry is None:
                continue  # already finished by a stop string
            state, child = entry
            state.num_cached_tokens = out.num_cached_tokens
            if child.finish_reason is None:
                self._apply(child, out, to_abort)
            changed[state.request_id] = state
            if child.finish_reason is not None:
                del self.child_of[child.req_id]
        for state in changed.values():
            if state.finished:
                self.requests.pop(state.request_id, None)
        return list(changed.values()), to_abort

    def _apply(self, child: ChildState, out: EngineCoreOutput, to_abort: list[str]) -> None:
        child.token_ids.extend(out.new_token_ids)
        child.num_new_tokens += len(out.new_token_ids)
        stop_str = child.detok.update(out.new_token_ids) if out.new_token_ids else None
        if stop_str is not None:
            child.finish_reason, child.stop_reason = "stop", stop_str
            if out.finish_reason is None:
                to_abort.append(child.req_id)
        elif out.finish_reason is not None:
            child.finish_reason = str(FinishReason(out.finish_reason))
            child.stop_reason = out.stop_reason
            child.error = out.error
        child.text = child.detok.get_next_output_text(child.finish_reason is not None, delta=False)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids of its unfinished children."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = []
        for c in state.children:
            if self.child_of.pop(c.req_id, None) is not None:
                ids.append(c.req_id)
        return ids
