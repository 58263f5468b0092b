"""Logprobs in OpenAI's shapes, made in the API process from the engine's per-token top-k:
completions' parallel lists, chat's `logprobs.content`, and vLLM's prompt_logprobs."""

from __future__ import annotations

import math

from ladle.frontend.detokenizer import token_to_bytes, token_to_str
from ladle.frontend.output_processor import TokenLogprob
from ladle.protocol.chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
)
from ladle.protocol.completion import CompletionLogProbs, PromptLogprob

# JSON has no -inf: a token the sampler ruled out gets this value, as in vLLM.
MIN_LOGPROB = -9999.0


def clamp(value: float) -> float:
    return value if not math.isnan(value) and value > MIN_LOGPROB else MIN_LOGPROB


class TokenNames:
    """Token id -> the string logprobs show; `as_token_ids` writes "token_id:123" instead."""

    def __init__(self, tokenizer, as_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return token_to_str(self.tokenizer, token_id)

    def bytes(self, token_id: int) -> list[int]:
        return list(token_to_bytes(self.tokenizer, token_id))


def completion_logprobs(names: TokenNames, token_ids: list[int],
                        entries: list[TokenLogprob | None], num_top: int,
                        text_offset: int = 0) -> tuple[CompletionLogProbs, int]:
    """Completions' logprobs for these tokens, and the text offset after them. top_logprobs
    holds the num_top most likely tokens plus the sampled one (OpenAI: up to k + 1). An entry
    may be None (an echoed prompt's first token): its logprob and top_logprobs are null."""
    out = CompletionLogProbs()
    for token_id, e in zip(token_ids, entries, strict=True):
        token = names(token_id)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        if e is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(e.logprob))
        top = {names(t): clamp(v) for t, v in zip(e.top_ids[:num_top], e.top_logprobs[:num_top],
                                                   strict=True)}
        top.setdefault(token, clamp(e.logprob))
        out.top_logprobs.append(top)
    return out, text_offset


def chat_logprobs(names: TokenNames, entries: list[TokenLogprob],
                  num_top: int) -> ChatCompletionLogProbs:
    """Chat's logprobs.content: each token with its bytes and its top num_top alternatives."""
    content = []
    for e in entries:
        top = [
            ChatCompletionLogProb(token=names(t), logprob=clamp(v), bytes=names.bytes(t))
            for t, v in zip(e.top_ids[:num_top], e.top_logprobs[:num_top], strict=True)
        ]
        content.append(ChatCompletionLogProbsContent(
            token=names(e.token_id), logprob=clamp(e.logprob), bytes=names.bytes(e.token_id),
            top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs(names: TokenNames, entries: list[TokenLogprob | None] | None
                    ) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's shape: per prompt position, token id (as a string) -> logprob, rank, text; the
    prompt's own token first. The first position has no logprob (None)."""
    if entries is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): PromptLogprob(logprob=clamp(e.logprob), rank=e.rank,
                                            decoded_token=names(e.token_id))}
        for rank, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True), start=1):
            d.setdefault(str(t), PromptLogprob(logprob=clamp(v), rank=rank,
                                               decoded_token=names(t)))
        out.append(d)
    return out
