"""The Anthropic Messages API end to end: a real `ladle serve ladle-demo --reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes --api-key ...`, driven by the official
anthropic client (which sends the key as x-api-key). Also: the same seeded request gives the same
text through chat completions, responses and messages.

ladle-demo has random weights: tool_choice any constrains the calls, the thinking budget ends
thinking, a stop sequence is taken from a seeded reply and then ends the same reply early."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from test_server import API_KEY, MODEL, chat_server

from ladle.protocol.anthropic import MAX_BLOCKS

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather for a city.", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time in a city.",
          "input_schema": {"type": "object", "properties": {
              "city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}}]
CONVERSATION = [{"role": "user", "content": "Hi, who are you?"},
                {"role": "assistant", "content": "A helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": "Tell me a joke."}]}]

# Longer than a few KV blocks (16 tokens), so that a repeat reads most of it from the prefix cache.
LONG_SYSTEM = "You answer questions about the weather. " + " ".join(
    f"Rule {i}: be brief and be kind." for i in range(12))
LONG_REQUEST = {"model": MODEL, "max_tokens": 8, "system": LONG_SYSTEM,
                "messages": [{"role": "user", "content": "Is it sunny in Oslo today?"}],
                "extra_body": {"temperature": 0.0}}


def _prompt_count(client) -> int:
    return client.messages.count_tokens(model=MODEL, system=LONG_SYSTEM,
                                         messages=LONG_REQUEST["messages"]).input_tokens


def _input_fields(usage) -> tuple[int, int, int]:
    return (usage.input_tokens, usage.cache_read_input_tokens,
            usage.cache_creation_input_tokens or 0)


@pytest.fixture(scope="module")
def server():
    s = chat_server()
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300)


def test_system_multi_turn_and_count_tokens(server, client):
    m = client.messages.create(model=MODEL, max_tokens=8, system="You are terse.",
                               messages=CONVERSATION, extra_body={"seed": 1})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8
    count = client.messages.count_tokens(model=MODEL, system="You are terse.",
                                         messages=CONVERSATION)
    num_prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert count.input_tokens == num_prompt
    # The same conversation through /tokenize as chat messages (thinking off, as Anthropic's
    # default): system blocks and text blocks are plain text.
    chat = [{"role": "system", "content": "You are terse."}, *CONVERSATION[:2],
            {"role": "user", "content": "Tell me a joke."}]
    r = httpx.post(server.url + "/tokenize", headers={"x-api-key": API_KEY}, json={
        "messages": chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.json()["count"] == num_prompt


def test_usage_input_excludes_cache_reads(client):
    """Anthropic's input fields are disjoint: input_tokens + cache reads + cache creation is the
    whole prompt, which is what count_tokens says (a client that adds them must not count the
    cached tokens twice)."""
    count = _prompt_count(client)
    client.messages.create(**LONG_REQUEST)
    again = client.messages.create(**LONG_REQUEST)
    assert sum(_input_fields(again.usage)) == count
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens < count


def test_streamed_usage_equals_the_response(client):
    """The final message_delta's usage is cumulative and carries the input fields, as
    Anthropic's does (clients such as langchain-anthropic read them only there)."""
    client.messages.create(**LONG_REQUEST)  # the prompt is in the prefix cache from here on
    full = client.messages.create(**LONG_REQUEST)
    with client.messages.stream(**LONG_REQUEST) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text  # greedy: the same reply
    assert _input_fields(final.usage) == _input_fields(full.usage)
    assert final.usage.output_tokens == full.usage.output_tokens > 0
    delta = [e for e in events if e.type == "message_delta"]
    assert len(delta) == 1
    usage = delta[0].usage
    assert usage.input_tokens is not None and usage.cache_read_input_tokens is not None
    assert _input_fields(usage) == _input_fields(full.usage)
    assert usage.output_tokens == full.usage.output_tokens
    assert sum(_input_fields(usage)) == _prompt_count(client)


def test_langchain_stream_counts_the_whole_prompt(server, client):
    """langchain-anthropic's .stream() adds the message_delta's input fields up."""
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    llm = langchain_anthropic.ChatAnthropic(model=MODEL, base_url=server.url, api_key=API_KEY,
                                            max_tokens=8, max_retries=0, timeout=300)
    client.messages.create(**LONG_REQUEST)  # a cache hit for the streamed requests below
    for _ in range(2):
        total = None
        for chunk in llm.stream([("system", LONG_SYSTEM),
                                 ("human", LONG_REQUEST["messages"][0]["content"])]):
            total = chunk if total is None else total + chunk
        usage = total.usage_metadata
        assert usage["input_tokens"] == _prompt_count(client), usage
        assert usage["input_token_details"]["cache_read"] > 0, usage
        assert usage["output_tokens"] > 0


