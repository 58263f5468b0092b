"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the requests (with
vLLM's sampling extras), the message and its content blocks, and Anthropic's error body. Every
list and string a client controls has a bound here; content blocks are checked where they are
translated (entrypoints/serving_messages.py)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ladle.protocol.common import OpenAIBaseModel, RequestError
from ladle.protocol.responses import (
    MAX_ID_CHARS,
    MAX_INPUT_ITEMS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOOLS,
    SamplingExtras,
)

MAX_BLOCKS = 1024
"""Content blocks in one message (and in `system`)."""

class InputMessage(OpenAIBaseModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]
    """Text, or blocks: text, tool_use (assistant), tool_result (user), thinking (assistant).
    At most MAX_TEXT_CHARS characters or MAX_BLOCKS blocks (checked where they are
    translated: a union cannot name its bound)."""


class ThinkingConfig(OpenAIBaseModel):
    type: Literal["enabled", "disabled", "adaptive"]
    """enabled: think (up to budget_tokens, then the engine ends thinking); disabled: no
    thinking. adaptive is rejected (ladle cannot decide how much a model should think)."""
    budget_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    display: Literal["summarized", "omitted"] | None = None


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, max_length=128)
    """type tool: the tool to call."""
    disable_parallel_tool_use: bool | None = None
    """True: at most one tool_use block."""


class OutputConfig(OpenAIBaseModel):
    format: dict[str, Any] | None = None
    """{"type": "json_schema", "schema": {...}}: the text follows the schema."""
    effort: str | None = Field(default=None, max_length=16)


class ThreadParam(BaseModel):
    """Server-held conversation state (the anthropic SDK's message threads, which its tool
    runner uses by default): create keeps the conversation under the reply's id; continue
    resumes from a kept reply, so the request sends only the new messages and leaves out system
    and tools (the thread's). Checked strictly: a misspelt field is a 400, not dropped."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["create", "continue"]
    previous_message_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    """continue: the id of the reply to continue from (required; only with continue)."""

    @model_validator(mode="after")
    def _check_previous_message_id(self) -> ThreadParam:
        if self.type == "continue" and self.previous_message_id is None:
            raise RequestError("thread.previous_message_id: required when type is continue",
                               param="thread.previous_message_id")
        if self.type == "create" and self.previous_message_id is not None:
            raise RequestError("thread.previous_message_id: only with type continue",
                               param="thread.previous_message_id")
        return self


class CountTokensRequest(SamplingExtras):
    """The prompt part of a Messages request (count_tokens counts what the template makes of
    it)."""

    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_INPUT_ITEMS)
    system: str | list[dict[str, Any]] | None = None
    """Text or text blocks (bounded as message content)."""
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    """Custom tools ({"name", "description", "input_schema"}); server tools are rejected."""
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    """Left out: no thinking (as Anthropic's API)."""
    output_config: OutputConfig | None = None
    # Fields ladle cannot honour: a 400 when set.
    container: Any = None
    mcp_servers: list[Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    stop_sequences: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(
        default=None, max_length=MAX_STOP)
    stream: bool = False
    thread: ThreadParam | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    # Fields with no effect on the output: accepted, and logged.
    metadata: dict[str, Any] | None = Field(default=None, max_length=16)
    service_tier: str | None = Field(default=None, max_length=64)

    NO_EFFECT_FIELDS: ClassVar[tuple[str, ...]] = ("metadata", "service_tier")


# ---- the message ------------------------------------------------------------------------------
class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]] = Field(default_factory=list)
    """Blocks: thinking {thinking, signature}, text {text}, tool_use {id, name, input}."""
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    """The stop sequence that ended the output (stop_reason stop_sequence)."""
    usage: Usage


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error_body(message: str, status_code: int,
                         error_code: str | None = None) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}, with
    error.details.error_code when given (the SDK's threads recover from "thread_not_found" by
    resending the whole conversation)."""
    error = {"type": _ERROR_TYPES.get(status_code, "api_error"), "message": message}
    if error_code is not None:
        error["details"] = {"error_code": error_code}
    return {"type": "error", "error": error}
