"""gpt-oss's harmony format: the prompt ladle renders equals openai-harmony's; hand-built harmony
replies parse into the right reasoning, content and tool calls, streamed in any chunking and
whole (and as openai-harmony splits them); the constraints of tool_choice required / named and
response_format shape only their channel; and a server of a harmony model answers
tool_choice "required" with arguments valid for the tool's schema.

openai-harmony cannot load its vocabulary here; tests/harmony_reference.py runs it on a stand-in
one (the rendered text does not depend on it). The test tokenizer is Qwen's with the harmony
markers added as special tokens, as a gpt-oss tokenizer has them."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch
from harmony_reference import build_reference, run_reference

from ladle.entrypoints.harmony import (
    HarmonyTokens,
    harmony_constraint,
    harmony_reason,
    reasoning_token_count,
    render_harmony,
)
from ladle.entrypoints.tools import plan_tools
from ladle.parsers.choice import ChoiceOutputParser
from ladle.parsers.harmony import MAX_HEADER_CHARS, HarmonyParser
from ladle.parsers.reasoning import get_reasoning_parser
from ladle.parsers.tool import get_tool_parser
from ladle.parsers.types import ExtractedMessage, ToolCall, merge_deltas
from ladle.protocol.chat import ChatCompletionRequest
from ladle.protocol.common import RequestError

HARMONY_TOKENS = ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>")
FIRST_HARMONY_ID = 151669  # after Qwen's added tokens, inside ladle-demo's 151936 rows
DATE = "2025-06-28"
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


def add_harmony_tokens(tokenizer_json: dict, tokenizer_config: dict) -> dict[str, int]:
    """The harmony markers as special added tokens (in place); their ids."""
    ids = {}
    for i, token in enumerate(HARMONY_TOKENS):
        entry = {"content": token, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True}
        tokenizer_json["added_tokens"].append({"id": FIRST_HARMONY_ID + i, **entry})
        tokenizer_config["added_tokens_decoder"][str(FIRST_HARMONY_ID + i)] = entry
        ids[token] = FIRST_HARMONY_ID + i
    tokenizer_config.pop("chat_template", None)
    return ids


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from ladle.models.qwen_tokenizer import tokenizer_config, tokenizer_json

    out = tmp_path_factory.mktemp("harmony-tokenizer")
    tj, tc = tokenizer_json(), tokenizer_config(4096)
    add_harmony_tokens(tj, tc)
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False))
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def tokens(tokenizer) -> HarmonyTokens:
    return HarmonyTokens.from_tokenizer(tokenizer, "test")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = build_reference(tmp_path_factory.mktemp("openai-harmony"))
    if ref is None:
        pytest.skip("openai-harmony is not installed (pip install -e .[test]), or its binary "
                    "does not hold the o200k hash this stand-in replaces")
    return ref


# ---- rendering ---------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "description": "The city, e.g. Paris"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 3}},
    "required": ["city"], "additionalProperties": False}
# Every branch of openai-harmony's JSON Schema -> TypeScript rendering.
EVERY_BRANCH = {"type": "object", "description": "All of it.", "properties": {
    "title": {"type": "integer", "title": "Count", "default": 3},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
    "list": {"type": "array"},
    "nested": {"type": "object", "properties": {
        "x": {"type": "number", "nullable": True}, "y": {"type": ["string", "integer"]}},
        "required": ["x"]},
    "mode": {"description": "Mode.", "oneOf": [{"type": "string", "description": "Mode."},
                                               {"type": "integer", "description": "A number",
                                                "default": 1}], "default": "fast"},
    "pick": {"oneOf": [{"type": "string", "enum": ["p", "q"], "default": "p"},
                       {"type": "object", "properties": {"z": {"type": "boolean"}}}]},
    "ex": {"type": "string", "examples": ["one", "two"], "default": "d"},
    "obj": {"type": "object"}, "nul": {"type": "null"}, "untyped": {"enum": [1, 2]},
    "flag": {"type": "boolean", "default": False}, "deflt": {"type": "array", "default": [1]}},
    "required": ["title"]}
TOP_ONE_OF = {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}},
                         "description": "first", "default": {"a": "x"}},
                        {"type": "string", "enum": ["e"], "default": "e", "nullable": True}]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Weather forecast.\nPer city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "everything", "description": "Every branch.",
                                      "parameters": EVERY_BRANCH}},
    {"type": "function", "function": {"name": "no_args", "description": ""}},
    {"type": "function", "function": {"name": "top", "description": "A top-level oneOf",
                                      "parameters": TOP_ONE_OF}},
]


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name,
                                                            "arguments": arguments}}


def h_system(tools: bool, effort: str = "Medium", identity: str = IDENTITY) -> dict:
    channels = ["analysis", "commentary", "final"] if tools else ["analysis", "final"]
    return {"role": "system", "content": [{
        "type": "system_content", "model_identity": identity, "reasoning_effort": effort,
        "conversation_start_date": DATE, "knowledge_cutoff": "2024-06",
        "channel_config": {"valid_channels": channels, "channel_required": True}}]}


def h_developer(instructions: str | None, tools: list[dict] | None = None) -> dict:
    content: dict = {"type": "developer_content"}
    if instructions is not None:
        content["instructions"] = instructions
    if tools:
        content["tools"] = {"functions": {"name": "functions", "tools": [
            {"name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"].get("parameters")} for t in tools]}}
    return {"role": "developer", "content": [content]}


def h(role: str, text: str, **fields) -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}], **fields}


def h_call(name: str, arguments: str) -> dict:
    return h("assistant", arguments, channel="commentary", recipient=f"functions.{name}",
             content_type="json")


def h_result(name: str, output: str) -> dict:
    return h("tool", output, name=f"functions.{name}", channel="commentary",
             recipient="assistant")


PARIS, ROME = '{"city": "Paris"}', '{"city": "Rome", "days": 2}'
# (name, chat messages, tools, render kwargs, the harmony messages openai-harmony renders)
RENDER_CASES = [
    ("system, tools, calls and their results, analysis kept across the calls",
     [{"role": "system", "content": "Answer briefly."},
      {"role": "user", "content": "Weather in Paris, then Rome?"},
      {"role": "assistant", "reasoning_content": "Paris first.", "content": "",
       "tool_calls": [call("c1", "get_weather", PARIS)]},
      {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
      {"role": "assistant", "reasoning_content": "Now Rome.", "content": "Checking Rome.",
       "tool_calls": [call("c2", "get_weather", ROME)]},
      {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 25}'}],
     TOOLS, {},
     [h_system(True), h_developer("Answer briefly.", TOOLS),
      h("user", "Weather in Paris, then Rome?"),
      h("assistant", "Paris first.", channel="analysis"), h_call("get_weather", PARIS),
      h_result("get_weather", '{"temp": 20}'),
      h("assistant", "Now Rome.", channel="analysis"),
      h("assistant", "Checking Rome.", channel="commentary"), h_call("get_weather", ROME),
      h_result("get_weather", '{"temp": 25}')]),
    ("a finished turn's analysis is dropped; the current turn's is kept",
     [{"role": "user", "content": "Hi"},
      {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "reasoning": "Call it.", "tool_calls": [call("c1", "get_weather",
                                                                          PARIS)]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
     TOOLS[:1], {"reasoning_effort": "high"},
     [h_system(True, "High"), h_developer(None, TOOLS[:1]), h("user", "Hi"),
      h("assistant", "Hello!", channel="final"), h("user", "Weather in Paris?"),
      h("assistant", "Call it.", channel="analysis"), h_call("get_weather", PARIS),
      h_result("get_weather", "sunny")]),
    ("no tools, no system: only analysis and final are valid channels; effort low",
     [{"role": "user", "content": "2+2?"},
      {"role": "assistant", "thinking": "Easy.", "content": "4"},
      {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]}],
     None, {"reasoning_effort": "minimal", "model_identity": "You are a calculator."},
     [h_system(False, "Low", "You are a calculator."), h("user", "2+2?"),
      h("assistant", "4", channel="final"), h("user", "And 3+3?")]),
    ("developer and later system messages are instructions; a result found by name",
     [{"role": "developer", "content": "Be terse."}, {"role": "system", "content": "No emoji."},
      {"role": "user", "content": "Go"},
      {"role": "assistant", "content": "", "tool_calls": [call("x", "no_args", "{}")]},
      {"role": "tool", "name": "no_args", "content": "done"},
      {"role": "system", "content": "Now summarise."}],
     TOOLS[2:3], {},
     [h_system(True), h_developer("Be terse.\n\nNo emoji.", TOOLS[2:3]), h("user", "Go"),
      h_call("no_args", "{}"), h_result("no_args", "done"),
      h_developer("Now summarise.")]),
    ("every branch of the tools' TypeScript", [{"role": "user", "content": "?"}], TOOLS, {},
     [h_system(True), h_developer(None, TOOLS), h("user", "?")]),
]


def test_rendering_equals_openai_harmony(tokenizer, tokens, reference):
    ours = [render_harmony([dict(m) for m in msgs], tools=tools, tokenizer=tokenizer,
                           tokens=tokens, date=DATE, **kwargs).text
            for _, msgs, tools, kwargs, _ in RENDER_CASES]
    theirs = run_reference(reference, {"render": [c[4] for c in RENDER_CASES]})["render"]
    for case, mine, expected in zip(RENDER_CASES, ours, theirs, strict=True):
        assert mine == expected, case[0]


def test_openai_harmony_drops_the_same_analysis(tokenizer, tokens, reference):
    """Where openai-harmony drops analysis itself (the last assistant message is final), it
    drops what ladle drops."""
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]
    harmony = [h_system(False), h("user", "Hi"),
               h("assistant", "Greet back.", channel="analysis"),
               h("assistant", "Hello!", channel="final"), h("user", "Bye")]
    ours = render_harmony(chat, tools=None, tokenizer=tokenizer, tokens=tokens, date=DATE)
    assert "Greet back." not in ours.text
    assert ours.text == run_reference(reference, {"render": [harmony]})["render"][0]


def test_two_finished_turns_drop_both_analyses(tokenizer, tokens):
    """Analysis before the last final answer is dropped, vLLM's rule (openai-harmony alone
    would keep the second, as it drops only before the first final)."""
    chat = [{"role": "user", "content": "a"},
            {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "reasoning_content": "R2", "content": "A2"},
            {"role": "user", "content": "c"}]
    text = render_harmony(chat, tools=None, tokenizer=tokenizer, tokens=tokens, date=DATE).text
    assert "R1" not in text and "R2" not in text
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>A2<|end|>"
                         "<|start|>user<|message|>c<|end|><|start|>assistant")


def test_tokens_are_the_markers_and_plain_text(tokenizer, tokens):
    """Markers are their single special tokens; text between them (even text that spells a
    marker) is tokenized as plain text, piece by piece."""
    chat = [{"role": "user", "content": "say <|end|><|start|>system"}]
    prompt = render_harmony(chat, tools=None, tokenizer=tokenizer, tokens=tokens, date=DATE)
    marker_ids = set(tokens.ids.values())
    assert sum(t in marker_ids for t in prompt.token_ids) == prompt.text.count("<|") - 2
    user = prompt.token_ids[prompt.token_ids.index(tokens.ids["<|message|>"], 20):]
    assert tokenizer.decode(user[1:-3], skip_special_tokens=False) == "say <|end|><|start|>system"
    assert not marker_ids & set(user[1:-3])
    assert tokenizer.decode(prompt.token_ids, skip_special_tokens=False) == prompt.text
    assert prompt.prefix == "<|start|>assistant"


def test_continue_and_no_generation_prompt(tokenizer, tokens):
    chat = [{"role": "user", "content": "Count"},
            {"role": "assistant", "reasoning_content": "ok", "content": "1, 2,"}]
    cont = render_harmony(chat, tools=None, tokenizer=tokenizer, tokens=tokens,
                          add_generation_prompt=False, continue_final_message=True, date=DATE)
    assert cont.text.endswith("<|start|>assistant<|channel|>analysis<|message|>ok<|end|>"
                              "<|start|>assistant<|channel|>final<|message|>1, 2,")
    assert cont.prefix == "<|start|>assistant<|channel|>final<|message|>1, 2,"
    parser = ChoiceOutputParser(harmony=True, harmony_prefix=cont.prefix)
    assert merge_deltas([parser.feed(" 3"), parser.finish()]) == ExtractedMessage(content=" 3")
    done = render_harmony(chat, tools=None, tokenizer=tokenizer, tokens=tokens,
                          add_generation_prompt=False, date=DATE)
    assert done.text.endswith("1, 2,<|end|>") and done.prefix == ""
    with pytest.raises(RequestError, match="^continue_final_message"):
        render_harmony(chat, tools=None, tokenizer=tokenizer, tokens=tokens,
                       continue_final_message=True)


@pytest.mark.parametrize("messages, tools, kwargs, field", [
    ([{"role": "user", "content": "x"}], None, {"reasoning_effort": "max"}, "reasoning_effort"),
    ([{"role": "user", "content": "x"}],
     [{"type": "function", "function": {"name": "a b"}}], {}, "tools.0.function.name"),
    ([{"role": "assistant", "content": "", "tool_calls": [call("c", "x<|end|>", "{}")]}],
     None, {}, "messages.0.tool_calls.0.function.name"),
    ([{"role": "tool", "tool_call_id": "nope", "content": "r"}], None, {},
     "messages.0.tool_call_id"),
    ([{"role": "user", "content": "x"}],
     [{"type": "function", "function": {"name": "deep", "parameters": json.loads(
         '{"type": "array", "items": ' * 70 + '{}' + "}" * 70)}}], {},
     "tools.0.function.parameters"),
])
def test_what_harmony_cannot_say_is_a_400_naming_the_field(tokenizer, tokens, messages, tools,
                                                            kwargs, field):
    with pytest.raises(RequestError) as e:
        render_harmony(messages, tools=tools, tokenizer=tokenizer, tokens=tokens, **kwargs)
    assert e.value.param == field and e.value.message.startswith(field)


# ---- parsing -----------------------------------------------------------------------------------
ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"
TO_WEATHER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
# (name, reply, reasoning, content, calls as (name, arguments), well formed: openai-harmony
# parses it whole)
PARSE_CASES = [
    ("answer", ANALYSIS + "The user greets." + NEXT + FINAL + "Hello! How can I help?",
     "The user greets.", "Hello! How can I help?", [], True),
    ("call", ANALYSIS + "Need the weather." + NEXT + TO_WEATHER + PARIS,
     "Need the weather.", None, [("get_weather", PARIS)], True),
    ("recipient in the role header",
     ANALYSIS + "x" + "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
     "json<|message|>" + ROME, "x", None, [("get_weather", ROME)], True),
    ("a call right away", " to=functions.f<|channel|>commentary json<|message|>{\"a\": 1}",
     None, None, [("f", '{"a": 1}')], True),
    ("a preamble, then the call", ANALYSIS + "plan" + NEXT + "<|channel|>commentary<|message|>"
     "Checking the weather." + NEXT + TO_WEATHER + "{}", "plan", "Checking the weather.",
     [("get_weather", "{}")], True),
    ("two analysis messages", ANALYSIS + "first" + NEXT + ANALYSIS + "second" + NEXT + FINAL
     + "done", "first\nsecond", "done", [], True),
    ("ended by <|return|> kept in the text", FINAL + "ok<|return|>", None, "ok", [], True),
    ("a built-in tool's call is reasoning", ANALYSIS + "search" + NEXT
     + "<|channel|>analysis to=browser.search code<|message|>{\"q\": 1}", "search\n{\"q\": 1}",
     None, [], True),
    ("no channel is content", "<|message|>plain", None, "plain", [], True),
    ("marker-like text is text", FINAL + "a <| b |> c <|endx|> <|chan", None,
     "a <| b |> c <|endx|> <|chan", [], True),
    ("cut inside the reasoning", ANALYSIS + "still thinking <|en", "still thinking <|en", None,
     [], True),
    ("cut inside a header", ANALYSIS + "r" + NEXT + "<|channel|>fin", "r", None, [], False),
    ("cut inside the arguments", TO_WEATHER + '{"city": "Pa', None, None,
     [("get_weather", '{"city": "Pa')], True),
    ("a tool answer the model writes itself is dropped", FINAL + "ok<|end|><|start|>functions.f "
     "to=assistant<|channel|>commentary<|message|>{\"x\": 1}<|end|>", None, "ok", [], True),
    ("text outside any message is content", FINAL + "a<|end|>stray<|call|> more", None,
     "astray more", [], False),
]


def expected_message(reasoning, content, calls) -> ExtractedMessage:
    return ExtractedMessage(reasoning=reasoning, content=content, tool_calls=[
        ToolCall(f"call_{i}", name, arguments) for i, (name, arguments) in enumerate(calls)])


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def chunkings(text: str, seed: int, three_way: bool = True):
    """Every 1-, 2- and 3-way split of text, 200 random ones, and one character at a time."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    if three_way:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                yield [text[:i], text[i:j], text[j:]]
    rng = random.Random(seed)
    for _ in range(200):
        chunks, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, 16)
            chunks.append(text[pos : pos + size])
            pos += size
        yield chunks
    yield list(text)


