"""The Responses API end to end: a real `ladle serve ladle-demo --reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes --api-key ...`, driven by the official openai
client (responses.create, responses.stream, retrieve, cancel) and httpx for raw checks.

ladle-demo has random weights, so tests make outcomes happen: a named tool_choice constrains the
call, a json_schema text.format ends the output when the schema closes, a thinking budget ends
thinking, and max_output_tokens ends everything else (status "incomplete")."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from test_server import API_KEY, MODEL, chat_server

from ladle.entrypoints.serving_responses import ResponseStore, StoredResponse, input_messages
from ladle.protocol.responses import MAX_INPUT_ITEMS, ResponseObject

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
        "parameters": WEATHER}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
NO_THINKING = {"effort": "none"}
TEXT_ORDER = ["response.output_item.added", "response.content_part.added",
              "response.output_text.delta", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server():
    s = chat_server()
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


def prompt_tokens(server, messages: list[dict], **kw) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages, **kw},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_plain_and_instructions(server, client):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=8,
                                reasoning=NO_THINKING)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.usage.output_tokens == 8
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    assert r.usage.input_tokens == prompt_tokens(
        server, [{"role": "user", "content": "Hello there"}], **no_thinking)
    # instructions are a system message before the input.
    r = client.responses.create(model=MODEL, instructions="Answer in French.", input="Hello",
                                max_output_tokens=4, reasoning=NO_THINKING)
    assert r.instructions == "Answer in French."
    assert r.usage.input_tokens == prompt_tokens(
        server, [{"role": "system", "content": "Answer in French."},
                 {"role": "user", "content": "Hello"}], **no_thinking)
    # Stored by default: GET returns the same response.
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.status == "incomplete"


def test_function_call_and_output_follow_up(server, client):
    r = client.responses.create(
        model=MODEL, input="What is the weather in Rome?", tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
        reasoning=NO_THINKING, temperature=1.0)
    assert r.status == "completed", r
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"

    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 24 C"}],
        max_output_tokens=6, reasoning=NO_THINKING)
    assert follow.previous_response_id == r.id and follow.output_text
    # The follow-up's prompt is the whole conversation: question, call, result.
    expected = [{"role": "user", "content": "What is the weather in Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": calls[0].call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 24 C"}]
    tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert follow.usage.input_tokens == prompt_tokens(
        server, expected, tools=tools, chat_template_kwargs={"enable_thinking": False})

    # A call id that no earlier function_call made, and an unknown previous response.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=4,
                                input=[{"type": "function_call_output", "call_id": "call_nope",
                                        "output": "x"}])
    assert e.value.body["param"] == "input.0.call_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, previous_response_id="resp_missing", input="hi",
                                max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"


def test_json_schema_format_validates(client):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                      "strict": True}}
    for seed in (1, 2, 3):
        r = client.responses.create(model=MODEL, input="A person, as JSON.", text=fmt,
                                    max_output_tokens=200, reasoning=NO_THINKING,
                                    extra_body={"seed": seed})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), PERSON)
        assert r.text.format.type == "json_schema"


def test_stream_events_in_order(client):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    with client.responses.stream(model=MODEL, input="A person.", text=fmt, max_output_tokens=200,
                                 reasoning={"effort": "low"},
                                 extra_body={"thinking_token_budget": 5, "seed": 3}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    # Reasoning first (item 0), then the message (item 1), each opened and closed in order.
    reasoning = [t for e, t in zip(events, types, strict=True)
                 if getattr(e, "output_index", None) == 0]
    assert reasoning[:2] == ["response.output_item.added", "response.content_part.added"]
    assert reasoning[-3:] == ["response.reasoning_text.done", "response.content_part.done",
                              "response.output_item.done"]
    message = [t for e, t in zip(events, types, strict=True)
               if getattr(e, "output_index", None) == 1]
    assert [t for i, t in enumerate(message) if i == 0 or t != message[i - 1]] == TEXT_ORDER
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    jsonschema.validate(json.loads(final.output_text), PERSON)
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "".join(
        e.delta for e in events if e.type == "response.reasoning_text.delta")
    usage = events[-1].response.usage
    assert usage.output_tokens > 5 and usage.output_tokens_details.reasoning_tokens == 6
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The stream and the stored response agree.
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_stream_function_call_arguments(client):
    with client.responses.stream(model=MODEL, input="Weather?", tools=[TOOL],
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=300, reasoning=NO_THINKING,
                                 extra_body={"seed": 1}) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done, [e.type for e in events]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(d.arguments for d in done)
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].type == "function_call"


def test_background_cancel(server, client):
    r = client.responses.create(model=MODEL, input="Tell a long story.", background=True,
                                max_output_tokens=1500, reasoning=NO_THINKING)
    assert r.status == "queued" and r.background
    deadline = time.monotonic() + 60
    while client.responses.retrieve(r.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # some tokens
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    server.wait_idle()  # the engine request was aborted
    assert client.responses.retrieve(r.id).status == "cancelled"
    # Only background responses can be cancelled.
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)


def test_stream_disconnect_aborts_and_marks_cancelled(server):
    body = {"model": MODEL, "input": "A long story.", "max_output_tokens": 1500,
            "stream": True, "reasoning": NO_THINKING}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        for line in lines:  # until some text streamed
            if '"response.output_text.delta"' in line:
                break
    assert first["type"] == "response.created" and first["sequence_number"] == 0
    server.wait_idle()
    got = httpx.get(server.url + f"/v1/responses/{first['response']['id']}", headers=AUTH)
    assert got.json()["status"] == "cancelled"


def test_store_false_delete_and_404(server, client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_text_format_with_a_named_tool_choice_is_the_call(client):
    """instructor's RESPONSES_TOOLS mode sends text.format with a named tool_choice; OpenAI
    accepts the pair: the forced call is the output (its arguments follow the tool's schema),
    and the format shapes text items, of which there are none."""
    r = client.responses.create(
        model=MODEL, input="Weather in Oslo for 3 days?", tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
        reasoning=NO_THINKING, text={"format": {"type": "json_schema", "name": "person",
                                                "schema": PERSON}})
    assert r.status == "completed", r
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and not r.output_text
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.text.format.type == "json_schema"  # echoed as sent


def test_instructor_responses_tools_mode(client):
    """instructor's RESPONSES_TOOLS mode itself (it sends text.format with a named tool_choice
    of a tool made from the model): the response model comes back, validated."""
    instructor = pytest.importorskip("instructor")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    patched = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
    person = patched.responses.create(model=MODEL, input="Make up a person.",
                                      response_model=Person, max_output_tokens=300,
                                      max_retries=0, reasoning=NO_THINKING)
    assert isinstance(person, Person) and isinstance(person.age, int)


def test_input_items_lists_the_stored_input(server, client):
    """client.responses.input_items.list: the request's own input items (not the previous
    response's), with ids and statuses, newest first by default, paged with limit and after."""
    first = client.responses.create(model=MODEL, input="hi there", max_output_tokens=2)
    (item,) = client.responses.input_items.list(first.id).data
    assert item.type == "message" and item.role == "user" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].type == "input_text"
    assert item.content[0].text == "hi there"

    given = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}",
              "id": "fc_mine"},
             {"type": "function_call_output", "call_id": "call_1", "output": "4"},
             {"role": "assistant", "content": "It is 4."},
             {"role": "user", "content": "And 3+3?"}]
    r = client.responses.create(model=MODEL, input=given, max_output_tokens=2,
                                previous_response_id=first.id)
    page = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in page.data] == ["message", "message", "function_call",
                                           "function_call_output", "message", "message"]
    assert page.data[2].id == "fc_mine" and page.data[3].output == "4"  # the client's id kept
    assert page.data[4].content[0].type == "output_text"
    assert page.data[4].content[0].text == "It is 4."
    assert page.has_more is False and page.first_id == page.data[0].id
    newest = client.responses.input_items.list(r.id)  # order desc by default
    assert [i.id for i in newest.data] == [i.id for i in reversed(page.data)]
    # Paging: the SDK follows `after` until has_more is false; limit 2 gives 3 pages.
    raw = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items?order=asc&limit=2",
                    headers=AUTH, timeout=30).json()
    assert raw["object"] == "list" and raw["has_more"] is True and len(raw["data"]) == 2
    assert raw["last_id"] == page.data[1].id
    walked = [i.id for i in client.responses.input_items.list(r.id, order="asc", limit=2)]
    assert walked == [i.id for i in page.data]
    for query, param in [("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                         ("after=msg_nope", "after"), ("limit=9" * 40, "limit"),
                         ("&".join(["include=x"] * 17), "include"),
                         ("include=" + "x" * 101, "include")]:
        bad = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items?{query}", headers=AUTH,
                        timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
    assert client.responses.retrieve(r.id).id == r.id  # still serving


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input.0.content.0", "image"),
    ({"input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)}, "input",
     str(MAX_INPUT_ITEMS)),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "item_reference"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "2048"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "required"),
    ({"background": True, "store": False}, "background", "store"),
    ({"conversation": "conv_1"}, "conversation", "not supported"),
    ({"metadata": {"k": "v" * 600}}, "metadata", "512"),
    ({"temperature": 3}, "temperature", "2"),
])
def test_bad_requests_name_the_field(server, body, param, words):
    r = httpx.post(server.url + "/v1/responses", headers=AUTH, timeout=30,
                   json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def _record(rid: str, text: str) -> StoredResponse:
    return StoredResponse(ResponseObject(id=rid, status="completed", model=MODEL),
                          [{"role": "user", "content": text}])


def test_store_bounds_evict_oldest():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(4):
        assert store.put(_record(f"r{i}", "x"))
    assert list(store.records) == ["r1", "r2", "r3"]  # by count
    size = store.records["r3"].num_bytes
    assert store.put(_record("big", "y" * (10_000 - size - 200)))
    assert list(store.records) == ["big"] and store.num_bytes <= 10_000  # by bytes
    assert not store.put(_record("huge", "z" * 20_000))  # over the bound alone: not kept
    assert store.get("huge") is None and store.get("big") is not None
    assert store.put(_record("a", "1")) and list(store.records) == ["a"]  # big is oldest
    # An update keeps the record's age and recounts its bytes.
    store.put(_record("b", "2"))
    store.put(_record("a", "a longer text than before"))
    assert list(store.records) == ["a", "b"]
    assert store.num_bytes == sum(r.num_bytes for r in store.records.values())


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Weather "},
                          {"type": "input_text", "text": "in Oslo?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Oslo", "days": 1}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather",
              "arguments": '{"city": "Rome", "days": 2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Snow"},
             {"type": "function_call_output", "call_id": "call_2",
              "output": [{"type": "input_text", "text": "Sun"}]}]
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": items[3 + i]["arguments"]}}
             for i in (1, 2)]
    assert input_messages(items, []) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
         "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Sun"}]


def test_reasoning_effort_maps_the_same_in_chat_and_responses(client):
    """One mapping for every route (protocol.common.effort_thinks): none and minimal turn the
    template's thinking off, low up to xhigh on, in chat's reasoning_effort and in Responses'
    reasoning.effort alike; the prompt tokens show the switch (Qwen3's template writes an empty
    think block when thinking is off)."""
    def chat_tokens(effort):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            reasoning_effort=effort).usage.prompt_tokens

    def responses_tokens(effort):
        return client.responses.create(model=MODEL, input="hi", max_output_tokens=1,
                                       reasoning={"effort": effort}).usage.input_tokens

    off, on = chat_tokens("none"), chat_tokens("low")
    assert off != on
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh"):
        want = off if effort in ("none", "minimal") else on
        assert chat_tokens(effort) == want and responses_tokens(effort) == want, effort
    with pytest.raises(openai.BadRequestError) as e:
        chat_tokens("extreme")
    assert e.value.body["param"] == "reasoning_effort"
