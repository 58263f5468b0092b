"""POST /v1/completions: the request, the response and the stream chunk (OpenAI's legacy
completions API, plus vLLM's extra fields)."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from ladle.protocol.common import MAX_PROMPTS, RequestError, UsageInfo, unsupported
from ladle.protocol.sampling import SamplingFields

# OpenAI's documented default for this endpoint (chat's default is the remaining context).
DEFAULT_MAX_TOKENS = 16


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    """Text, token ids, or a batch of either; each prompt gets n choices."""
    echo: bool = False
    """Put the prompt in front of each choice's text."""
    logprobs: int | None = None
    """Logprobs of the top-k tokens at each output position (plus the sampled one)."""
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    suffix: str | None = None
    """Not supported: ladle does no insertion."""
    add_special_tokens: bool = True
    """Let the tokenizer add BOS and the like to a text prompt."""
    return_tokens_as_token_ids: bool = False
    """Write logprob tokens as "token_id:123"."""
    prompt_embeds: Any = None

    NO_EFFECT_FIELDS: ClassVar[tuple[str, ...]] = ("user",)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        # null means the default, as in vLLM (not "the rest of the context" as in chat)
        return (DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens), "max_tokens"

    def requested_logprobs(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"

    def check_supported(self) -> None:
        super().check_supported()
        if self.prompt is None:
            raise RequestError("prompt: a prompt is required", param="prompt")
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt: must not be an empty list", param="prompt")
        num_prompts = len(self.prompts())
        if num_prompts > MAX_PROMPTS:
            raise RequestError(f"prompt: a batch of {num_prompts} prompts; accepted: at most "
                               f"{MAX_PROMPTS}", param="prompt")
        if self.suffix:
            raise unsupported("suffix", "is not supported by ladle (no insertion)")
        if self.prompt_embeds is not None:
            raise unsupported("prompt_embeds")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    """Character offset of each token in the choice's text."""
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    """Per token: the top-k tokens and the sampled one -> logprob."""


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    """stop, length (OpenAI's); abort when the server stopped it."""
    stop_reason: int | str | None = None
    """vLLM extra: the stop string or stop token id that ended the choice (None for EOS)."""
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