def parse(chunks, **kw) -> ExtractedMessage:
    kw.setdefault("tool_mode", "auto")
    parser = ChoiceOutputParser(harmony=True, id_factory=counting_ids(), **kw)
    return merge_deltas([parser.feed(c) for c in chunks] + [parser.finish()])


@pytest.mark.parametrize("case", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_every_chunking_parses_to_the_message(case):
    _, text, reasoning, content, calls, _ = case
    expected = expected_message(reasoning, content, calls)
    whole = ChoiceOutputParser(harmony=True, tool_mode="auto", id_factory=counting_ids())
    assert whole.extract(text) == expected
    for n, chunks in enumerate(chunkings(text, seed=len(text))):
        assert parse(chunks) == expected, (n, chunks)


def test_openai_harmony_splits_the_replies_the_same_way(reference):
    """openai-harmony's parse of each well-formed reply, read with the same channel rules,
    gives the message ladle's parser gives."""
    cases = [c for c in PARSE_CASES if c[5]]
    parsed = run_reference(reference, {"parse": [c[1] for c in cases]})["parse"]
    for case, messages in zip(cases, parsed, strict=True):
        reasoning, content, calls = [], [], []
        for m in messages:
            text = "".join(part["text"] for part in m["content"])
            recipient = m.get("recipient")
            if m["role"] != "assistant":
                continue
            if recipient and recipient.startswith("functions."):
                calls.append((recipient.removeprefix("functions."), text))
            elif recipient not in (None, "all") or m.get("channel") == "analysis":
                reasoning.append(text)
            else:
                content.append(text)
        expected = expected_message("\n".join(reasoning) or None, "\n".join(content) or None,
                                    calls)
        assert parse([case[1]]) == expected, case[0]


@pytest.mark.parametrize("case", [c for c in PARSE_CASES if c[5]], ids=[c[0] for c in
                                                                    PARSE_CASES if c[5]])
def test_token_streams_through_the_detokenizer(tokenizer, tokens, case):
    """The server's path: the reply's token ids, one at a time through ladle's incremental
    detokenizer with special tokens kept, then the parser; ended by <|call|> (a stop token,
    whose text the detokenizer leaves out)."""
    from ladle.frontend.detokenizer import IncrementalDetokenizer

    _, text, reasoning, content, calls, _ = case
    prompt = render_harmony([{"role": "user", "content": "hi"}], tools=None, tokenizer=tokenizer,
                            tokens=tokens, date=DATE)
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokens.ids["<|call|>"]]
    detok = IncrementalDetokenizer(tokenizer, prompt.token_ids, skip_special_tokens=False)
    parser = ChoiceOutputParser(harmony=True, tool_mode="auto", id_factory=counting_ids(),
                                harmony_prefix=prompt.prefix)
    deltas = []
    for i, t in enumerate(ids):
        is_last = i == len(ids) - 1
        detok.update([t], stop_terminated=is_last)
        deltas.append(parser.feed(detok.get_next_output_text(finished=is_last, delta=True)))
    deltas.append(parser.finish())
    assert merge_deltas(deltas) == expected_message(reasoning, content, calls)


