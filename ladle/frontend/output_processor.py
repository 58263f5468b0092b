"""The one output loop: turns the engine's token outputs into text, per request.

For every engine output it runs the request's incremental detokenizer, checks stop strings (and
asks the engine to finish a request as soon as one matches, so its KV blocks are freed), keeps the
per-token logprobs, and keeps what the offline API and the server need: the text so far, the
deltas not yet taken by a stream, finish reasons, and timing for metrics.
An n > 1 request is n child requests in the engine, gathered here under the parent id; a best_of > n
request is best_of children, of which the n with the highest cumulative logprob are handed out
once all have finished (`RequestState.returned_children`)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ladle.engine.request import FinishReason
from ladle.frontend.detokenizer import IncrementalDetokenizer, token_to_str
from ladle.messages import EngineCoreOutput, Logprobs
from ladle.outputs import CompletionOutput, Logprob, RequestOutput
from ladle.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ladle.frontend.metrics import IterationStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprob:
    """The logprobs of one position: the chosen token and the top-k alternatives."""

    token_id: int  # the sampled (or, for a prompt, the actual) token
    logprob: float
    rank: int  # of token_id among all tokens; 1 = most likely
    top_ids: list[int]  # the k most likely, in rank order
    top_logprobs: list[float]


def split_logprobs(lp: Logprobs, token_ids: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row of the engine's Logprobs; token_ids are the rows' tokens."""
    return [
        TokenLogprob(t, v, r, ids, vals)
        for t, v, r, ids, vals in zip(token_ids, lp.sampled_values, lp.sampled_ranks,
                                      lp.token_ids, lp.values, strict=True)
    ]


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since the stream last looked: the unit of a streamed chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # None when the request asked for none
    finish_reason: str | None = None  # set once, on the choice's last delta
    stop_reason: int | str | None = None
    error: str | None = None
    is_server_error: bool = False  # the error is ladle's fault (HTTP 500), not the request's


