"""Reasoning and tool-call parsers: every way of chunking a text must stream to the same message
as parsing it whole, and that message must be the one a client expects."""

import itertools
import json
import random
import re

import pytest

from ladle.parsers.choice import ChoiceOutputParser, output_starts_in_reasoning
from ladle.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    get_reasoning_parser,
)
from ladle.parsers.tool import HermesToolParser, get_tool_parser
from ladle.parsers.types import DeltaMessage, ExtractedMessage, ToolCall, merge_deltas


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def chunkings(text: str, seed: int = 0):
    """Every 1-, 2- and (for short texts) 3-way split of text, plus random ones."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    if len(text) <= 120:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                yield [text[:i], text[i:j], text[j:]]
    rng = random.Random(seed)
    for _ in range(200):
        chunks, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, 12)
            chunks.append(text[pos : pos + size])
            pos += size
        yield chunks
    yield list(text)


def stream(parser, chunks) -> list[DeltaMessage]:
    return [parser.feed(chunk) for chunk in chunks] + [parser.finish()]


# ---------------------------------------------------------------- reasoning

QWEN3_CASES = [
    # (prompt_ends_in_think, output, reasoning, content)
    (False, "<think>plan</think>answer", "plan", "answer"),
    (False, "<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
    (False, "\n<think>plan</think>answer", "plan", "answer"),
    (False, "plain answer", None, "plain answer"),
    (False, "  two spaces then text", None, "  two spaces then text"),
    (False, "<think>cut off by max_tokens", "cut off by max_tokens", None),
    (False, "<think></think>answer", None, "answer"),
    (False, "<think>plan</think>", "plan", None),
    (False, "<thin", None, "<thin"),
    (False, "\n", None, "\n"),
    (False, "", None, None),
    (False, "a <think> later is text", None, "a <think> later is text"),
    (False, "<think>a</think>b</think>c<think>", "a", "b</think>c<think>"),
    (False, "<think>a <thinking> b </thin> c</think>d", "a <thinking> b </thin> c", "d"),
    (True, "plan</think>answer", "plan", "answer"),
    (True, "\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
    (True, "<think>plan</think>answer", "plan", "answer"),
    (True, "still thinking", "still thinking", None),
    (True, "</think>answer", None, "answer"),
    (True, "<", "<", None),
    (True, "plan</thi", "plan</thi", None),
]

DEEPSEEK_CASES = [
    # (output, reasoning, content)
    ("plan</think>answer", "plan", "answer"),
    ("<think>plan</think>answer", "plan", "answer"),
    ("\n<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
    ("never closed", "never closed", None),
    ("</think>answer", None, "answer"),
    ("  <thi", "  <thi", None),
    ("a</think>b</think>", "a", "b</think>"),
]

REASONING_CASES = [
    (Qwen3ReasoningParser, flag, text, reasoning, content)
    for flag, text, reasoning, content in QWEN3_CASES
] + [
    (DeepSeekR1ReasoningParser, False, text, reasoning, content)
    for text, reasoning, content in DEEPSEEK_CASES
]


@pytest.mark.parametrize("cls, flag, text, reasoning, content", REASONING_CASES)
def test_reasoning_extract(cls, flag, text, reasoning, content):
    assert cls(prompt_ends_in_think=flag).extract(text) == (reasoning, content)


@pytest.mark.parametrize("cls, flag, text, reasoning, content", REASONING_CASES)
def test_reasoning_stream_matches_extract_for_every_chunking(cls, flag, text, reasoning, content):
    for chunks in chunkings(text):
        message = merge_deltas(stream(cls(prompt_ends_in_think=flag), chunks))
        assert (message.reasoning, message.content) == (reasoning, content), chunks


def test_qwen3_bare_end_tag_without_prompt_flag():
    """Documented difference: extract can look ahead, a stream has already sent the content."""
    text = "plan</think>answer"
    assert Qwen3ReasoningParser().extract(text) == ("plan", "answer")
    for chunks in chunkings(text):
        message = merge_deltas(stream(Qwen3ReasoningParser(), chunks))
        assert (message.reasoning, message.content) == (None, "plananswer"), chunks


def test_deepseek_ignores_prompt_flag():
    assert DeepSeekR1ReasoningParser(prompt_ends_in_think=False).extract("a</think>b") == ("a", "b")


def test_whole_think_block_in_one_delta():
    parser = Qwen3ReasoningParser()
    delta = parser.feed("<think>plan</think>answer")
    assert (delta.reasoning, delta.content) == ("plan", "answer")
    assert parser.is_reasoning_end
    assert parser.finish().is_empty


def test_partial_end_tag_is_held_back_then_released():
    parser = DeepSeekR1ReasoningParser()
    delta = parser.feed("plan</th")
    assert (delta.reasoning, delta.content) == ("plan", None)
    delta = parser.feed("ink>ans")
    assert (delta.reasoning, delta.content) == (None, "ans")
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("plan</th").reasoning == "plan"
    assert parser.feed("at").reasoning == "</that"


def test_is_reasoning_end():
    parser = Qwen3ReasoningParser()
    assert not parser.is_reasoning_end  # "<thi" could still open a think block
    parser.feed("<thi")
    assert not parser.is_reasoning_end
    parser.feed("nk>plan</think")
    assert not parser.is_reasoning_end
    parser.feed(">")
    assert parser.is_reasoning_end

    parser = Qwen3ReasoningParser()
    parser.feed("Hello")  # no think block: content from the first character
    assert parser.is_reasoning_end

    parser = Qwen3ReasoningParser(prompt_ends_in_think=True)
    parser.feed("Hello")
    assert not parser.is_reasoning_end


def test_extract_does_not_disturb_stream():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("pla").reasoning == "pla"
    assert parser.extract("x</think>y") == ("x", "y")
    assert parser.feed("n</think>ok").content == "ok"


def test_output_starts_in_reasoning_from_the_prompt_text():
    """Without the tokenizer, the prompt text's last think tag decides (as the engine does with
    the token ids): an open block or none at all means the output starts inside reasoning."""
    assert output_starts_in_reasoning("qwen3", [], None, "<|im_start|>assistant\n<think>\n")
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert not output_starts_in_reasoning("qwen3", [], None, closed)
    assert output_starts_in_reasoning("qwen3", [], None, "<|im_start|>assistant\n")
    assert not output_starts_in_reasoning(None, [], None, "<think>")


def test_unknown_reasoning_parser_lists_names():
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert issubclass(get_reasoning_parser("deepseek_r1"), ReasoningParser)
    with pytest.raises(ValueError, match="'nope'.*deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("nope")


# ---------------------------------------------------------------- tool calls


def call_block(obj_text: str) -> str:
    return f"<tool_call>\n{obj_text}\n</tool_call>"


WEATHER = call_block('{"name": "get_weather", "arguments": {"city": "Paris"}}')
TIME = call_block('{"name": "get_time", "arguments": {"tz": "UTC"}}')
TRICKY_ARGS = (
    r'{"q": "a \"quoted\" {brace} [x] \\ back\\", "nested": {"x": [1, {"y": "}"}], "e": {}},'
    r' "n": -1.5e3, "t": true, "z": null}'
)

TOOL_CASES = [
    # (text, content, [(name, arguments)])
    (WEATHER, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n\n" + WEATHER, "Let me check.\n\n", [("get_weather", '{"city": "Paris"}')]),
    (
        WEATHER + "\n" + TIME + "\n",
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')],
    ),
    (WEATHER + TIME, None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]),
    (
        call_block('{"name": "search", "arguments": ' + TRICKY_ARGS + "}"),
        None,
        [("search", json.dumps(json.loads(TRICKY_ARGS), ensure_ascii=False))],
    ),
    (
        call_block('{"arguments":{"a":{"b":[1,2,{"c":"}}"}]}},"name":"f"}'),
        None,
        [("f", '{"a": {"b": [1, 2, {"c": "}}"}]}}')],
    ),
    (
        call_block(
            '{"name": "translate", "arguments": {"text": "Zürich 東京 😀 \\u00e9 \\ud83d\\ude00"}}'
        ),
        None,
        [("translate", '{"text": "Zürich 東京 😀 é 😀"}')],
    ),
    (call_block('{"name": "now"}'), None, [("now", "{}")]),
    (
        WEATHER + "\nDone. <b>bold</b>",
        "\nDone. <b>bold</b>",
        [("get_weather", '{"city": "Paris"}')],
    ),
    ("Hi " + WEATHER + " bye", "Hi  bye", [("get_weather", '{"city": "Paris"}')]),
    # Not calls: the text stays content, tags and all.
    # Announced (name and the arguments' brace), then not JSON: the call keeps the fragments
    # already streamed and the rest of the block is content.
    (call_block('{"name": "f", "arguments": {"a": }'), "}\n", [("f", '{"a": ')]),
    (call_block('{"arguments": {}}'), call_block('{"arguments": {}}'), []),
    (call_block('["f"]'), call_block('["f"]'), []),
    (
        call_block('{"name": "f", "arguments": [1]}'),
        call_block('{"name": "f", "arguments": [1]}'),
        [],
    ),
    (call_block('{"name": "f", "arguments": {"x": NaN}}'), "NaN}}\n", [("f", '{"x": ')]),
    (call_block('{"name": "f"} extra'), call_block('{"name": "f"} extra'), []),
    (
        call_block("{oops}") + "\n" + WEATHER,
        call_block("{oops}"),
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        WEATHER + "\n" + call_block("{oops}") + "\n",
        call_block("{oops}") + "\n",
        [("get_weather", '{"city": "Paris"}')],
    ),
    # Never closed: parsed if complete, else left as text.
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    ('<tool_call>{"name": "f"}</tool_', '<tool_call>{"name": "f"}</tool_', []),
    # Cut inside the arguments (max_tokens): the announced call keeps what was sent.
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', None, [("f", '{"a": [1, ')]),
    # No calls at all.
    ("Hi <tool_ca", "Hi <tool_ca", []),
    ("a < b and <tool> </tool_call> text", "a < b and <tool> </tool_call> text", []),
    ("\n", "\n", []),
    ("", None, []),
]


def expected_message(content, calls) -> ExtractedMessage:
    return ExtractedMessage(
        content=content,
        tool_calls=[
            ToolCall(id=f"call_{i}", name=name, arguments=arguments)
            for i, (name, arguments) in enumerate(calls)
        ],
    )


@pytest.mark.parametrize("text, content, calls", TOOL_CASES)
def test_hermes_extract(text, content, calls):
    parser = HermesToolParser(id_factory=counting_ids())
    assert parser.extract(text) == expected_message(content, calls)


@pytest.mark.parametrize("text, content, calls", TOOL_CASES)
def test_hermes_stream_matches_extract_for_every_chunking(text, content, calls):
    expected = expected_message(content, calls)
    for chunks in chunkings(text):
        deltas = stream(HermesToolParser(id_factory=counting_ids()), chunks)
        assert merge_deltas(deltas) == expected, chunks
        # OpenAI's shape: the first piece of each call carries its index, id and name.
        pieces = [piece for delta in deltas for piece in delta.tool_calls]
        first_pieces = [piece for piece in pieces if piece.id is not None]
        assert [piece.index for piece in first_pieces] == list(range(len(calls)))
        assert all(piece.name for piece in first_pieces)


def test_two_whole_calls_in_one_delta():
    parser = HermesToolParser(id_factory=counting_ids())
    delta = parser.feed("Sure.\n" + WEATHER + "\n" + TIME)
    assert delta.content == "Sure.\n"
    assert merge_deltas([delta]).tool_calls == [
        ToolCall("call_0", "get_weather", '{"city": "Paris"}'),
        ToolCall("call_1", "get_time", '{"tz": "UTC"}'),
    ]
    assert parser.finish().is_empty


def test_arguments_stream_as_they_are_written():
    parser = HermesToolParser(id_factory=counting_ids())
    assert parser.feed("Hi <tool_").content == "Hi "  # the partial tag is held back
    assert parser.feed('call>\n{"name": "f", "argu').is_empty  # the name is not certain yet
    delta = parser.feed('ments": {"city": "Par')
    assert [(c.index, c.id, c.name, c.arguments) for c in delta.tool_calls] == [
        (0, "call_0", "f", ""), (0, None, None, '{"city": "Par')]
    delta = parser.feed('is", "days":')
    assert [(c.index, c.id, c.arguments) for c in delta.tool_calls] == [
        (0, None, 'is", "days": ')]
    delta = parser.feed(' 3}}\n</tool_call>')
    assert [c.arguments for c in delta.tool_calls] == ["3}"]


def test_default_ids_are_unique_openai_style():
    message = HermesToolParser().extract(WEATHER + TIME)
    ids = [call.id for call in message.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == 2


def test_unknown_tool_parser_lists_names():
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="'nope'.*hermes"):
        get_tool_parser("nope")


# ---------------------------------------------------------------- reasoning + tools

CHAT_TEXT = (
    "\nI should call the tool.\n</think>\n\nLet me check.\n"
    + WEATHER
    + "\n"
    + call_block('{"arguments": {"q": "{\\"x\\"}"}, "name": "search"}')
)


def test_choice_parser_chains_reasoning_then_tools():
    expected = ExtractedMessage(
        reasoning="\nI should call the tool.\n",
        content="\n\nLet me check.\n",
        tool_calls=[
            ToolCall(id="call_0", name="get_weather", arguments='{"city": "Paris"}'),
            ToolCall(id="call_1", name="search", arguments='{"q": "{\\"x\\"}"}'),
        ],
    )

    def make():
        return ChoiceOutputParser("qwen3", "hermes", "auto", starts_in_reasoning=True,
                                  id_factory=counting_ids())

    assert make().extract(CHAT_TEXT) == expected
    for chunks in chunkings(CHAT_TEXT, seed=1):
        parser = make()
        assert merge_deltas(stream(parser, chunks)) == expected, chunks
        assert parser.is_reasoning_end
        assert parser.num_calls == 2
        assert parser.finish_reason("stop") == "tool_calls"
        assert parser.finish_reason("length") == "length"


def test_choice_parser_tool_markup_inside_reasoning_is_not_a_call():
    parser = ChoiceOutputParser("deepseek_r1", "hermes", "auto", id_factory=counting_ids())
    text = "maybe " + WEATHER + "</think>no call"
    expected = ExtractedMessage(reasoning="maybe " + WEATHER, content="no call")
    assert parser.extract(text) == expected
    assert merge_deltas(stream(parser, list(text))) == expected


def test_choice_parser_without_reasoning_or_tools():
    parser = ChoiceOutputParser(None, "hermes", "auto", id_factory=counting_ids())
    assert parser.is_reasoning_end
    message = merge_deltas(stream(parser, ["<think>x</think>", WEATHER]))
    assert message.content == "<think>x</think>"
    assert [call.name for call in message.tool_calls] == ["get_weather"]

    parser = ChoiceOutputParser("qwen3", "hermes", "none")  # tool_choice none: text stays text
    assert merge_deltas(stream(parser, ["<think>x</thi", "nk>", WEATHER])) == ExtractedMessage(
        reasoning="x", content=WEATHER
    )
    assert parser.is_reasoning_end


def test_include_reasoning_false_drops_only_the_reasoning():
    parser = ChoiceOutputParser("qwen3", include_reasoning=False, starts_in_reasoning=True)
    assert merge_deltas(stream(parser, ["plan</think>", "answer"])) == ExtractedMessage(
        content="answer")


def test_choice_parser_unknown_name():
    with pytest.raises(ValueError, match="available: deepseek_r1, openai_gptoss, qwen3"):
        ChoiceOutputParser("nope")
    with pytest.raises(ValueError, match="available: hermes, llama3_json, mistral"):
        ChoiceOutputParser(None, "nope", "auto")


# ------------------------------------------------- tool_choice required / named (constrained)

REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {"tz": "U\\"}"}}]')


CALL_0 = ToolCall("call_0", "get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("cut, calls", [
    (len(REQUIRED), [CALL_0, ToolCall("call_1", "get_time", '{"tz": "U\\"}"}')]),
    (60, [CALL_0]),  # the next element opened: no name yet, no call
    (57, [CALL_0]),
    (56, [CALL_0]),  # the element not closed: the cut call, its arguments as generated
    (40, [ToolCall("call_0", "get_weather", "{")]),
    (24, [ToolCall("call_0", "get_weather", "")]),  # the name whole, no arguments yet
    (20, []),  # cut inside the name
    (1, []),
])
def test_required_calls_cut_by_max_tokens(cut, calls):
    """Calls complete before the cut are calls; the cut one is returned as generated (its
    arguments' text so far), as OpenAI returns a cut call; never content."""
    for chunks in chunkings(REQUIRED[:cut]):
        parser = ChoiceOutputParser(tool_mode="required", id_factory=counting_ids())
        assert merge_deltas(stream(parser, chunks)) == ExtractedMessage(tool_calls=calls), chunks
        assert parser.finish_reason("length") == "length"


def test_named_call_is_sent_when_its_object_closes():
    parser = ChoiceOutputParser(tool_mode="named", named_function="f", id_factory=counting_ids())
    assert parser.feed('{"a": {"b": 1}').is_empty
    assert merge_deltas([parser.feed("}"), parser.finish()]).tool_calls == [
        ToolCall("call_0", "f", '{"a": {"b": 1}}')]
    assert parser.finish_reason("stop") == "tool_calls"
    cut = ChoiceOutputParser(tool_mode="named", named_function="f", id_factory=counting_ids())
    assert merge_deltas(stream(cut, ['{"a": {"b": 1}'])) == ExtractedMessage(
        tool_calls=[ToolCall("call_0", "f", '{"a": {"b": 1}')])
    assert cut.finish_reason("length") == "length"