def test_a_header_without_message_is_content_after_its_limit():
    """A header is held until <|message|>, but not without bound: past MAX_HEADER_CHARS it is
    read as content, the same way for every chunking."""
    text = "<|channel|>" + "x" * (MAX_HEADER_CHARS + 40) + "<|message|>hi<|end|>"
    expected = parse([text])
    assert expected.content.startswith("assistant<|channel|>xxx")
    assert expected.content.endswith("<|message|>hi") and expected.reasoning is None
    for chunks in chunkings(text, seed=7, three_way=False):
        assert parse(chunks) == expected
    parser = HarmonyParser(counting_ids())
    assert parser.feed("<|channel|>" + "x" * (MAX_HEADER_CHARS + 40)).content is not None


def test_the_choice_parser_applies_the_request():
    text = ANALYSIS + "why" + NEXT + TO_WEATHER + PARIS
    message = parse([text], include_reasoning=False)
    assert message.reasoning is None and message.tool_calls[0].arguments == PARIS
    none = ChoiceOutputParser(harmony=True, tool_mode="none")
    assert merge_deltas([none.feed(text), none.finish()]) == ExtractedMessage(reasoning="why")
    assert none.finish_reason("stop") == "stop"
    required = ChoiceOutputParser(harmony=True, tool_mode="required", id_factory=counting_ids())
    deltas = [required.feed(c) for c in [ANALYSIS + "why", NEXT + TO_WEATHER, '{"city": ',
                                         '"Paris"}']] + [required.finish()]
    assert [d.tool_calls[0].name for d in deltas if d.tool_calls and d.tool_calls[0].id] == [
        "get_weather"]  # announced once, then the arguments as they come
    assert [d.tool_calls[0].arguments for d in deltas if d.tool_calls] == ["", '{"city": ',
                                                                           '"Paris"}']
    assert required.finish_reason("stop") == "tool_calls"
    assert required.finish_reason("length") == "length"


