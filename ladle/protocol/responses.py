"""POST /v1/responses (OpenAI's Responses API): the request, with vLLM's sampling extras, and the
response object and its output items, shaped like openai-python's `Response` types. Every list
and string a client controls has a bound here; items inside `input` are checked where they are
translated (entrypoints/serving_responses.py)."""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field

from ladle.protocol.common import OpenAIBaseModel, RequestError, RequestModel

MAX_INPUT_ITEMS = 1024
"""Items in `input` (messages, function calls and their outputs)."""
MAX_TEXT_CHARS = 1_000_000
"""Characters in one string: `input` as text, instructions, one content part, one output."""
MAX_TOOLS = 128
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_METADATA = 16
"""Metadata pairs (OpenAI's limits: 16 pairs, keys of 64 and values of 512 characters)."""
MAX_ID_CHARS = 256

_INT64 = dict(ge=-(2**63), le=2**63 - 1)


class ReasoningConfig(OpenAIBaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """none / minimal: no thinking; low and up: thinking (the chat template also receives it as
    reasoning_effort). Left out: the chat template's default."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted without effect: the reasoning item carries the full reasoning text."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, max_length=64)
    description: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    """json_schema: the JSON Schema the output text follows."""
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Rejected unless left out: ladle cannot make a model terser or wordier."""


class SamplingExtras(RequestModel):
    """vLLM's sampling extras, with the meaning they have on /v1/chat/completions; the Responses
    and Messages APIs take them too (clients send them as extra body fields)."""

    seed: int | None = Field(default=None, **_INT64)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    bad_words: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(
        default=None, max_length=1024)
    allowed_token_ids: list[int] | None = Field(default=None, max_length=1_000_000)
    priority: int = Field(default=0, **_INT64)
    cache_salt: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    thinking_token_budget: int | None = Field(default=None, ge=1, le=2**31 - 1)
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=64)
    vllm_xargs: dict[str, Any] | None = Field(default=None, max_length=64)

    SAMPLING_EXTRAS: ClassVar[tuple[str, ...]] = (
        "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "stop_token_ids", "min_tokens", "ignore_eos", "include_stop_str_in_output",
        "skip_special_tokens", "logit_bias", "bad_words", "allowed_token_ids", "priority",
        "cache_salt", "thinking_token_budget", "vllm_xargs")

    def sampling_extras(self) -> dict[str, Any]:
        """The extras the client set, as chat request fields."""
        return {n: getattr(self, n) for n in self.SAMPLING_EXTRAS
                if n in self.model_fields_set and getattr(self, n) is not None}


class ResponsesRequest(SamplingExtras):
    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    input: str | list[dict[str, Any]]
    """Text (one user message), or a list of items: messages (roles user, system, developer,
    assistant; content text or input_text / output_text parts), function_call and
    function_call_output items, and reasoning items. At most MAX_TEXT_CHARS characters or
    MAX_INPUT_ITEMS items (checked by check_bounds: a union cannot name its bound)."""
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    """A system message placed first; not carried over by previous_response_id."""
    max_output_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    """Function tools ({"type": "function", "name", "description", "parameters", "strict"}).
    Built-in tools (web_search, file_search, ...) are rejected."""
    tool_choice: str | dict[str, Any] | None = None
    """none, auto, required, or {"type": "function", "name": ...}."""
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    """Keep the response (in memory, bounded; the oldest go first) for GET and for
    previous_response_id."""
    previous_response_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    """Continue that stored response's conversation (its input and output come first)."""
    background: bool = False
    """Return at once (status queued); poll GET /v1/responses/{id}; cancel with POST
    /v1/responses/{id}/cancel. Needs store."""
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    """Accepted: include_obfuscation (there is nothing to pad here)."""
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    """Stored with the response and returned with it."""
    truncation: Literal["auto", "disabled"] | None = None
    """Only "disabled": a prompt longer than the context is a 400."""
    include: list[str] | None = Field(default=None, max_length=16)
    # Fields ladle cannot honour: a 400 when set.
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    # Fields with no effect on the output: accepted, and logged.
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    service_tier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    max_tool_calls: int | None = Field(default=None, ge=1, le=2**31 - 1)
    """Limits calls to built-in tools, of which ladle has none."""
    stop: str | list[str] | None = None
    """vLLM extra: strings that end the output (at most MAX_STOP, of MAX_STOP_CHARS each)."""

    NO_EFFECT_FIELDS: ClassVar[tuple[str, ...]] = (
        "user", "service_tier", "prompt_cache_key", "safety_identifier", "max_tool_calls")

    def check_bounds(self) -> None:
        """The bounds of the fields that are a string or a list (RequestError naming them)."""
        if isinstance(self.input, str) and len(self.input) > MAX_TEXT_CHARS:
            raise RequestError(f"input: {len(self.input)} characters; at most "
                               f"{MAX_TEXT_CHARS}", param="input")
        if isinstance(self.input, list) and len(self.input) > MAX_INPUT_ITEMS:
            raise RequestError(f"input: {len(self.input)} items; at most {MAX_INPUT_ITEMS}",
                               param="input")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise RequestError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
                               "characters", param="stop")
        for key, value in (self.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise RequestError("metadata: keys are at most 64 characters and values at "
                                   "most 512", param="metadata")


# ---- the response -----------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """What the reasoning parser found before the answer (the model's thinking, in full)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    """What a function_call_output item answering this call names."""
    name: str
    arguments: str = ""
    """The arguments object as JSON text."""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """Output tokens up to the end of thinking."""


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    """Set when max_output_tokens (or the context) ended the output."""
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
