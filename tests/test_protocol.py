"""The API layer without a server: request -> SamplingParams (defaults, field mapping,
rejections naming the field), logprobs in OpenAI's shapes from crafted engine Logprobs, and
responses that parse with the official openai client's types."""

from __future__ import annotations

import logging
import math

import openai.types as oa
import openai.types.chat as oa_chat
import pytest

from ladle.entrypoints.logprobs import TokenNames, chat_logprobs, completion_logprobs
from ladle.frontend.output_processor import OutputProcessor
from ladle.messages import EngineCoreOutput, Logprobs
from ladle.models.demo import ensure_demo_model
from ladle.protocol.chat import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from ladle.protocol.common import RequestError, UsageInfo
from ladle.protocol.completion import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from ladle.protocol.sampling import to_sampling_params
from ladle.sampling_params import RequestLimits, StructuredOutputsParams
from ladle.tokenizer import generation_defaults, load_tokenizer

MAX_LEN = 1024
GEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_demo_model())


def convert(request, num_prompt_tokens=10, **kw):
    kw.setdefault("defaults", GEN_DEFAULTS)
    kw.setdefault("limits", RequestLimits(vocab_size=151936))
    return to_sampling_params(request, num_prompt_tokens=num_prompt_tokens,
                              max_model_len=MAX_LEN, **kw)


def chat(**fields):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def completion(**fields):
    return CompletionRequest(prompt="hi", **fields)


def rejected(request, param, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        convert(request, **kw)
    assert info.value.param == param, info.value.message
    assert info.value.status_code == 400
    assert info.value.message.startswith(param)
    return info.value


# ---- defaults ---------------------------------------------------------------------------------
def test_defaults_come_from_generation_config_then_openai():
    assert generation_defaults(ensure_demo_model()) == {"temperature": 0.7, "top_k": 20,
                                                        "top_p": 0.8}
    p = convert(chat())
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.7, 0.8, 20, 0.0, 1.0)
    p = convert(chat(), defaults={})
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
    p = convert(chat(temperature=0.0, top_p=0.5, top_k=-1, min_p=0.1, repetition_penalty=1.2))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.0, 0.5, 0, 0.1, 1.2)


def test_max_tokens_defaults():
    # Chat: the remaining context. Completions: OpenAI's 16, shrunk to fit a long prompt.
    assert convert(chat(), num_prompt_tokens=100).max_tokens == MAX_LEN - 100
    assert convert(completion(), num_prompt_tokens=100).max_tokens == 16
    assert convert(completion(), num_prompt_tokens=MAX_LEN - 5).max_tokens == 5
    assert convert(chat(max_completion_tokens=7, max_tokens=9)).max_tokens == 7
    assert convert(chat(max_tokens=9)).max_tokens == 9
    e = rejected(chat(max_completion_tokens=MAX_LEN), "max_completion_tokens")
    assert "maximum context length" in e.message
    rejected(completion(max_tokens=MAX_LEN - 9), "max_tokens")
    assert convert(completion(max_tokens=MAX_LEN - 10)).max_tokens == MAX_LEN - 10


def test_field_mapping():
    p = convert(completion(n=3, seed=5, stop="END", logprobs=2, presence_penalty=0.5,
                           frequency_penalty=-0.5, logit_bias={"11": 5, "12": -200},
                           min_tokens=2, stop_token_ids=[7], include_stop_str_in_output=True,
                           ignore_eos=True, skip_special_tokens=False,
                           spaces_between_special_tokens=False, bad_words=["foo"],
                           allowed_token_ids=[1, 2, 3], prompt_logprobs=1,
                           vllm_xargs={"k": 1}))
    assert (p.n, p.seed, p.stop, p.logprobs, p.prompt_logprobs) == (3, 5, ["END"], 2, 1)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.logit_bias == {11: 5.0, 12: -100.0}  # clamped to [-100, 100]
    assert (p.min_tokens, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == (
        2, [7], True, True)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens) == (False, False)
    assert (p.bad_words, p.allowed_token_ids, p.extra_args) == (["foo"], [1, 2, 3], {"k": 1})
    assert convert(completion(stop=["a", "b"])).stop == ["a", "b"]
    # Chat: logprobs true + top_logprobs k -> k; logprobs alone -> 0; neither -> None.
    assert convert(chat(logprobs=True, top_logprobs=4)).logprobs == 4
    assert convert(chat(logprobs=True)).logprobs == 0
    assert convert(chat()).logprobs is None
    assert convert(chat(response_format={"type": "text"})).structured_outputs is None
    assert convert(chat(thinking_token_budget=8)).thinking_token_budget == 8


