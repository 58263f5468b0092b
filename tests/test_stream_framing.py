"""How a streamed choice ends, on a real `ladle serve ladle-demo --reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes`, checked with the official openai client.

Every choice of a chat or completions stream ends the way OpenAI ends one: after its last
content, reasoning or tool-call delta, a chunk of its own with the finish_reason and nothing
else. The openai SDK's stream helper depends on it: it closes a choice on the chunk with
finish_reason before it reads that chunk's tool calls, so a call sent together with the end
never gets its `tool_calls.function.arguments.done` event."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.completion import Completion
from test_server import MODEL, chat_server

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city.", "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm.", "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "enabled": {"type": "boolean"}},
            "required": ["hour", "enabled"], "additionalProperties": False}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MSG = [{"role": "user", "content": "Plan my morning."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 6}


@pytest.fixture(scope="module")
def server():
    s = chat_server()
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def chat_chunks(client, **kw) -> list[ChatCompletionChunk]:
    kw.setdefault("messages", MSG)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("extra_body", NO_THINKING)
    return list(client.chat.completions.create(model=MODEL, stream=True, seed=0,
                                               stream_options={"include_usage": True}, **kw))


def completion_chunks(client, **kw) -> list[Completion]:
    kw.setdefault("prompt", "Once upon a time")
    return list(client.completions.create(model=MODEL, stream=True, max_tokens=6, seed=0,
                                          stream_options={"include_usage": True}, **kw))


def carries_content(choice) -> bool:
    if hasattr(choice, "text"):  # completions
        return bool(choice.text) or choice.logprobs is not None
    d = choice.delta
    return bool(d.content or d.tool_calls or d.role or getattr(d, "reasoning_content", None)
                or getattr(d, "reasoning", None) or choice.logprobs is not None)


def check_endings(chunks, num_choices: int) -> dict[int, str]:
    """Each choice index ends with one chunk that carries its finish_reason and no content, after
    every other chunk of that index; the usage chunk comes after all of them. Returns the
    finish reasons by index."""
    choices = [(pos, c) for pos, chunk in enumerate(chunks) for c in chunk.choices]
    ends: dict[int, int] = {}
    finish: dict[int, str] = {}
    for pos, c in choices:
        if c.finish_reason is None:
            assert getattr(c, "stop_reason", None) is None, c
            continue
        assert c.index not in ends, f"choice {c.index} ends twice"
        assert not carries_content(c), c  # the end rides alone
        ends[c.index], finish[c.index] = pos, c.finish_reason
    assert sorted(ends) == list(range(num_choices))
    for pos, c in choices:
        assert pos <= ends[c.index], f"choice {c.index} has a chunk after its end"
    for i in range(num_choices):  # each choice sent something before its end
        assert any(pos < ends[i] for pos, c in choices if c.index == i)
    usage = [pos for pos, chunk in enumerate(chunks) if chunk.usage is not None]
    assert usage == [len(chunks) - 1] and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens > 0
    return finish


# ---- the openai SDK's stream helper ----------------------------------------------------------
# A call and its end reach the writer in one step when the call's last token also ends the
# request: here a stop string kept in the output ("}" closes the named call's arguments); under
# load, when a busy server hands a client several tokens (the JSON's close and <|im_end|>) at once.
ENDS_WITH_CALL = {"stop": ["}"], "extra_body": {**NO_THINKING, "include_stop_str_in_output": True}}
CALL_CASES = {
    "named": dict(tool_choice=NAMED),
    "named-ended-by-the-call": dict(tool_choice=NAMED, **ENDS_WITH_CALL),
    "required": dict(tool_choice="required"),
}


@pytest.mark.parametrize("case", list(CALL_CASES))
def test_stream_helper_sees_the_tool_call_done(client, case):
    kw = {"extra_body": NO_THINKING} | CALL_CASES[case]
    with client.chat.completions.stream(model=MODEL, messages=MSG, tools=TOOLS,
                                        parallel_tool_calls=False, max_tokens=200, seed=1,
                                        **kw) as s:
        events = list(s)
        completion = s.get_final_completion()
    choice = completion.choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    if kw["tool_choice"] == NAMED:
        assert call.function.name == "get_weather"
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1, [e.type for e in events]
    assert (done[0].index, done[0].name) == (0, call.function.name)
    assert done[0].arguments == call.function.arguments
    assert done[0].parsed_arguments == json.loads(call.function.arguments)
    assert call.function.parsed_arguments == done[0].parsed_arguments


# ---- the raw chunks --------------------------------------------------------------------------
def test_chat_content_stream_ends_apart(client):
    chunks = chat_chunks(client, logprobs=True, top_logprobs=2)
    assert check_endings(chunks, 1) == {0: "length"}
    entries = [e for c in chunks for ch in c.choices for e in (ch.logprobs.content
                                                                if ch.logprobs else [])]
    assert len(entries) == chunks[-1].usage.completion_tokens  # none lost from the content


@pytest.mark.parametrize("case", list(CALL_CASES))
def test_chat_tool_call_stream_ends_apart(client, case):
    chunks = chat_chunks(client, tools=TOOLS, parallel_tool_calls=False, max_tokens=200,
                         **CALL_CASES[case])
    assert check_endings(chunks, 1) == {0: "tool_calls"}
    calls = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or []]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments)


@pytest.mark.parametrize("max_tokens", [3, 30], ids=["in-reasoning", "after-reasoning"])
def test_chat_reasoning_stream_ends_apart(client, max_tokens):
    chunks = chat_chunks(client, max_tokens=max_tokens, extra_body=THINKING)
    assert check_endings(chunks, 1) == {0: "length"}
    reasoning = "".join(getattr(ch.delta, "reasoning_content", None) or ""
                        for c in chunks for ch in c.choices)
    assert reasoning


def test_chat_n2_stream_ends_each_choice_apart(client):
    chunks = chat_chunks(client, n=2, max_tokens=5)
    assert check_endings(chunks, 2) == {0: "length", 1: "length"}
    chunks = chat_chunks(client, n=2, tools=TOOLS, tool_choice=NAMED, max_tokens=200)
    assert check_endings(chunks, 2) == {0: "tool_calls", 1: "tool_calls"}


def test_completion_streams_end_apart(client):
    chunks = completion_chunks(client, logprobs=1)
    assert check_endings(chunks, 1) == {0: "length"}
    end = next(ch for c in chunks for ch in c.choices if ch.finish_reason)
    assert end.text == ""
    tokens = [t for c in chunks for ch in c.choices for t in (ch.logprobs.tokens
                                                               if ch.logprobs else [])]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    # n = 2 on two prompts: choices 0..3, each ended on its own.
    chunks = completion_chunks(client, prompt=["Once upon a time", "The sea"], n=2)
    assert check_endings(chunks, 4) == dict.fromkeys(range(4), "length")
