"""`ladle serve gemma-3-270m`: the real trained Gemma 3 270M from its Q4_K_M GGUF file, served
as a user meets it (bfloat16, the tokenizer and chat template from the file or Gemma's own),
driven with the official openai client: completions, chat, streaming, structured outputs and
logprobs. A trained model makes the answers checkable: it knows where the Eiffel Tower is."""

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