@pytest.mark.parametrize("fields, expected", [
    (dict(response_format={"type": "json_object"}), dict(json_object=True)),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "strict": True, "schema": {"type": "integer"}}}), dict(json={"type": "integer"})),
    (dict(guided_json='{"type": "integer"}'), dict(json={"type": "integer"})),
    (dict(guided_regex="a+", guided_decoding_backend="llguidance"),
     dict(regex="a+", backend="guidance")),
    (dict(guided_choice=["x", "y"]), dict(choice=["x", "y"])),
    (dict(guided_grammar='root ::= "a"'), dict(grammar='root ::= "a"')),
    (dict(structured_outputs={"regex": "b", "disable_any_whitespace": True}),
     dict(regex="b", disable_any_whitespace=True)),
    (dict(response_format={"type": "json_object"},
          structured_outputs={"disable_any_whitespace": True}),
     dict(json_object=True, disable_any_whitespace=True)),
])
def test_structured_outputs_mapping(fields, expected):
    so = convert(chat(**fields)).structured_outputs
    assert so == StructuredOutputsParams(**expected)


@pytest.mark.parametrize("request_, param", [
    (completion(suffix="x"), "suffix"),
    (completion(best_of=3, stream=True), "best_of"),
    (completion(n=2, best_of=1), "best_of"),
    (completion(best_of=129), "best_of"),
    (chat(best_of=2, stream=True), "best_of"),
    (completion(stream_options={"include_usage": True}), "stream_options"),
    (completion(stream=True, prompt_logprobs=1), "prompt_logprobs"),
    (completion(logprobs=21), "logprobs"),
    (completion(temperature=-1), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(n=0), "n"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(presence_penalty=3), "presence_penalty"),
    (completion(min_tokens=20, max_tokens=10), "min_tokens"),
    (completion(logit_bias={"x": 1}), "logit_bias"),
    (completion(use_beam_search=True, temperature=0.5), "temperature"),
    (completion(use_beam_search=True, n=2, best_of=1), "n"),
    (completion(length_penalty=0.5), "length_penalty"),
    (completion(guided_regex="("), "guided_regex"),
    (completion(guided_json={"type": "nope"}), "guided_json"),
    (completion(guided_grammar="root ::= ("), "guided_grammar"),
    (completion(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    (completion(guided_regex="a", guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
    (completion(guided_regex="a", guided_decoding_backend="outlines"), "guided_decoding_backend"),
    (completion(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (completion(structured_outputs={"pattern": "a"}), "structured_outputs"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema.schema"),
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=30), "top_logprobs"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(modalities=["text", "audio"]), "modalities"),
    (chat(store=True), "store"),
])
def test_rejections_name_the_field(request_, param):
    e = rejected(request_, param)
    if e.code == "unsupported_parameter":
        assert "not supported" in e.message


def test_unknown_fields_are_ignored_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="ladle.protocol"):
        r = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "brand_new_field": 1})
    assert "brand_new_field" in caplog.text
    assert convert(r).n == 1


def test_template_messages():
    r = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])
    assert r.template_messages() == [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "a\nb"}]
    r = ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(RequestError, match="image_url"):
        r.template_messages()


# ---- logprobs ---------------------------------------------------------------------------------
def _run(tokenizer, token_ids, logprobs, num_top):
    """Feed crafted engine outputs through the output processor, as the server does."""
    from ladle.sampling_params import SamplingParams

    op = OutputProcessor(tokenizer)
    params = SamplingParams(logprobs=num_top, max_tokens=10)
    state = op.add_request("r", "hello", tokenizer.encode("hello"), ["r"], [params])
    deltas = []
    for i, t in enumerate(token_ids):
        lp = Logprobs(token_ids=[logprobs[i][0]], values=[logprobs[i][1]],
                      sampled_values=[logprobs[i][2]], sampled_ranks=[logprobs[i][3]])
        last = i == len(token_ids) - 1
        op.process([EngineCoreOutput("r", [t], finish_reason=1 if last else None, logprobs=lp)])
        deltas += state.take_deltas()
    return state, deltas


