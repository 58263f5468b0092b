"""Chat tool calls and reasoning end to end: a real `ladle serve ladle-demo --reasoning-parser
qwen3 --enable-auto-tool-choice --tool-call-parser hermes`, the official openai client.

ladle-demo has random weights and never writes <think> or <tool_call> by itself, so the tests
make those happen: tool_choice "required" / named constrain the output to the tools' schemas,
thinking_token_budget forces </think>, a guided_regex writes hermes markup for "auto", and a
logit_bias on <tool_call> opens the calls that strict tools constrain."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_server import MODEL, chat_server

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm.",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                           "label": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                           "enabled": {"type": "boolean"}},
            "required": ["hour", "minute", "label", "enabled"],
            "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "tag_items", "description": "Tag some items.",
        "parameters": {
            "type": "object",
            "properties": {"tags": {"type": "array", "maxItems": 3,
                                    "items": {"enum": ["red", "green", "blue"]}},
                           "urgent": {"type": "boolean"}},
            "required": ["tags", "urgent"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "Plan my morning."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 12}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# A hermes call written by a regex, for "auto" (the demo model never writes one by itself).
CALL_RE = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
           r'"days": [1-7]\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server():
    s = chat_server()
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


def create(client, **kw) -> ChatCompletion:
    kw.setdefault("messages", MSG)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 1000)
    response = client.chat.completions.create(model=MODEL, **kw)
    assert isinstance(response, ChatCompletion)
    return response


def stream(client, **kw) -> tuple[dict, list[ChatCompletionChunk]]:
    """The stream reassembled as a client would: (message dict, chunks)."""
    kw.setdefault("messages", MSG)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 1000)
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in chunks:
        assert isinstance(chunk, ChatCompletionChunk)
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            for piece in delta.tool_calls or []:
                if piece.index not in calls:  # the first piece: id and name
                    assert piece.id.startswith("call_") and piece.function.name
                    assert piece.type == "function"
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": finish}, chunks


def as_dict(response: ChatCompletion) -> dict:
    choice = response.choices[0]
    message = choice.message
    return {"content": message.content, "reasoning": message.reasoning_content,
            "calls": [{"name": c.function.name, "arguments": c.function.arguments}
                      for c in message.tool_calls or []],
            "finish": choice.finish_reason}


def check_calls(response: ChatCompletion, names: set[str], max_calls: int | None = None) -> None:
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (max_calls is None or len(calls) <= max_calls)
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        assert isinstance(call.function.arguments, str)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not choice.message.content  # no markup or JSON leaks into the content


def test_required_and_named_calls_validate(client):
    names = list(SCHEMAS)

    def run(i: int) -> tuple[ChatCompletion, set[str], int | None]:
        if i < 30:  # "required"; every third one with parallel_tool_calls false
            parallel = i % 3 != 0
            r = create(client, seed=i, tools=TOOLS, tool_choice="required",
                       parallel_tool_calls=parallel, extra_body=NO_THINKING)
            return r, set(names), None if parallel else 1
        name = names[i % 3]
        r = create(client, seed=i, tools=TOOLS, extra_body=NO_THINKING,
                   tool_choice={"type": "function", "function": {"name": name}})
        return r, {name}, 1

    with ThreadPoolExecutor(60) as pool:
        results = list(pool.map(run, range(60)))
    for response, allowed, max_calls in results:
        check_calls(response, allowed, max_calls)
    # "required" picks among the tools (the random model favours some of them).
    assert len({c.function.name for r, _, _ in results[:30]
                for c in r.choices[0].message.tool_calls}) >= 2


def test_streams_reassemble_to_the_response(client):
    cases = [
        dict(tools=TOOLS, tool_choice="required", extra_body=NO_THINKING, seed=5),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}},
             extra_body=NO_THINKING, seed=6),
        dict(max_tokens=40, extra_body=THINKING, seed=7),  # reasoning, then content
        dict(tools=TOOLS, max_tokens=200, seed=8,  # auto: text, then calls the parser finds
             extra_body={**NO_THINKING, "guided_regex": "Sure[a-z ]{0,8}\\.\\n" + CALL_RE}),
    ]

    def run(kw):
        return create(client, **kw), stream(client, **kw)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for i, (response, (streamed, chunks)) in enumerate(results):
        assert streamed == as_dict(response)
        pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
        if i < 2:  # required / named: a call arrives whole once its JSON closes
            for piece in pieces:
                json.loads(piece.function.arguments)
        elif pieces:  # auto: the name once, then the arguments in fragments
            assert pieces[0].id and sum(1 for p in pieces if p.function.arguments) >= 2
            assert all(p.id is None and p.function.name is None for p in pieces[1:])
    (required, _), (named, _), (thinking, _), (auto, _) = results
    check_calls(required, set(SCHEMAS))
    check_calls(named, {"set_alarm"}, 1)
    message = thinking.choices[0].message
    assert message.reasoning_content and message.content
    assert message.reasoning == message.reasoning_content
    for text in (message.reasoning_content, message.content):
        assert "<think>" not in text and "</think>" not in text
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason == "tool_calls"
    assert message.content.startswith("Sure") and "<tool_call>" not in message.content
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_auto_parallel_and_none(client):
    two_calls = {**NO_THINKING, "guided_regex": "Ok\\.\\n" + CALL_RE + "\\n" + CALL_RE}
    kw = dict(seed=1, tools=TOOLS, max_tokens=200, extra_body=two_calls)
    jobs = [
        lambda: create(client, **kw),
        lambda: create(client, parallel_tool_calls=False, **kw),
        lambda: stream(client, parallel_tool_calls=False, **kw)[0],
        lambda: create(client, tool_choice="none", **kw),
        lambda: create(client, seed=1, max_tokens=1, extra_body=NO_THINKING),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        both, one, streamed, none, no_tools = list(pool.map(lambda job: job(), jobs))
    assert len(both.choices[0].message.tool_calls) == 2
    assert both.choices[0].message.content == "Ok.\n"
    # parallel_tool_calls false: the first call only.
    assert one.choices[0].message.tool_calls[0].function == both.choices[0].message.tool_calls[0] \
        .function and len(one.choices[0].message.tool_calls) == 1
    assert len(streamed["calls"]) == 1 and streamed["finish"] == "tool_calls"
    # tool_choice "none": the tools are in the prompt, but the markup stays content.
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content.count("<tool_call>") == 2
    assert none.usage.prompt_tokens > no_tools.usage.prompt_tokens + 100


def test_json_schema_after_reasoning(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def run(i: int) -> ChatCompletion:
        extra = THINKING if i % 2 == 0 else NO_THINKING
        return create(client, seed=i, max_tokens=300, response_format=fmt, extra_body=extra)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for i, response in enumerate(results):
        message = response.choices[0].message
        assert message.content is not None
        jsonschema.validate(json.loads(message.content), PERSON)
        if i % 2 == 0:  # free reasoning first; the constraint applies after </think>
            assert message.reasoning_content
            assert message.content not in message.reasoning_content
        else:  # the template closed the think block: constrained from the first token
            assert message.reasoning_content is None
    streamed, _ = stream(client, seed=0, max_tokens=300, response_format=fmt,
                         extra_body=THINKING)
    assert streamed == as_dict(results[0])


def test_strict_tools_in_auto_mode(client):
    """strict: true with tool_choice "auto": once the model opens a call, the call follows the
    hermes format and the tool's schema (a structural tag). logit_bias makes the demo model open
    one at once; without parallel calls the output ends after it."""
    strict_tools = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    kw = dict(tools=strict_tools, max_tokens=300, parallel_tool_calls=False,
              logit_bias={"151657": 100}, extra_body=NO_THINKING)  # 151657: <tool_call>

    def run(seed: int) -> ChatCompletion:
        return create(client, seed=seed, **kw)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for response in results:
        check_calls(response, set(SCHEMAS), 1)
    streamed, _ = stream(client, seed=0, **kw)
    assert streamed == as_dict(results[0])


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"json": PERSON}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "set_alarm"}},
      "guided_json": PERSON}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",  # a bad format is a 400 even when unused
      "response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": SCHEMAS["set_alarm"]}}],
      "response_format": {"type": "json_object"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_conflicts_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, max_tokens=5, extra_body=body)
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error"
    assert create(client, max_tokens=2, seed=0).choices[0].finish_reason == "length"


def test_a_forced_call_cut_by_max_tokens_returns_what_was_generated(client):
    """A named call cut by max_tokens comes back as generated, as OpenAI's does: the call with
    its arguments' text so far and finish_reason "length" (not content null and no calls),
    the same whole and streamed; a client can see the cut and retry with a larger budget."""
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}},
              max_tokens=6, seed=3, extra_body=NO_THINKING)
    whole = as_dict(create(client, **kw))
    assert whole["finish"] == "length" and whole["content"] is None, whole
    (call,) = whole["calls"]
    assert call["name"] == "set_alarm" and call["arguments"].startswith("{")
    with pytest.raises(ValueError):
        json.loads(call["arguments"])  # cut: not (yet) valid JSON
    streamed, _ = stream(client, **kw)
    assert {k: streamed[k] for k in ("calls", "finish")} == {k: whole[k] for k in ("calls",
                                                                                  "finish")}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "set_alarm"}}])
def test_forced_call_with_response_format_is_the_call(client, tool_choice):
    """response_format with a required or named tool_choice (instructor's tools modes send the
    pair; OpenAI accepts it): the forced call is the output and follows its tool's schema; the
    format shapes text, and there is none."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw = dict(tools=TOOLS, tool_choice=tool_choice, response_format=fmt, max_tokens=300,
              parallel_tool_calls=False, extra_body=NO_THINKING, seed=1)
    response = create(client, **kw)
    check_calls(response, {"set_alarm"} if isinstance(tool_choice, dict) else set(SCHEMAS), 1)
    streamed, _ = stream(client, **kw)
    assert streamed == as_dict(response)
