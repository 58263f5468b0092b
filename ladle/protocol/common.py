"""Pieces every endpoint shares: the base model (unknown fields are logged and ignored, so newer
clients keep working), the request error type, the OpenAI error body, usage, stream options,
the model list, and /tokenize and /detokenize. Pydantic models only; no I/O."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ladle.sampling_params import INT64_MAX, INT64_MIN

logger = logging.getLogger("ladle.protocol")


class RequestError(ValueError):
    """A request ladle rejects; the server turns it into an OpenAI-shaped error body.
    `param` names the field at fault (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.type = type
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503


def unsupported(param: str, what: str = "is not supported by ladle") -> RequestError:
    return RequestError(f"{param}: {what}", param=param, code="unsupported_parameter")


class OpenAIBaseModel(BaseModel):
    """Unknown fields are dropped with a warning naming them (OpenAI adds fields over time)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = sorted(k for k in data if k not in known)
            if unknown:
                logger.warning("%s: ignoring unknown field(s) %s", cls.__name__,
                               ", ".join(map(repr, unknown)))
        return data


# Bounds on list fields of a request body (the body as a whole is bounded by the server's
# --max-request-body-bytes; sampling lists are bounded in ladle/sampling_params.py).
MAX_MESSAGES = 2048
MAX_TOOLS = 128  # OpenAI's limit
MAX_PROMPTS = 1024  # prompts in one completions batch


def check_json_text(data: Any, path: str = "") -> None:
    """Reject what JSON can carry but text and numbers cannot be: lone UTF-16 surrogates
    ("\ud800", which no tokenizer can encode), NaN/Infinity literals (not JSON, but Python's
    parser takes them) and integers past 64 bits (Python's are unbounded; the engine's wire and
    every integer setting stop at int64, so a free-form field such as vllm_xargs could otherwise
    carry one to the engine link and fail there). ValueError names the field, e.g.
    "messages.0.content"."""
    stack = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where or 'body'}: contains a lone UTF-16 surrogate (e.g. "
                                 "\\ud800); accepted: valid Unicode text") from None
        elif isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"{where or 'body'}: {value} is out of range; accepted: an "
                                 f"integer in [{INT64_MIN}, {INT64_MAX}]")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{where or 'body'}: {value} is not a JSON number; accepted: a "
                                 "finite number")
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((f"{where}.{k}" if where else str(k), v))
                if isinstance(k, str):
                    stack.append((where or "body", k))
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}" if where else str(i), v) for i, v in enumerate(value))


class RequestModel(OpenAIBaseModel):
    """A whole request body: its text and numbers are checked once, before field validation."""

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        try:
            check_json_text(data)
        except ValueError as e:
            param = str(e).split(":", 1)[0]
            raise RequestError(str(e), param=param) from None
        return data


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    """What went wrong, naming the field at fault."""
    type: str
    """invalid_request_error, authentication_error, not_found_error, server_error."""
    param: str | None = None
    """The request field at fault, when there is one."""
    code: str | int | None = None
    """A machine-readable reason, e.g. model_not_found, invalid_api_key."""


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- usage and streams ------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    """Add a last chunk with `usage` and empty `choices`."""
    continuous_usage_stats: bool | None = False
    """vLLM extra: put the usage so far on every chunk."""
    include_obfuscation: bool | None = None
    """OpenAI's padding field against side channels; accepted, nothing to pad here."""


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


# ---- models, tokenize -------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ladle"
    root: str | None = None
    """The checkpoint directory."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(RequestModel):
    """Either `prompt` (completion-style) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template writes them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- reasoning effort: the one mapping every route uses --------------------------------------
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's reasoning efforts (chat's reasoning_effort, Responses' reasoning.effort)."""


def effort_thinks(effort: str) -> bool:
    """Whether a reasoning effort turns the chat template's thinking switch (enable_thinking)
    on: off for none and minimal (a model that thinks or not comes closest to "as little as
    possible" by not), on from low up. The effort itself also reaches the template as
    reasoning_effort, for templates that grade it (gpt-oss)."""
    if effort not in REASONING_EFFORTS:
        raise RequestError(f"reasoning_effort: {effort!r}; accepted: "
                           + ", ".join(REASONING_EFFORTS), param="reasoning_effort")
    return effort not in ("none", "minimal")
