"""The request fields that drive sampling, shared by completions and chat, and the one function
that turns a request into SamplingParams (`to_sampling_params`): defaults are pinned here (the
model's generation_config, then OpenAI's), and fields ladle cannot honour are rejected here."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from ladle.protocol.common import (
    OpenAIBaseModel,
    RequestError,
    ResponseFormat,
    StreamOptions,
    unsupported,
)
from ladle.sampling_params import SamplingParams

_INT64 = dict(ge=-(2**63), le=2**63 - 1)
# Sampling fields whose default comes from generation_config.json, then this fallback.
_MODEL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                   "repetition_penalty": 1.0}


class SamplingFields(OpenAIBaseModel):
    """Fields both endpoints share: OpenAI's, then vLLM's extras for the sampler."""

    model: str | None = None
    """A served model name; the server's first one when left out."""
    n: int = 1
    """Choices to generate."""
    seed: int | None = Field(default=None, **_INT64)
    """Seeds sampling; choice i of an n > 1 request uses seed + i."""
    stop: str | list[str] | None = None
    """Up to any number of strings that end the output; the match is not returned."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    """Default: the model's generation_config value, else 1.0."""
    top_p: float | None = None
    """Default: the model's generation_config value, else 1.0."""
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> bias added to its logit, in [-100, 100]."""
    user: str | None = None
    """An end-user id for abuse monitoring; ladle logs it and does nothing else with it."""
    response_format: ResponseFormat | None = None

    # vLLM's extras for the sampler.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    """Logprobs of the top-k tokens at each prompt position (non-streaming only)."""
    use_beam_search: bool = False
    length_penalty: float = 1.0
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    """Keep only the last k prompt tokens."""
    priority: int = 0
    """Lower runs first when the engine schedules by priority."""
    cache_salt: str | None = None
    """Separates this request's prefix-cache entries from requests with another salt."""
    return_token_ids: bool = False
    """Add prompt_token_ids and each choice's token_ids to the response."""
    vllm_xargs: dict[str, Any] | None = None
    """Free-form arguments for custom logits processors (SamplingParams.extra_args)."""

    # Structured outputs: the fields exist; the conversion rejects them until they are wired.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    # ---- what differs between the endpoints ---------------------------------------------------
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the output-token cap or None for the remaining context, the field it is in). A
        value the client did not set (a default) shrinks to fit the context instead of
        failing."""
        raise NotImplementedError

    def requested_logprobs(self) -> tuple[int | None, str]:
        """(top-k logprobs per output token or None, the field it came from)."""
        raise NotImplementedError

    def check_supported(self) -> None:
        """Rejects fields ladle knows but cannot honour (a 400 that says so)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true",
                               param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs: not available when streaming; set stream to "
                               "false", param="prompt_logprobs")
        if self.use_beam_search:
            raise unsupported("use_beam_search", "beam search is not supported by ladle")
        if self.length_penalty != 1.0:
            raise unsupported("length_penalty", "only applies to beam search, which ladle does "
                              "not support")


def to_sampling_params(
    request: SamplingFields,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    defaults: dict[str, Any] | None = None,
    max_logprobs: int = 20,
) -> SamplingParams:
    """The request's SamplingParams. defaults: the model's generation_config sampling values
    (ladle.tokenizer.generation_defaults). Raises RequestError naming the field."""
    request.check_supported()
    defaults = defaults or {}

    def pick(name: str):
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, _MODEL_DEFAULTS[name])

    room = max_model_len - num_prompt_tokens
    max_tokens, max_tokens_field = request.requested_max_tokens()
    if max_tokens is not None and max_tokens_field not in request.model_fields_set:
        max_tokens = min(max_tokens, room)  # a default (completions' 16) shrinks to fit
    if max_tokens is not None and max_tokens > room:
        raise RequestError(
            f"{max_tokens_field}: this model's maximum context length is {max_model_len} tokens; "
            f"the prompt has {num_prompt_tokens} and {max_tokens} more were requested (at most "
            f"{max(room, 0)} fit)", param=max_tokens_field)
    max_tokens = room if max_tokens is None else max_tokens

    logprobs, logprobs_field = request.requested_logprobs()
    for value, name in ((logprobs, logprobs_field), (request.prompt_logprobs, "prompt_logprobs")):
        if value is not None and not 0 <= value <= max_logprobs:
            raise RequestError(f"{name}: {value} is out of range; accepted: 0 to {max_logprobs} "
                               "(the server's --max-logprobs)", param=name)
    logit_bias = None
    if request.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in request.logit_bias.items()}
        except ValueError:
            raise RequestError("logit_bias: keys must be token ids written as strings (e.g. "
                               '{"50256": -100})', param="logit_bias") from None
    try:
        return SamplingParams(
            n=request.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            repetition_penalty=pick("repetition_penalty"),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            seed=request.seed,
            logit_bias=logit_bias,
            bad_words=request.bad_words,
            allowed_token_ids=request.allowed_token_ids,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=request.prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            structured_outputs=structured_outputs_params(request),
            extra_args=request.vllm_xargs,
        )
    except ValueError as e:
        param = _param_of(str(e))
        renamed = {"logprobs": logprobs_field, "max_tokens": max_tokens_field}.get(param, param)
        message = str(e)
        if renamed != param:
            message = renamed + message[len(param):]
        raise RequestError(message, param=renamed) from e


def structured_outputs_params(request: SamplingFields):
    """response_format / structured_outputs / guided_* -> StructuredOutputsParams. Only plain
    text is wired so far; the rest is rejected with a 400 until the structured-output backend
    is connected here."""
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        raise unsupported("response_format", f"type {fmt.type!r} is not supported yet "
                          "(only 'text')")
    if request.structured_outputs:
        raise unsupported("structured_outputs", "is not supported yet")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(request, name) is not None:
            raise unsupported(name, "is not supported yet")
    return None


def _param_of(message: str) -> str | None:
    """SamplingParams errors start with the field name: "temperature: -1 is invalid; ..."."""
    m = re.match(r"([A-Za-z_][A-Za-z0-9_.]*):", message)
    return m.group(1) if m else None