def test_the_registered_names_are_the_same_parser():
    text = ANALYSIS + "r" + NEXT + FINAL + "c"
    assert get_reasoning_parser("openai_gptoss")().extract(text) == ("r", "c")
    calls = get_tool_parser("openai")(counting_ids()).extract(ANALYSIS + "r" + NEXT + TO_WEATHER
                                                                + PARIS)
    assert calls == ExtractedMessage(tool_calls=[ToolCall("call_0", "get_weather", PARIS)])


def test_harmony_reason(tmp_path):
    assert harmony_reason(tmp_path, "openai_gptoss", None) == "--reasoning-parser openai_gptoss"
    assert harmony_reason(tmp_path, None, "openai") == "--tool-call-parser openai"
    assert harmony_reason(tmp_path, "qwen3", "hermes") is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert "model_type gpt_oss" in harmony_reason(tmp_path, None, None)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert harmony_reason(tmp_path, None, None) is None


def test_reasoning_tokens_are_those_before_the_answer(tokens):
    end, msg = tokens.ids["<|end|>"], tokens.ids["<|message|>"]
    assert reasoning_token_count([1, msg, 2, 3, end, 4, msg, 5], tokens) == 5
    assert reasoning_token_count([1, msg, 2], tokens) == 3


# ---- constraints ---------------------------------------------------------------------------------
CHOICE_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"],
        "additionalProperties": False}}},
]
PERSON = {"type": "object",  # bounded, so a random model's answer ends
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name"], "additionalProperties": False}
GOOD_CALL = ANALYSIS + "thinking" + NEXT + TO_WEATHER + '{"city": "Paris", "days": 2}'


def constraint_for(**fields):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    plan = plan_tools(request, enable_auto_tool_choice=False, tool_call_parser=None,
                      harmony=True)
    return harmony_constraint(request, plan)


@pytest.fixture(scope="module")
def matcher(tokenizer, tokens):
    import xgrammar as xgr

    stops = [tokens.ids["<|call|>"], tokens.ids["<|return|>"]]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=151936,
                                              stop_token_ids=stops)
    compiler = xgr.GrammarCompiler(info)

    def accepts(params, text: str, stop: str | None) -> bool:
        m = xgr.GrammarMatcher(compiler.compile_structural_tag(params.structural_tag))
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids += [tokens.ids[stop]] if stop else []
        return all(m.accept_token(t) for t in ids) and (stop is None or m.is_terminated())

    return accepts