def test_stop_sequences(client):
    kw = {"model": MODEL, "messages": CONVERSATION, "extra_body": {"seed": 5,
                                                                  "temperature": 0.9}}
    full = client.messages.create(max_tokens=24, **kw).content[0].text
    words = [w for w in full.split(" ") if len(w) >= 3]
    stop = words[len(words) // 2]
    cut = client.messages.create(max_tokens=24, stop_sequences=[stop], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[:full.index(stop)]


def test_tool_use_any_and_tool_result(client):
    m = client.messages.create(model=MODEL, max_tokens=300, tools=TOOLS,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "Weather in Rome?"}],
                               extra_body={"seed": 2})
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1
    schema = {t["name"]: t["input_schema"] for t in TOOLS}[uses[0].name]
    jsonschema.validate(uses[0].input, schema)
    follow = client.messages.create(
        model=MODEL, max_tokens=6, tools=TOOLS, tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                "content": "Sunny, 24 C"}]}])
    assert follow.content[0].type == "text" and follow.stop_reason == "max_tokens"
    assert sum(_input_fields(follow.usage)) > sum(_input_fields(m.usage))


def test_named_tool_stream_input_json(client):
    with client.messages.stream(model=MODEL, max_tokens=300, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"
    assert json.loads(partial) == final.content[0].input
    jsonschema.validate(final.content[0].input, WEATHER)


def test_stream_events_in_order(client):
    with client.messages.stream(model=MODEL, max_tokens=12, system="Be kind.",
                                messages=CONVERSATION, extra_body={"seed": 3}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    with client.messages.create(model=MODEL, max_tokens=12, system="Be kind.", stream=True,
                                messages=CONVERSATION, extra_body={"seed": 3}) as raw:
        types = [e.type for e in raw]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    assert set(types[2:-3]) == {"content_block_delta"}
    assert text == final.content[0].text and text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    # The stream and the response agree (same seed).
    m = client.messages.create(model=MODEL, max_tokens=12, system="Be kind.",
                               messages=CONVERSATION, extra_body={"seed": 3})
    assert m.content[0].text == text


def test_thinking_with_the_reasoning_parser(client):
    kw = {"model": MODEL, "max_tokens": 14, "messages": CONVERSATION,
          "thinking": {"type": "enabled", "budget_tokens": 5}, "extra_body": {"seed": 4}}
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking and m.content[1].text
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert thinking == final.content[0].thinking == m.content[0].thinking
    assert final.content[1].text == m.content[1].text


def test_auth_with_x_api_key(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=CONVERSATION)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    # The OpenAI routes take x-api-key too.
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": API_KEY})
    assert r.status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA"}}]}]}, "messages.0.content.0"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"extra": {"temperature": 1.5}}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                 "tool_use_id": "toolu_x"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]
                    * (MAX_BLOCKS + 1)}]}, str(MAX_BLOCKS)),
    ({"extra": {"thinking": {"type": "enabled", "budget_tokens": 50}}}, "budget_tokens"),
    ({"extra": {"tool_choice": {"type": "any"}}}, "tool_choice"),
    ({"max_tokens": 5000}, "max_tokens"),
])
def test_bad_requests_are_anthropic_errors(server, body, words):
    payload = {"model": MODEL, "max_tokens": 16, "messages": CONVERSATION}
    payload.update({k: v for k, v in body.items() if k != "extra"})
    payload.update(body.get("extra", {}))
    payload = {k: v for k, v in payload.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY}, json=payload,
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_unknown_model_is_anthropic_404(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=2, messages=CONVERSATION)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_same_seeded_text_through_three_apis(server):
    """Chat completions, responses and messages: the same prompt (thinking off), seed,
    temperature and token cap give the same text."""
    system, user, seed, temperature, num_tokens = "You are a poet.", "Write a line.", 11, 0.8, 16
    oa = server.client(timeout=300)
    chat = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": user}],
        seed=seed, temperature=temperature, max_tokens=num_tokens,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    response = oa.responses.create(model=MODEL, instructions=system, input=user,
                                   temperature=temperature, max_output_tokens=num_tokens,
                                   reasoning={"effort": "none"}, extra_body={"seed": seed})
    message = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0,
                                  timeout=300).messages.create(
        model=MODEL, system=system, messages=[{"role": "user", "content": user}],
        max_tokens=num_tokens, extra_body={"seed": seed, "temperature": temperature})
    text = chat.choices[0].message.content
    assert text and chat.usage.completion_tokens == num_tokens
    assert response.output_text == text
    assert message.content[0].text == text
    # Anthropic's input_tokens leaves out the cached tokens (the Responses request cached them).
    assert chat.usage.prompt_tokens == response.usage.input_tokens == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens)


