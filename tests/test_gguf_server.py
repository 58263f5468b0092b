"""`ladle serve gemma-3-270m`: the real trained Gemma 3 270M from its Q4_K_M GGUF file, served
as a user meets it (bfloat16, the tokenizer and chat template from the file or Gemma's own),
driven with the official openai client: completions, chat, streaming, structured outputs,
tools, logprobs, and ngram speculative decoding. A trained model makes the answers checkable:
it knows where the Eiffel Tower is. (The same matrix against an int8 server: scripts/test.sh
reruns tests/test_server.py and tests/test_server_structured.py with --quantization int8.)"""

from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest
from conftest import GEMMA

PARIS = "The Eiffel Tower is located in the city of"


@pytest.fixture(scope="module")
def client(gemma_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma_server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_completion_and_its_stream_agree(client):
    full = client.completions.create(model=GEMMA, prompt=PARIS, max_tokens=8, temperature=0)
    text = full.choices[0].text
    assert text.startswith(" Paris"), text
    pieces, finish = [], None
    for chunk in client.completions.create(model=GEMMA, prompt=PARIS, max_tokens=8,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == text and finish == full.choices[0].finish_reason


def test_chat_renders_gemma_turns_and_stops_at_end_of_turn(client, gemma_server):
    messages = [{"role": "system", "content": "Answer with one word."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris"},
                {"role": "user", "content": "And of Italy?"}]
    reply = client.chat.completions.create(model=GEMMA, messages=messages, max_tokens=40,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert "<end_of_turn>" not in choice.message.content
    # The prompt is Gemma's turn format, with the system message inside the first user turn.
    import httpx

    tokens = httpx.post(gemma_server.url + "/tokenize",
                        json={"model": GEMMA, "messages": messages}, timeout=60).json()
    detok = httpx.post(gemma_server.url + "/detokenize",
                       json={"model": GEMMA, "tokens": tokens["tokens"]}, timeout=60).json()
    assert detok["prompt"] == (
        "<bos><start_of_turn>user\nAnswer with one word.\n\nWhat is the capital of France?"
        "<end_of_turn>\n<start_of_turn>model\nParis<end_of_turn>\n<start_of_turn>user\n"
        "And of Italy?<end_of_turn>\n<start_of_turn>model\n")
    assert reply.usage.prompt_tokens == len(tokens["tokens"])


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=GEMMA, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_logprobs_are_a_peaked_distribution(client):
    full = client.completions.create(model=GEMMA, prompt=PARIS, max_tokens=1, temperature=0,
                                     logprobs=5)
    lp = full.choices[0].logprobs
    assert lp.tokens[0] == " Paris"
    top = lp.top_logprobs[0]
    assert list(top)[0] == " Paris" and len(top) == 5
    assert math.isclose(top[" Paris"], lp.token_logprobs[0], abs_tol=1e-6)
    probs = sorted((math.exp(v) for v in top.values()), reverse=True)
    assert probs[0] > 0.5 and sum(probs) <= 1 + 1e-3  # a trained model is sure of this one


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


def test_required_tool_call_validates_and_streams_whole(client):
    """Gemma has no tool markup of its own (its template does not show the tools, so the user
    message says what to write): tool_choice "required" constrains the output to one call of
    the tools' schemas, which arrives as a tool call, non-streamed and streamed."""
    ask = ('What is the weather in Paris? Answer with a get_weather call as JSON: [{"name": '
           '"get_weather", "parameters": {"city": ..., "unit": ...}}]')
    kw = dict(model=GEMMA, max_tokens=80, temperature=0, tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False,
              messages=[{"role": "user", "content": ask}])
    reply = client.chat.completions.create(**kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert "paris" in args["city"].lower()  # a trained model fills the argument from the question
    pieces, finish = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                pieces.setdefault(tc.index, []).append(tc.function.arguments or "")
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and json.loads("".join(pieces[0])) == args


@pytest.fixture(scope="module")
def spec_server():
    """The file in float32 with ngram speculation: the verification forward runs the same
    quantized kernels (each row's sums do not depend on the rows beside it), so greedy output
    equals plain decoding's."""
    from test_server import RemoteServer

    s = RemoteServer("--max-model-len", "512", "--dtype", "float32", "--disable-access-log",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                     model=GEMMA, timeout=600)
    yield s
    assert s.stop() == 0, s.log()
    # A GGUF file's tensor names come from transformers' model code, which imports triton
    # through torch._dynamo; both processes end without the interpreter's teardown
    # (lifetime.end_process), where triton's bindings printed ~70 lines of leak reports.
    assert "nanobind" not in s.log(), s.log()


def test_speculative_decoding_equals_plain_decoding(spec_server):
    from ladle import LLM, SamplingParams

    prompts = ["Monday, Tuesday, Wednesday, Monday, Tuesday, Wednesday, Monday,",
               "The Eiffel Tower is in Paris. The Eiffel Tower is in"]
    ref = LLM(GEMMA, dtype="float32", max_model_len=512)
    try:
        want = [o.outputs[0] for o in ref.generate(prompts, SamplingParams(temperature=0,
                                                                           max_tokens=32))]
    finally:
        ref.close()
    spec = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)
    for prompt, w in zip(prompts, want, strict=True):
        got = spec.completions.create(model=GEMMA, prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert got.choices[0].token_ids == w.token_ids, prompt
        streamed = "".join(c.choices[0].text for c in spec.completions.create(
            model=GEMMA, prompt=prompt, max_tokens=32, temperature=0, stream=True) if c.choices)
        assert streamed == w.text
    m = spec_server.metrics()
    assert m["ladle:spec_decode_num_accepted_tokens_total"] >= 10, m  # the repeats were drafted