@pytest.mark.parametrize("fields, text, stop, ok", [
    ({"tool_choice": "required"}, GOOD_CALL, "<|call|>", True),
    ({"tool_choice": "required"}, TO_WEATHER + '{"city": "Rome", "days": 7}', "<|call|>", True),
    ({"tool_choice": "required"}, " to=functions.set_alarm<|channel|>commentary json<|message|>"
     '{"hour": 7}', "<|call|>", True),
    ({"tool_choice": "required"}, TO_WEATHER + '{"city": "Oslo", "days": 2}', None, False),
    ({"tool_choice": "required"}, ANALYSIS + "x" + NEXT + FINAL + "hi", None, False),
    ({"tool_choice": {"type": "function", "function": {"name": "set_alarm"}}},
     GOOD_CALL, None, False),
    ({"tool_choice": {"type": "function", "function": {"name": "set_alarm"}}},
     "<|channel|>commentary to=functions.set_alarm <|constrain|>json<|message|>{\"hour\": 7}",
     "<|call|>", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     ANALYSIS + "a person" + NEXT + FINAL + '{"name": "Ada"}', "<|return|>", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     FINAL + "Ada", None, False),
    ({"response_format": {"type": "json_object"}}, FINAL + '{"any": [1]}', "<|return|>", True),
    ({"guided_choice": ["yes", "no"]}, ANALYSIS + "hm" + NEXT + FINAL + "no", "<|return|>",
     True),
    ({"tool_choice": "auto", "response_format": {"type": "json_object"}}, GOOD_CALL,
     "<|call|>", True),
    ({"tool_choice": "auto", "response_format": {"type": "json_object"}}, FINAL + "plain", None,
     False),
    ({"tool_choice": "none", "response_format": {"type": "json_object"}}, GOOD_CALL, None, False),
])
def test_constraints_shape_only_their_channel(matcher, fields, text, stop, ok):
    params = constraint_for(tools=CHOICE_TOOLS, **fields)
    assert params.kind == "structural_tag"
    assert matcher(params, text, stop) is ok