def test_logprobs_formatting(tokenizer):
    ids = tokenizer.encode(" world of tokens")
    # Per token: top-2 (ids, values), the sampled value and rank. Token 1 is not in its top-2.
    other = tokenizer.encode(" cat")[0]
    lps = [
        ([ids[0], other], [-0.1, -2.5], -0.1, 1),
        ([other, ids[0]], [-0.2, -1.9], -3.0, 7),
        ([ids[2], other], [-0.05, -float("inf")], -0.05, 1),
    ]
    state, deltas = _run(tokenizer, ids, lps, num_top=2)
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.token_id for e in entries] == ids
    names = TokenNames(tokenizer)
    text = "".join(d.text for d in deltas)
    assert text == " world of tokens"

    comp, end = completion_logprobs(names, ids, entries, 2, text_offset=0)
    assert comp.tokens == [" world", " of", " tokens"]
    assert comp.text_offset == [0, 6, 9] and end == len(text)
    assert comp.token_logprobs == [-0.1, -3.0, -0.05]
    assert comp.top_logprobs[0] == {" world": -0.1, " cat": -2.5}
    # The sampled token joins the top-k when it is not among them (up to k + 1 entries).
    assert comp.top_logprobs[1] == {" cat": -0.2, " world": -1.9, " of": -3.0}
    assert comp.top_logprobs[2][" cat"] == -9999.0  # -inf is not JSON; clamped as in vLLM

    chat_lp = chat_logprobs(names, entries, 2)
    first = chat_lp.content[0]
    assert (first.token, first.logprob, first.bytes) == (" world", -0.1, list(b" world"))
    assert [t.token for t in first.top_logprobs] == [" world", " cat"]
    assert chat_lp.content[1].top_logprobs[1].logprob == -1.9
    assert all(math.isfinite(t.logprob) for c in chat_lp.content for t in c.top_logprobs)
    # k = 0: only the sampled token.
    assert chat_logprobs(names, entries, 0).content[1].top_logprobs == []
    assert completion_logprobs(names, ids, entries, 0)[0].top_logprobs[1] == {" of": -3.0}

    # The offline output keeps vLLM's dict shape: sampled token first, then the top-k.
    out = state.to_output().outputs[0]
    assert list(out.logprobs[1]) == [ids[1], other, ids[0]]
    assert out.logprobs[1][ids[1]].rank == 7 and out.logprobs[1][other].rank == 1
    assert out.logprobs[1][ids[1]].decoded_token == " of"
    assert out.cumulative_logprob == pytest.approx(-3.15)


def test_logprobs_of_partial_utf8_tokens(tokenizer):
    names = TokenNames(tokenizer)
    ids = tokenizer.encode("猫🐈")
    assert b"".join(bytes(names.bytes(t)) for t in ids) == "猫🐈".encode()
    for t in ids:
        data = bytes(names.bytes(t))
        try:
            assert names(t) == data.decode()
        except UnicodeDecodeError:  # a piece of a character: OpenAI's "bytes:\\xNN" form
            assert names(t) == "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    assert TokenNames(tokenizer, as_token_ids=True)(ids[0]) == f"token_id:{ids[0]}"


# ---- responses parse with the openai client's types -------------------------------------------
def test_responses_parse_with_openai_types(tokenizer):
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    ids = tokenizer.encode(" a b")
    entries = [e for d in _run(tokenizer, ids, [([t], [-0.5], -0.5, 1) for t in ids], 1)[1]
               for e in d.logprobs]
    comp = CompletionResponse(id="cmpl-1", model="m", usage=usage, choices=[
        CompletionResponseChoice(index=0, text=" a b", finish_reason="stop", stop_reason="x",
                                 logprobs=completion_logprobs(TokenNames(tokenizer), ids,
                                                              entries, 1)[0])])
    parsed = oa.Completion.model_validate(comp.model_dump())
    assert parsed.choices[0].logprobs.tokens == [" a", " b"]
    assert parsed.choices[0].stop_reason == "x"  # vLLM's extra field survives
    assert parsed.object == "text_completion"

    msg = ChatCompletionMessage(content="hi")
    chat_resp = ChatCompletionResponse(id="chatcmpl-1", model="m", usage=usage, choices=[
        ChatCompletionResponseChoice(index=0, message=msg, finish_reason="length",
                                     logprobs=chat_logprobs(TokenNames(tokenizer), entries, 1))])
    parsed = oa_chat.ChatCompletion.model_validate(chat_resp.model_dump())
    assert parsed.choices[0].message.content == "hi"
    assert parsed.choices[0].logprobs.content[1].token == " b"

    chunk = ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
        ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant",
                                                                       content=""))])
    parsed = oa_chat.ChatCompletionChunk.model_validate_json(chunk.model_dump_json())
    assert parsed.choices[0].delta.role == "assistant"
    assert parsed.object == "chat.completion.chunk"
