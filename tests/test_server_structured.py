"""Structured outputs through the API: a real `ladle serve ladle-demo` (no reasoning parser, so
constraints hold from the first token) driven with the official openai client. response_format,
vLLM's structured_outputs and the older guided_* fields on both endpoints; bad constraints are
OpenAI-shaped 400s naming the field; a repeated schema is a grammar-cache hit in /metrics."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from test_server import API_KEY, MODEL, RemoteServer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
MSG = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server():
    s = RemoteServer("--api-key", API_KEY, "--max-model-len", "1024", "--dtype", "float32",
                     "--disable-access-log")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def chat(client, **kw):
    kw.setdefault("max_tokens", 300)
    return client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.0, **kw)


def test_json_schema_and_json_object_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                  "schema": PERSON}}

    def run(seed):
        return chat(client, seed=seed, response_format=fmt).choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(run, range(8)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # Streaming: the deltas concatenate to valid JSON too, the very content of the same request
    # unstreamed. Each runs alone here: without --batch-invariant a request's tokens may depend
    # on the batch it shares (an int8 server quantizes a call of 4+ rows per token, a call of
    # fewer per block), so the eight concurrent runs above are no reference.
    alone = chat(client, seed=3, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(alone), PERSON)
    stream = chat(client, seed=3, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == alone
    # json_object leaves strings free: a random model may wander inside one until max_tokens
    # (ladle-demo and the families of tests/demo_variants.py sometimes do in 300 tokens). Such
    # a run ends with "length"; every run that ends with "stop" is an object.
    objs = [chat(client, seed=seed, response_format={"type": "json_object"}).choices[0]
            for seed in (1, 2, 3)]
    assert any(o.finish_reason == "stop" for o in objs), objs
    for obj in objs:
        assert obj.finish_reason in ("stop", "length"), obj
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.message.content), dict)


def test_json_object_whitespace_is_bounded_through_the_api(client):
    """json_object (vLLM's response_format on completions) with a model pushed towards
    whitespace (logit_bias +100 on
    the space and newline tokens, as a client might send by mistake): each run of whitespace
    between JSON tokens stays within the cap that json_schema has, so the budget is not
    spent on it."""
    from test_structured_output import whitespace_runs_outside_strings

    from ladle.structured_output.backend import MAX_JSON_WHITESPACE

    # Qwen's " " and "\n"; and no empty object in one token ("{}", " {}"), which would leave
    # no room for whitespace (a random model may well pick it first).
    bias = {"220": 100, "198": 100, "6257": -100, "4687": -100}
    text = client.completions.create(
        model=MODEL, prompt="Data:", temperature=0, max_tokens=120, logit_bias=bias,
        extra_body={"response_format": {"type": "json_object"}}).choices[0].text
    runs = whitespace_runs_outside_strings(text)
    assert text.lstrip().startswith("{") and runs and max(runs) <= MAX_JSON_WHITESPACE, text


def test_guided_fields_on_both_endpoints(client):
    choice = chat(client, seed=0, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].message.content in ("red", "green", "blue")
    so = chat(client, seed=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert so.choices[0].message.content in ("yes", "no")
    regex = r"[a-z]{3}-\d{2,4}"
    for seed in range(3):
        out = client.completions.create(model=MODEL, prompt="id:", max_tokens=20, seed=seed,
                                        extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    out = client.completions.create(model=MODEL, prompt="sum:", max_tokens=40, seed=1,
                                    extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.choices[0].text)
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 4}
    out = client.completions.create(model=MODEL, prompt="list:", max_tokens=60, seed=2,
                                    extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(out.choices[0].text), schema)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"json": {"properties": {"a": {"type": "bogus"}}}}},
     "structured_outputs.json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"thinking_token_budget": 4}, "thinking_token_budget"),  # no reasoning parser here
])
def test_bad_constraints_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, extra_body=body)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param + ":")
    # The server keeps serving.
    assert chat(client, max_tokens=3, seed=0).choices[0].finish_reason == "length"


def test_repeated_schema_hits_the_grammar_cache(server, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    chat(client, seed=0, response_format=fmt)
    before = server.metrics()
    for seed in (1, 2):
        jsonschema.validate(json.loads(chat(client, seed=seed, response_format=fmt)
                                       .choices[0].message.content), schema)
    after = server.metrics()
    assert after["ladle:grammar_cache_hits_total"] >= before["ladle:grammar_cache_hits_total"] + 2
    assert after["ladle:grammar_compiles_total"] == before["ladle:grammar_compiles_total"]
    assert after["ladle:grammar_compile_seconds_total"] > 0
