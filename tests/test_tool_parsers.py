"""Every tool-call format: a whole text and every way of streaming it give the same calls, the
arguments arrive in several fragments, text around calls is kept, and malformed calls come back
as content. Also plugin parsers loaded from a file by path."""

from __future__ import annotations

import json
import textwrap

import pytest
from test_parsers import chunkings, counting_ids, stream

from ladle.parsers import load_plugin
from ladle.parsers.choice import ChoiceOutputParser
from ladle.parsers.reasoning import ReasoningParserManager
from ladle.parsers.tool import ToolParserManager, get_tool_parser
from ladle.parsers.tool.json_stream import JsonStream
from ladle.parsers.types import merge_deltas

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}, "raw": {"type": "string"}}}}}]
WEATHER = ("get_weather", '{"city": "Paris", "days": 3}')
EMPTY = ("f", "{}")

CASES = {
    # (text, content, [(name, arguments)])
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [WEATHER]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
         '{"name": "f", "parameters": {}}', None, [WEATHER, EMPTY]),
        ('Checking.<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", '
         '"days": 3}}', "Checking.", [WEATHER]),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}\nDone.',
         "Done.", [WEATHER]),
        ('{"parameters": {"city": "Paris", "days": 3}, "name": "get_weather"}', None, [WEATHER]),
        ('{"answer": 42} is the result', '{"answer": 42} is the result', []),
        ("Plain {text} answer", "Plain {text} answer", []),
        ('<|python_tag|>{"name": 5}', '<|python_tag|>{"name": 5}', []),
        ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "f", "arguments": {}}]', None, [WEATHER, EMPTY]),
        ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]f[ARGS]{}',
         "Sure. ", [WEATHER, EMPTY]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city":"Paris","days":3} and then text',
         "and then text", [WEATHER]),
        ("[TOOL_CALLS]not a name[ARGS]{}", "[TOOL_CALLS]not a name[ARGS]{}", []),
        ("No calls [TOOL here]", "No calls [TOOL here]", []),
        ('[TOOL_CALLS][{"oops": 1}]', '[TOOL_CALLS][{"oops": 1}]', []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), f()]', None, [WEATHER, EMPTY]),
        ("<|python_start|>[get_weather(city='Paris', days=3)]<|python_end|>", None, [WEATHER]),
        ('[get_weather(city="Paris", days=3, opts={"a": [1, (2, None)], "b": True})]', None,
         [("get_weather", '{"city": "Paris", "days": 3, "opts": {"a": [1, [2, null]], '
                          '"b": true}}')]),
        ('[get_weather(city="a, b)", days=3)]\nDone.', "Done.",
         [("get_weather", '{"city": "a, b)", "days": 3}')]),
        ("[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
        ("[f(1)]", "[f(1)]", []),
        ("The answer: [f()]", "The answer: [f()]", []),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None, [WEATHER]),
        ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=f>\n</function>\n</tool_call>\nDone.", "Let me look.\n\nDone.",
         [WEATHER, EMPTY]),
        ("<tool_call>\n<function=get_weather>\n<parameter=raw>\n{\"keep\": 1}\n</parameter>\n"
         "<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=days>\nthree\n"
         "</parameter>\n</function>\n</tool_call>", None,
         [("get_weather", '{"raw": "{\\"keep\\": 1}", "opts": {"a": [1]}, "days": "three"}')]),
        ("<tool_call>\nnot xml\n</tool_call>", "<tool_call>\nnot xml\n</tool_call>", []),
        ("<tool_call>\n<func", "<tool_call>\n<func", []),
    ],
}
CASES["hermes"] = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}\n</tool_call>\nAnything else?', "Let me check.\n\nAnything else?", [WEATHER]),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
]
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def expected(content, calls):
    return (content, [(name, args) for name, args in calls])


def as_tuple(message):
    return message.content, [(c.name, c.arguments) for c in message.tool_calls]


