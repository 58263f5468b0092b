"""The request fields that drive sampling, shared by completions and chat, and the one function
that turns a request into SamplingParams (`to_sampling_params`): defaults are pinned here (the
model's generation_config, then OpenAI's), and fields ladle cannot honour are rejected here."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field

from ladle.protocol.common import (
    RequestError,
    RequestModel,
    ResponseFormat,
    StreamOptions,
    unsupported,
)
from ladle.sampling_params import RequestLimits, SamplingParams, StructuredOutputsParams
from ladle.structured_output.manager import choose_backend

_INT64 = dict(ge=-(2**63), le=2**63 - 1)
# Sampling fields whose default comes from generation_config.json, then this fallback.
_MODEL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                   "repetition_penalty": 1.0}


class SamplingFields(RequestModel):
    """Fields both endpoints share: OpenAI's, then vLLM's extras for the sampler."""

    model: str | None = None
    """A served model name; the server's first one when left out."""
    n: int = 1
    """Choices to generate."""
    best_of: int | None = None
    """Candidates drawn per prompt (>= n, up to --max-n; candidate i seeded seed + i, as choice i
    of n = best_of); the n with the highest cumulative logprob are returned, best first. Not
    with stream when above n. usage counts every candidate's tokens."""
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
    """Beam search (greedy: temperature must be 0 or left out) of width best_of, else n; the n
    best beams are the choices. Streamed, each beam's text comes when the search ends."""
    length_penalty: float = 1.0
    """Beam search: a beam's score is sum(logprob) / generated_length ** length_penalty."""
    early_stopping: bool | Literal["never"] = False
    """Beam search: True ends it once n_beams hypotheses are finished; False and "never" as in
    transformers (when the best running beam can no longer beat them)."""
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
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation (`ladle proxy` sets them): {"do_remote_decode": true} to a
    prefill server; the prefill response's kv_transfer_params to the decode server."""

    thinking_token_budget: int | None = None
    """With the server's reasoning parser: end thinking (force </think>) after this many
    tokens."""

    # Structured outputs: at most one of response_format (json_object, json_schema),
    # structured_outputs (vLLM's) and the older guided_* fields.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def is_best_of_ranked(self) -> bool:
        """best_of > n, sampled: the candidates are ranked. With use_beam_search, best_of is the
        beam width instead, which beam search reads and checks itself."""
        return not self.use_beam_search and (self.best_of or 0) > self.n

    def num_candidates(self) -> int:
        """Engine requests per prompt, for admission: best_of when above n, else n."""
        return max(self.n, self.best_of or 0)

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
        if self.is_best_of_ranked and self.stream:  # as OpenAI: ranking needs whole candidates
            raise RequestError(f"best_of: {self.best_of} > n ({self.n}) cannot be streamed; set "
                               "stream to false or best_of to n", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true",
                               param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs: not available when streaming; set stream to "
                               "false", param="prompt_logprobs")