@dataclass
class ChildState:
    """One choice of a request: its own detokenizer and tokens."""

    req_id: str  # the engine's id for this choice
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    is_server_error: bool = False
    returns_logprobs: bool = True  # False: asked of the engine only to rank best_of candidates
    beam_cumulative_logprob: float | None = None  # a returned beam's, as the engine summed it
    num_sent_tokens: int = 0  # tokens (and logprobs) already handed out in deltas
    is_finish_sent: bool = False
    last_token_time: float = 0.0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.get_next_output_text(self.is_finished, delta=False)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs; None when none were reported."""
        if self.beam_cumulative_logprob is not None:
            return self.beam_cumulative_logprob
        return sum(x.logprob for x in self.logprobs) if self.logprobs else None

    def take_delta(self) -> ChoiceDelta | None:
        """The text, tokens and logprobs since the last call; None when there is nothing new."""
        text = self.detok.get_next_output_text(self.is_finished, delta=True)
        start, self.num_sent_tokens = self.num_sent_tokens, len(self.token_ids)
        finish = self.is_finished and not self.is_finish_sent
        if not text and start == len(self.token_ids) and not finish:
            return None
        self.is_finish_sent = self.is_finish_sent or finish
        return ChoiceDelta(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            logprobs=self.logprobs[start:] if self.returns_logprobs else None,
            finish_reason=self.finish_reason if finish else None,
            stop_reason=self.stop_reason if finish else None,
            error=self.error if finish else None,
            is_server_error=self.is_server_error,
        )


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first position: None
    arrival_time: float = 0.0  # time.monotonic() when the request was added
    first_token_time: float | None = None
    tokenizer: object = None  # decodes logprob tokens for the offline output
    num_returned: int | None = None  # choices handed out (n); None: every child
    kv_transfer_params: dict | None = None  # a prefill server's handle on the prompt's KV
    _ranked: list[ChildState] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated for every child, returned or not (usage bills best_of candidates)."""
        return sum(len(c.token_ids) for c in self.children)

    @property
    def returned_children(self) -> list[ChildState]:
        """The choices handed out, choice i first: every child; or, when best_of > n, nothing
        until every candidate has finished, then the n with the highest cumulative logprob, best
        first (ties in candidate order). A failed candidate ranks first, so its error is seen
        rather than ranked away."""
        if self.num_returned is None or self.num_returned >= len(self.children):
            return self.children
        if not self.finished:
            return []
        if self._ranked is None:
            def key(c: ChildState) -> tuple[bool, float]:
                cum = c.cumulative_logprob
                return c.error is None, math.inf if cum is None else -cum

            self._ranked = sorted(self.children, key=key)[: self.num_returned]
        return self._ranked

    def take_deltas(self) -> list[ChoiceDelta]:
        deltas = []
        for index, c in enumerate(self.returned_children):
            if (d := c.take_delta()) is not None:
                d.index = index  # a best_of candidate's place among the returned ones
                deltas.append(d)
        return deltas

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(index=index, text=c.text, token_ids=list(c.token_ids),
                                 cumulative_logprob=c.cumulative_logprob,
                                 logprobs=(([self._logprob_dict(x) for x in c.logprobs] or None)
                                           if c.returns_logprobs else None),
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                 error=c.error)
                for index, c in enumerate(self.returned_children)
            ],
            prompt_logprobs=(None if self.prompt_logprobs is None else
                             [x and self._logprob_dict(x) for x in self.prompt_logprobs]),
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _logprob_dict(self, x: TokenLogprob) -> dict[int, Logprob]:
        """vLLM's offline shape: the chosen token first, then the top-k by rank."""
        def decoded(t: int) -> str | None:
            return None if self.tokenizer is None else token_to_str(self.tokenizer, t)

        out = {x.token_id: Logprob(x.logprob, x.rank, decoded(x.token_id))}
        for rank, (t, v) in enumerate(zip(x.top_ids, x.top_logprobs, strict=True), start=1):
            out.setdefault(t, Logprob(v, rank, decoded(t)))
        return out


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_of: dict[str, tuple[RequestState, ChildState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_ids: list[str], child_params: list[SamplingParams],
                    arrival_time: float | None = None,
                    params: SamplingParams | None = None) -> RequestState:
        """params: the request's own (ProcessedRequest.params), which say how many choices are
        returned (n, of best_of candidates) and whether logprobs are; None: every child as is."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        hides_logprobs = params is not None and params.logprobs is None
        children = [
            ChildState(cid, i, p, IncrementalDetokenizer.from_sampling_params(
                self.tokenizer, prompt_token_ids, p),
                returns_logprobs=p.logprobs is not None and not hides_logprobs)
            for i, (cid, p) in enumerate(zip(child_ids, child_params, strict=True))
        ]
        state = RequestState(request_id, prompt, prompt_token_ids, children,
                             arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                             tokenizer=self.tokenizer,
                             num_returned=None if params is None else params.n)
        self.requests[request_id] = state
        for c in children:
            self.child_of[c.req_id] = (state, c)
        return state

    def process(
        self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None
    ) -> tuple[list[RequestState], list[str]]:
        """Apply one step of engine outputs. Returns the requests that changed and the engine
        ids of children that a stop string finished (the caller aborts them in the engine).
        stats, when given, collects token counts and latencies for metrics."""
        changed: dict[str, RequestState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self.child_of.get(out.req_id)
            if entry is None:
                continue  # already finished by a stop string, or aborted
            state, child = entry
            try:
                state.num_cached_tokens = out.num_cached_tokens
                if out.kv_transfer_params is not None:
                    state.kv_transfer_params = out.kv_transfer_params
                if out.prompt_logprobs is not None:
                    self._add_prompt_logprobs(state, out.prompt_logprobs)
                if stats is not None and out.new_token_ids:
                    stats.record_tokens(state, child, len(out.new_token_ids), now)
                if out.new_token_ids:
                    if state.first_token_time is None:
                        state.first_token_time = now
                    child.last_token_time = now
                self._apply(child, out, to_abort)
            except Exception as e:  # this choice alone fails; the loop serves everyone else
                logger.exception("output processing failed for %s", out.req_id)
                child.finish_reason = "error"
                child.error = f"output processing failed: {type(e).__name__}: {e}"
                child.is_server_error = True
                if out.finish_reason is None:
                    to_abort.append(child.req_id)
            changed[state.request_id] = state
            if child.finish_reason is not None:
                del self.child_of[child.req_id]
                if stats is not None:
                    stats.record_finished(state, child, now)
        for state in changed.values():
            if state.finished:
                self.requests.pop(state.request_id, None)
        return list(changed.values()), to_abort

    def _apply(self, child: ChildState, out: EngineCoreOutput, to_abort: list[str]) -> None:
        new = out.new_token_ids
        child.token_ids.extend(new)
        if out.cumulative_logprob is not None:
            child.beam_cumulative_logprob = out.cumulative_logprob
        if out.logprobs is not None:
            child.logprobs.extend(split_logprobs(out.logprobs, new))
        # EOS or a stop token id ended it: that token's text is not output.
        stop_str = child.detok.update(new, out.ended_by_stop_token) if new else None
        if stop_str is not None:
            child.finish_reason, child.stop_reason = "stop", stop_str
            if out.finish_reason is None:
                to_abort.append(child.req_id)
        elif out.finish_reason is not None:
            child.finish_reason = str(FinishReason(out.finish_reason))
            child.stop_reason = out.stop_reason
            child.error, child.is_server_error = out.error, out.is_server_error

    def _add_prompt_logprobs(self, state: RequestState, lp: Logprobs) -> None:
        """Prompt logprobs may arrive in chunks (chunked prefill); row i scores the prompt token
        after the ones already seen. The first prompt token has no logprob (None)."""
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]
        start = len(state.prompt_logprobs)
        ids = state.prompt_token_ids[start : start + len(lp.sampled_values)]
        state.prompt_logprobs.extend(split_logprobs(lp, ids))

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

    def fail_all(self, error: str) -> list[RequestState]:
        """The engine is gone: finish every request with finish_reason "error"."""
        states = list(self.requests.values())
        for state in states:
            for c in state.children:
                if c.finish_reason is None:
                    c.finish_reason, c.error = "error", error
        self.requests.clear()
        self.child_of.clear()
        return states