@pytest.mark.parametrize("parser, text, content, calls", ALL)
def test_stream_equals_whole_for_every_chunking(parser, text, content, calls):
    cls = get_tool_parser(parser)
    whole = cls(counting_ids(), TOOLS).extract(text)
    assert as_tuple(whole) == expected(content, calls)
    for i, call in enumerate(whole.tool_calls):
        assert call.id == f"call_{i}"
        json.loads(call.arguments)
    for chunks in chunkings(text):
        deltas = stream(cls(counting_ids(), TOOLS), chunks)
        assert merge_deltas(deltas) == whole, chunks
        first = [p for d in deltas for p in d.tool_calls if p.id is not None]
        assert [p.index for p in first] == list(range(len(calls)))  # name once per call
        assert all(p.name for p in first)


@pytest.mark.parametrize("parser, text, content, calls",
                         [case for case in ALL if case[3] and case[3][0] == WEATHER
                          and '{"parameters"' not in case[1]])
def test_arguments_arrive_in_fragments(parser, text, content, calls):
    """Fed one character at a time, a call's arguments come in several pieces, before the
    call's text has ended (a call whose name comes after its arguments arrives whole)."""
    deltas = stream(get_tool_parser(parser)(counting_ids(), TOOLS), list(text))
    fragments = [p.arguments for d in deltas for p in d.tool_calls
                 if p.index == 0 and p.arguments]
    assert len(fragments) >= 2, fragments
    assert "".join(fragments) == WEATHER[1]


def test_mistral_ids_are_nine_letters_and_digits():
    message = get_tool_parser("mistral")().extract("[TOOL_CALLS]f[ARGS]{}")
    assert len(message.tool_calls[0].id) == 9 and message.tool_calls[0].id.isalnum()


@pytest.mark.parametrize("raw", [
    '{"a": 1, "b": [true, false, null], "c": {"d": "\\u00e9\\ud83d\\ude00\\n\\t\\"/"}}',
    '{"n": -0.5e-3, "m": 1E2, "big": 123456789012345678901234567890, "z": 0}',
    '{ }', '{"nested": [[[], {}], [1.5]]}',
])
def test_json_stream_is_json_dumps(raw):
    out, consumed, status = JsonStream().feed(raw + " tail")
    assert status == "done" and consumed == len(raw)
    assert out == json.dumps(json.loads(raw), ensure_ascii=False)


@pytest.mark.parametrize("bad", ['{"a": NaN}', '{"a": 01}', "{'a': 1}", '{"a" 1}', '{"a": 1,}',
                                 '[1]', '{"a": "\x01"}', '{"a": tru}'])
def test_json_stream_rejects_what_json_rejects(bad):
    assert JsonStream().feed(bad)[2] == "error"


PLUGIN = '''
from ladle.parsers.reasoning import ReasoningParser, ReasoningParserManager
from ladle.parsers.tool import ToolParserManager
from ladle.parsers.tool.hermes import HermesToolParser


@ToolParserManager.register_module("angle_calls")
class AngleCalls(HermesToolParser):
    """Hermes-shaped calls between <<call>> and <</call>>."""
    start_tag = "<<call>>"
    end_tag = "<</call>>"
    markers = (start_tag, end_tag)


@ReasoningParserManager.register_module("reason_tags")
class ReasonTags(ReasoningParser):
    start_tag = "<reason>"
    end_tag = "</reason>"
'''


def test_plugin_parsers_register_by_path(tmp_path):
    path = tmp_path / "my_parsers.py"
    path.write_text(textwrap.dedent(PLUGIN))
    load_plugin(path)
    assert "angle_calls" in ToolParserManager.parsers
    parser = ChoiceOutputParser("reason_tags", "angle_calls", "auto", id_factory=counting_ids())
    text = '<reason>hm</reason>ok <<call>>{"name": "f", "arguments": {"x": 1}}<</call>>'
    message = merge_deltas(stream(parser, list(text)))
    assert (message.reasoning, message.content) == ("hm", "ok ")
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("f", '{"x": 1}')]
    with pytest.raises(ValueError, match="no such file"):
        load_plugin(tmp_path / "missing.py")
    assert ReasoningParserManager.get("reason_tags").start_tag == "<reason>"
