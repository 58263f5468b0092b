"""POST /v1/chat/completions: the request (OpenAI's fields plus vLLM's chat extras), the
response and the stream chunk, shaped like openai-python's ChatCompletion types."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ladle.protocol.common import MAX_MESSAGES, MAX_TOOLS, RequestError, UsageInfo, unsupported
from ladle.protocol.sampling import SamplingFields


class ChatMessage(BaseModel):
    """One message of the conversation. Fields beyond these are passed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    """Text, or a list of parts; only text parts ({"type": "text", "text": ...}) are supported."""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool | None = False
    """Return the logprob of each output token."""
    top_logprobs: int | None = None
    """With logprobs: also the k most likely tokens at each position."""
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; either works."""
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    """Functions the model may call ({"type": "function", "function": {name, description,
    parameters}}); the chat template receives them."""
    tool_choice: str | dict[str, Any] | None = None
    """none, auto (the default with tools; needs --enable-auto-tool-choice), required (at least
    one call, constrained), or {"type": "function", "function": {"name": ...}} (that call)."""
    parallel_tool_calls: bool | None = True
    """False: at most one call."""
    # OpenAI fields ladle cannot honour: rejected when set to something that needs them.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = False
    verbosity: str | None = None
    # OpenAI fields with no effect on the output: accepted, and logged by the server.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    """none, minimal, low, medium or high: passed to the chat template (templates of reasoning
    models read it) and sets its thinking switch (enable_thinking: false for "none")."""
    include_reasoning: bool = True
    """vLLM extra: false leaves the reasoning out of the response (it is still parsed out)."""

    # vLLM's chat extras.
    echo: bool = False
    """Start the reply with the last message's content when that message is the assistant's."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Continue the last (assistant) message instead of starting a new one."""
    add_special_tokens: bool = False
    """The template writes special tokens itself; true adds the tokenizer's (BOS) again."""
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    """Passed to the chat template (RAG templates read it)."""
    return_tokens_as_token_ids: bool = False

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def requested_logprobs(self) -> tuple[int | None, str]:
        if not self.logprobs:
            return None, "top_logprobs"
        return self.top_logprobs or 0, "top_logprobs"

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise RequestError("tool_choice: requires tools", param="tool_choice")
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported("modalities", "is not supported beyond ['text']")
        if self.store:
            raise unsupported("store", "is not supported (ladle does not store completions)")
        if self.verbosity is not None:
            raise unsupported("verbosity")

    NO_EFFECT_FIELDS: ClassVar[tuple[str, ...]] = (
        "user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier")

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs.setdefault("documents", self.documents)
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template wants it: text parts joined, developer
        messages as system ones."""
        out = []
        for i, m in enumerate(self.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    kind = part.get("type")
                    if kind != "text" or not isinstance(part.get("text"), str):
                        raise unsupported(f"messages.{i}.content",
                                          f"parts of type {kind!r} are not supported (text only)")
                    texts.append(part["text"])
                msg["content"] = "\n".join(texts)
            if msg["role"] == "developer":
                msg["role"] = "system"
            out.append(msg)
        return out


# ---- responses --------------------------------------------------------------------------------
class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None
    refusal: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text of the arguments object."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None
    """Text the reasoning parser found before the answer (vLLM extra)."""
    reasoning: str | None = None
    """The same text under vLLM's newer name."""


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    """stop, length, tool_calls."""
    stop_reason: int | str | None = None
    """vLLM extra: the stop string or stop token id that ended the choice (None for EOS)."""
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    """New reasoning text (vLLM extra); also sent as `reasoning`."""
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
