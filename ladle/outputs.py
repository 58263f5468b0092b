"""What the offline API returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: id -> Logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it failed, when finish_reason is "error"

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned beam of LLM.beam_search."""

    tokens: list[int]  # the prompt's, then the generated ones (as vLLM's)
    cum_logprob: float  # sum of the generated tokens' log-probabilities
    score: float  # cum_logprob / generated length ** length_penalty (transformers' sequences_scores)
    text: str  # the generated text
    finish_reason: str  # "stop" (a stop or EOS token) or "length"
    stop_reason: int | None = None  # the stop_token_id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token, when asked


@dataclass(slots=True)
class BeamSearchOutput:
    """LLM.beam_search's result for one prompt: the beams, best score first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