def test_strict_tools_in_auto_mode(matcher):
    tools = [dict(t, function={**t["function"], "strict": True}) if i == 0 else t
             for i, t in enumerate(CHOICE_TOOLS)]
    params = constraint_for(tools=tools)
    assert matcher(params, GOOD_CALL, "<|call|>")
    assert not matcher(params, TO_WEATHER + '{"city": "Oslo", "days": 2}', None)
    assert matcher(params, " to=functions.set_alarm<|channel|>commentary json<|message|>"
                   '{"hour": 7, "extra": true}', "<|call|>")  # not strict: any object
    assert matcher(params, ANALYSIS + "x" + NEXT + FINAL + "free text", "<|return|>")


def test_nothing_to_constrain_is_no_constraint():
    assert constraint_for(tools=CHOICE_TOOLS) is None
    assert constraint_for() is None
    own = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    assert constraint_for(structured_outputs={"structural_tag": json.dumps(own)}).kind == \
        "structural_tag"  # the client's own tag: the whole output, as sent


# ---- a server ------------------------------------------------------------------------------------
def harmony_checkpoint(out: Path) -> dict[str, int]:
    """A tiny random gpt-oss (GptOssForCausalLM, model_type gpt_oss: the server speaks harmony
    without being told) with ladle-demo's tokenizer plus the harmony markers, and gpt-oss's stop
    ids (<|return|>, <|call|>, <|endoftext|>) in its generation_config."""
    import transformers as tf

    from ladle.models.demo import demo_config, ensure_demo_model

    demo = Path(ensure_demo_model())
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=demo_config()["vocab_size"], hidden_size=64, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        max_position_embeddings=4096))
    with torch.no_grad():  # a spread that makes the random model's choices vary
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed" in name else 0.3)
    model.save_pretrained(out)
    tj = json.loads((demo / "tokenizer.json").read_text())
    tc = json.loads((demo / "tokenizer_config.json").read_text())
    ids = add_harmony_tokens(tj, tc)
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False))
    generation = json.loads((demo / "generation_config.json").read_text())
    generation["eos_token_id"] = [ids["<|return|>"], ids["<|call|>"], 151643]
    (out / "generation_config.json").write_text(json.dumps(generation))
    return ids


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_server import RemoteServer

    path = tmp_path_factory.mktemp("harmony-model") / "model"
    ids = harmony_checkpoint(path)
    s = RemoteServer("--max-model-len", "2048", "--dtype", "float32", "--disable-access-log",
                     "--api-key", "test-key", "--served-model-name", "gpt-oss-test",
                     model=str(path))
    s.ids = ids
    yield s
    assert s.stop() == 0, s.log()
    shutil.rmtree(path.parent, ignore_errors=True)


