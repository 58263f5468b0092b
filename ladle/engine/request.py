"""A request as the engine core sees it: its tokens, its progress and its state."""

from __future__ import annotations

import time
from enum import IntEnum

from ladle.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # structured output: grammar still compiling
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS, stop token, or stop string (reported by the API process)
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # this request failed (e.g. its grammar did not compile); others go on

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(IntEnum):
    """Why a request ended; str() gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


_STATUS_TO_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ):
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output, appended
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        # Prefill/decode disaggregation: the request's params, and the finished request's
        # params for the other side (distributed/kv_transfer.py).
        self.kv_transfer_params: dict | None = None
        self.kv_transfer_params_out: dict | None = None
        self.num_cached_tokens = 0  # of the prompt, served from the prefix cache
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string
        self.error: str | None = None
        self.is_server_error = False  # the error is ladle's fault, not the request's
        self.block_hashes: list[int] = []  # hashes of this request's full blocks, in order
        self.grammar = None  # structured-output matcher, when the request has a constraint
        self.prompt_logprobs_parts: list = []  # per prefill chunk, until the first output token
        self.max_tokens = sampling_params.max_tokens  # resolved against max_model_len on add
        # Speculative decoding: this step's proposed tokens (verified in the same forward), and
        # whether the request may be drafted at all (not when a custom logits processor that
        # cannot see draft positions applies to it).
        self.draft_token_ids: list[int] = []
        self.can_draft = True
        # Beam search: the group this request is a beam of (engine/beam_search.py), the beam's
        # running score (sum of its tokens' log-probabilities) and per-token logprob entries;
        # beam_candidates: the candidates (top log-probabilities) its row reports each step.
        self.beam = None
        self.beam_score = 0.0
        self.beam_logprobs: list = []
        self.beam_candidates = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _STATUS_TO_REASON.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __lt__(self, other: Request) -> bool:  # heap order: priority, then arrival (FCFS)
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)