def to_sampling_params(
    request: SamplingFields,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    defaults: dict[str, Any] | None = None,
    limits: RequestLimits | None = None,
    structured_outputs_backend: str = "auto",
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's SamplingParams. defaults: the model's generation_config sampling values
    (ladle.tokenizer.generation_defaults). limits: the server's (vocabulary, --max-logprobs,
    --max-n), checked by SamplingParams.verify_for_model. structured_outputs, when given, replaces
    the request's own constraint (chat's tool_choice builds one). Raises RequestError naming the
    field."""
    request.check_supported()
    defaults = defaults or {}
    if structured_outputs is None:
        structured_outputs = structured_outputs_params(request, structured_outputs_backend)

    def pick(name: str):
        value = getattr(request, name)
        if value is None and name == "temperature" and request.use_beam_search:
            return 0.0  # beam search is greedy; a model's sampling default does not apply
        return value if value is not None else defaults.get(name, _MODEL_DEFAULTS[name])

    room = max_model_len - num_prompt_tokens
    max_tokens, max_tokens_field = request.requested_max_tokens()
    is_default = getattr(request, max_tokens_field, None) is None or (
        max_tokens_field not in request.model_fields_set)
    if max_tokens is not None and is_default:
        max_tokens = min(max_tokens, room)  # a default (completions' 16) shrinks to fit
    if max_tokens is not None and max_tokens > room:
        raise RequestError(
            f"{max_tokens_field}: this model's maximum context length is {max_model_len} tokens; "
            f"the prompt has {num_prompt_tokens} and {max_tokens} more were requested (at most "
            f"{max(room, 0)} fit)", param=max_tokens_field)
    max_tokens = room if max_tokens is None else max_tokens

    logprobs, logprobs_field = request.requested_logprobs()
    logit_bias = None
    if request.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in request.logit_bias.items()}
        except ValueError:
            raise RequestError("logit_bias: keys must be token ids written as strings (e.g. "
                               '{"50256": -100})', param="logit_bias") from None
    try:
        params = SamplingParams(
            n=request.n,
            # use_beam_search reads best_of as the beam width, not as sampled candidates
            best_of=None if request.use_beam_search else request.best_of,
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
            thinking_token_budget=request.thinking_token_budget,
            structured_outputs=structured_outputs,
            extra_args=request.vllm_xargs,
            beam_width=(request.best_of or request.n) if request.use_beam_search else 0,
            length_penalty=request.length_penalty,
            early_stopping=request.early_stopping,
        )
        if limits is not None:
            params.verify_for_model(limits)
        return params
    except ValueError as e:
        param = _param_of(str(e))
        renamed = {"logprobs": logprobs_field, "max_tokens": max_tokens_field,
                   "beam_width": "best_of" if request.best_of else "n"}.get(param, param)
        message = str(e)
        if renamed != param:
            message = renamed + message[len(param):]
        raise RequestError(message, param=renamed) from e


# Where each structured-output field of a request goes in StructuredOutputsParams.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_SO_FIELDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag",
              "disable_any_whitespace", "backend")
_SO_KINDS = _SO_FIELDS[:6]


def structured_outputs_params(request: SamplingFields, backend: str = "auto"
                              ) -> StructuredOutputsParams | None:
    """response_format / structured_outputs / guided_* -> StructuredOutputsParams, checked with
    the backend chooser so a bad schema, regex or grammar is a 400 naming the field. At most one
    constraint per request. `backend` is the server's --structured-outputs-backend."""
    found: list[tuple[str, dict[str, Any]]] = []  # (request field, StructuredOutputsParams kwargs)
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError("response_format.json_schema.schema: required when type is "
                               "'json_schema'", param="response_format.json_schema.schema")
        found.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    elif fmt is not None and fmt.type == "structural_tag":
        raise unsupported("response_format", "type 'structural_tag' is not supported; use "
                          "structured_outputs.structural_tag")
    so = request.structured_outputs
    if so is not None:
        unknown = sorted(set(so) - set(_SO_FIELDS))
        if unknown:
            raise RequestError(f"structured_outputs: unknown field(s) {unknown}; accepted: "
                               + ", ".join(_SO_FIELDS), param="structured_outputs")
        kinds = {k: v for k, v in so.items() if k in _SO_KINDS and v not in (None, False)}
        if len(kinds) > 1:
            raise RequestError(f"structured_outputs: give one constraint, got {sorted(kinds)}",
                               param="structured_outputs")
        if kinds:
            (kind, _), = kinds.items()
            found.append((f"structured_outputs.{kind}", dict(so)))
    for name, kind in _GUIDED_FIELDS.items():
        if getattr(request, name) is not None:
            found.append((name, {kind: getattr(request, name)}))
    if request.guided_whitespace_pattern is not None:
        raise unsupported("guided_whitespace_pattern", "is not supported (JSON whitespace is "
                          "fixed; structured_outputs.disable_any_whitespace removes it)")
    if len(found) > 1:
        names = [f for f, _ in found]
        raise RequestError(f"{names[1]}: only one structured-output constraint per request; got "
                           + ", ".join(names), param=names[1])
    if not found:
        if request.guided_decoding_backend is not None:
            raise RequestError("guided_decoding_backend: needs a guided_* constraint",
                               param="guided_decoding_backend")
        return None
    param, kwargs = found[0]
    # Options given without a constraint in structured_outputs apply to the one found elsewhere.
    options = {k: v for k, v in (so or {}).items() if k not in _SO_KINDS}
    kwargs = {**options, **kwargs}
    backend_param = "structured_outputs.backend"
    if request.guided_decoding_backend is not None and kwargs.get("backend") is None:
        kwargs["backend"], backend_param = request.guided_decoding_backend, "guided_decoding_backend"
    if kwargs.get("backend") == "llguidance":  # vLLM's name for it
        kwargs["backend"] = "guidance"
    if kwargs.get("backend") not in (None, "auto", "xgrammar", "guidance"):
        raise RequestError(f"{backend_param}: {kwargs['backend']!r} is unknown; accepted: auto, "
                           "xgrammar, guidance (llguidance)", param=backend_param)
    return checked_structured_outputs(param, kwargs, backend)


def checked_structured_outputs(param: str, kwargs: dict[str, Any], backend: str = "auto"
                               ) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs), or a RequestError on `param` naming the problem (an
    invalid schema, regex or grammar, or one no backend can express)."""
    if isinstance(kwargs.get("json"), str):
        try:
            kwargs = {**kwargs, "json": json.loads(kwargs["json"])}
        except ValueError as e:
            raise RequestError(f"{param}: not valid JSON: {e}", param=param) from e
    try:
        params = StructuredOutputsParams(**kwargs)
        choose_backend(params, backend)
    except (TypeError, ValueError) as e:
        message = str(e)
        prefix = _param_of(message)
        if prefix and prefix.startswith("structured_outputs"):
            message = message[len(prefix) + 1:].lstrip()
        raise RequestError(f"{param}: {message}", param=param) from e
    return params


def _param_of(message: str) -> str | None:
    """SamplingParams errors start with the field name: "temperature: -1 is invalid; ..."."""
    m = re.match(r"([A-Za-z_][A-Za-z0-9_.]*):", message)
    return m.group(1) if m else None