# ---- threads (the SDK's tool runner sends thread create, then continue) -----------------------
def _recording_client(server) -> tuple[anthropic.Anthropic, list[dict]]:
    """A client that records the fields of each request body it posts (set before its resources
    exist, which take `post` when made)."""
    c = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300)
    bodies: list[dict] = []
    post = c.post

    def recording_post(path, **kwargs):
        bodies.append({k: v for k, v in kwargs["body"].items()
                       if not isinstance(v, (anthropic.Omit, anthropic.NotGiven))})
        return post(path, **kwargs)

    c.post = recording_post
    return c, bodies


@pytest.mark.parametrize("stream", [False, True])
def test_tool_runner_continues_the_thread(server, stream):
    from anthropic import beta_tool
    client, bodies = _recording_client(server)
    cities = []

    @beta_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """Weather for a city.

        Args:
            city: The city.
        """
        cities.append(city)
        return f"Sunny in {city}."

    runner = client.beta.messages.tool_runner(
        model=MODEL, max_tokens=300, tools=[get_weather],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Rome?"}], max_iterations=2,
        stream=stream, extra_body={"seed": 5})
    replies = [item.get_final_message() if stream else item for item in runner]
    # Two turns, no replay: the second sent only the tool result and continued the first reply.
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use"], replies
    assert len(bodies) == 2 and len(cities) == 2
    assert bodies[0]["thread"] == {"type": "create"} and "tools" in bodies[0]
    assert bodies[1]["thread"] == {"type": "continue", "previous_message_id": replies[0].id}
    assert "tools" not in bodies[1] and len(bodies[1]["messages"]) == 1
    assert bodies[1]["messages"][0]["content"][0]["type"] == "tool_result"
    # The server prepended the thread: the second prompt holds the first and its reply.
    assert sum(_input_fields(replies[1].usage)) > sum(_input_fields(replies[0].usage)) + 10


def _raw_message(server, body) -> httpx.Response:
    return httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=300,
                      json={"model": MODEL, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "Hi"}], **body})


def test_thread_continue_of_an_unknown_id_is_the_sdks_404(server):
    r = _raw_message(server, {"thread": {"type": "continue", "previous_message_id": "msg_gone"}})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["type"] == "not_found_error"
    assert error["details"] == {"error_code": "thread_not_found"}
    assert "msg_gone" in error["message"] and "1024" in error["message"]


def test_thread_continue_takes_system_and_tools_from_the_thread(server):
    first = _raw_message(server, {"system": "Be brief.", "thread": {"type": "create"}})
    assert first.status_code == 200, first.text
    thread = {"type": "continue", "previous_message_id": first.json()["id"]}
    r = _raw_message(server, {"system": "Be long.", "thread": thread})
    assert r.status_code == 400 and "system" in r.json()["error"]["message"]
    second = _raw_message(server, {"thread": thread})
    assert second.status_code == 200, second.text
    # Unthreaded replies are not kept.
    plain = _raw_message(server, {})
    r = _raw_message(server, {"thread": {"type": "continue",
                                         "previous_message_id": plain.json()["id"]}})
    assert r.status_code == 404


@pytest.mark.parametrize("thread, field", [
    ({"type": "fork"}, "thread.type"),
    ({"type": "continue"}, "thread.previous_message_id"),
    ({"type": "continue", "previous_message_id": ""}, "thread.previous_message_id"),
    ({"type": "continue", "previous_message_id": "m" * 257}, "thread.previous_message_id"),
    ({"type": "create", "previous_message_id": "msg_1"}, "thread.previous_message_id"),
    ({"type": "create", "previus_message_id": "msg_1"}, "thread.previus_message_id"),
    ("create", "thread"),
])
def test_malformed_thread_is_a_400_naming_it(server, thread, field):
    r = _raw_message(server, {"thread": thread})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(field), r.json()