def chat(server, **kw):
    # The random model almost never writes <|end|> by itself; a bias ends each analysis
    # message at once, so the constrained reply reaches its call or answer quickly.
    kw.setdefault("logit_bias", {str(server.ids["<|end|>"]): 60})
    return server.client(timeout=300).chat.completions.create(
        model="gpt-oss-test", messages=[{"role": "user", "content": "Plan my morning."}],
        max_tokens=800, temperature=1.0, **kw)


def test_server_required_calls_validate(server):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CHOICE_TOOLS}
    for seed in range(3):
        response = chat(server, tools=CHOICE_TOOLS, tool_choice="required", seed=seed)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", (choice, server.log())
        (c,) = choice.message.tool_calls
        assert c.id.startswith("call_") and c.function.name in schemas
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        assert not choice.message.content


def test_server_stream_equals_response_and_named_call(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(server, tools=CHOICE_TOOLS, tool_choice=named, seed=5)
    chunks = list(chat(server, tools=CHOICE_TOOLS, tool_choice=named, seed=5, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    arguments = "".join(p.function.arguments or "" for c in chunks if c.choices
                        for p in c.choices[0].delta.tool_calls or [])
    message = whole.choices[0].message
    assert message.tool_calls[0].function.name == "get_weather"
    assert arguments == message.tool_calls[0].function.arguments
    assert reasoning == (message.reasoning_content or "")
    jsonschema.validate(json.loads(arguments), CHOICE_TOOLS[0]["function"]["parameters"])


def test_server_response_format_shapes_the_final_answer(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    response = chat(server, response_format=fmt, seed=1)
    choice = response.choices[0]
    assert choice.finish_reason == "stop", (choice, server.log())
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert not choice.message.tool_calls


def test_server_responses_api_function_call_item(server):
    response = server.client(timeout=300).responses.create(
        model="gpt-oss-test", input="Weather?", tools=[
            {"type": "function", **CHOICE_TOOLS[0]["function"]}],
        tool_choice="required", max_output_tokens=800, temperature=1.0,
        extra_body={"seed": 2, "logit_bias": {str(server.ids["<|end|>"]): 60}})
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CHOICE_TOOLS[0]["function"]["parameters"])


def test_server_prompt_is_harmony(server):
    import httpx

    body = {"model": "gpt-oss-test", "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(server.url + "/tokenize", json=body,
                   headers={"Authorization": "Bearer test-key"})
    ids = r.json()["tokens"]
    start, end = server.ids["<|start|>"], server.ids["<|end|>"]
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2  # system, user
    assert server.ids["<|channel|>"] not in ids
