"""Input processing shared by the offline LLM and the server's AsyncLLM: a prompt (text, token
ids, or chat messages through the chat template) becomes token ids, is checked against the model,
and an n > 1 request fans out into n child engine requests with seeds seed + i (best_of > n: into
best_of candidates, exactly as n = best_of would, which the output side ranks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from ladle.config import check_priority
from ladle.distributed.kv_transfer import check_kv_transfer_params
from ladle.messages import EngineCoreRequest
from ladle.sampling_params import RequestLimits, SamplingParams
from ladle.tokenizer import eos_token_ids, generation_defaults

# A string, token ids, or {"prompt": str} / {"prompt_token_ids": [...]} (both: ids win).
Prompt = str | list[int] | dict


@dataclass(slots=True)
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as asked: n choices returned, logprobs only if asked for
    child_ids: list[str]  # engine request ids, one per choice (per candidate with best_of)
    engine_requests: list[EngineCoreRequest]  # one per choice (candidate), in index order

    @property
    def child_params(self) -> list[SamplingParams]:
        if self.params.beam_width:  # one engine request, n returned beams
            return [self.params] * len(self.child_ids)
        return [r.sampling_params for r in self.engine_requests]


class InputProcessor:
    def __init__(self, tokenizer, model_path: str | Path, *, max_model_len: int,
                 limits: RequestLimits, scheduling_policy: str = "fcfs"):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.limits = limits
        self.vocab_size = limits.vocab_size
        self.scheduling_policy = scheduling_policy
        self.eos_token_ids = eos_token_ids(tokenizer, model_path)
        # temperature, top_p, top_k, min_p, repetition_penalty from generation_config.json:
        # the defaults of a request that leaves them out (the API layer applies them).
        self.generation_defaults = generation_defaults(model_path)

    # ---- text -> tokens ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text the model's chat template makes of a conversation. Template errors
        (a role the template rejects, a missing variable) are ValueErrors naming `messages`."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message: cannot be used with add_generation_prompt; "
                             "set add_generation_prompt to false")
        if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ValueError("continue_final_message: the last message must be an assistant one")
        kwargs = dict(chat_template_kwargs or {})
        for reserved in ("conversation", "messages", "tools", "tokenize"):
            if reserved in kwargs:
                raise ValueError(f"chat_template_kwargs: {reserved!r} cannot be set here")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **kwargs,
            )
        except Exception as e:  # jinja's TemplateError and the tokenizer's ValueErrors
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from e

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True
                 ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids)."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, add_special_tokens)
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            ids = prompt.get("prompt_token_ids")
            if ids is None:
                if text is None:
                    raise ValueError("prompt: give prompt text or prompt_token_ids")
                ids = self.encode(text, add_special_tokens)
            return text, list(ids)
        return None, list(prompt)

    # ---- checks and fan-out -----------------------------------------------------------------
    def check_prompt(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens; the prompt must leave room for at least one "
                "output token"
            )
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt: token id(s) {bad[:5]} outside the vocabulary (0 to "
                             f"{self.vocab_size - 1})")

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> ProcessedRequest:
        """Raises ValueError naming the field for anything the engine would reject."""
        kv_transfer_params = check_kv_transfer_params(kv_transfer_params)
        text, token_ids = self.tokenize(prompt, add_special_tokens)
        self.check_prompt(token_ids)
        params.verify_for_model(self.limits)
        check_priority(priority, self.scheduling_policy)
        if params.bad_words and params.bad_words_token_ids is None:
            params.update_from_tokenizer(self.tokenizer)
        n = params.num_candidates
        children = [params.child(i) for i in range(n)] if n > 1 else [params]
        if params.is_ranked and params.logprobs is None:
            # Ranking sums the sampled tokens' logprobs, which the engine reports only when
            # asked: ask for those alone (0 top), and the output side does not return them.
            children = [replace(c, logprobs=0) for c in children]
        if params.prompt_logprobs is not None:
            # One prompt, one set of prompt logprobs: the first child reports them (the output
            # side keeps one list per request; a second child's used to overflow it).
            children[1:] = [replace(c, prompt_logprobs=None) for c in children[1:]]
        child_ids = [f"{request_id}-{i}" for i in range(n)] if n > 1 else [request_id]
        now = time.monotonic() if arrival_time is None else arrival_time
        if params.beam_width:
            # One beam search in the engine (engine/beam_search.py); its n best beams come back
            # under the choices' ids.
            req = EngineCoreRequest(request_id, token_ids, params, self.eos_token_ids, now,
                                    priority, cache_salt, output_ids=child_ids,
                                    kv_transfer_params=kv_transfer_params)
            return ProcessedRequest(request_id, text, token_ids, params, child_ids, [req])
        reqs = [
            EngineCoreRequest(cid, token_ids, cp, self.eos_token_ids, now, priority, cache_salt,
                              kv_transfer_params=kv_transfer_params)
            for cid, cp in zip(child_ids, children, strict=True)
        ]
        return ProcessedRequest(request_id, text, token_ids, params, child_ids, reqs)
