"""One choice's output text -> reasoning, content and tool-call pieces: the one per-choice parser
the chat, responses and messages writers share. Make one per choice, `feed` it every text delta,
call `finish` once at the end, and send or merge (types.merge_deltas) what they return; a stream
and a whole response therefore always agree.

    parser = ChoiceOutputParser(reasoning_parser="qwen3", tool_parser="hermes", tool_mode="auto",
                                starts_in_reasoning=output_starts_in_reasoning(...))
    for text in deltas: send(parser.feed(text))
    send(parser.finish()); reason = parser.finish_reason(engine_reason)

The reasoning parser runs first; only its content goes on to the tool stage. The tool stage is
one of: "none" (content is content), "auto" (the tool parser finds calls in free text),
"required" (the output is a JSON array of {"name", "parameters"} objects that a constraint made
the model write) or "named" (the output is the arguments object of one named function).

A model that speaks harmony (gpt-oss, `harmony=True`) has neither stage: its channels say what
is reasoning, content and a call (parsers/harmony.py), whatever the tool mode; "none" drops the
calls, and the constraint of "required" / named made the model write one on its channel.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ladle.parsers.harmony import ASSISTANT_START, HarmonyParser
from ladle.parsers.reasoning import ReasoningParser, get_reasoning_parser
from ladle.parsers.tool import ToolParser, get_tool_parser, random_tool_call_id
from ladle.parsers.types import DeltaMessage, DeltaToolCall, ExtractedMessage, merge_deltas

TOOL_MODES = ("none", "auto", "required", "named")


def output_starts_in_reasoning(reasoning_parser: str | None, prompt_token_ids: Sequence[int],
                               tokenizer: Any = None, prompt_text: str | None = None) -> bool:
    """Whether the output opens inside the thinking block, decided the way the engine decides it
    (ladle.reasoning.ReasoningConfig): the last think tag in the prompt says; </think> (e.g.
    Qwen3 with enable_thinking false) means no, <think> or no tag at all means yes. Tags that
    are not single tokens of this tokenizer are looked for in the prompt text instead."""
    if reasoning_parser is None:
        return False
    cls = get_reasoning_parser(reasoning_parser)
    ids = None
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        if cls.start_tag in vocab and cls.end_tag in vocab:
            ids = vocab[cls.start_tag], vocab[cls.end_tag]
    if ids is not None:
        for t in reversed(prompt_token_ids):
            if t in ids:
                return t == ids[0]
        return True
    text = prompt_text or ""
    start, end = text.rfind(cls.start_tag), text.rfind(cls.end_tag)
    return start > end or (start < 0 and end < 0)


def parser_markers(reasoning_parser: str | None, tool_parser: str | None) -> tuple[str, ...]:
    """The tags the parsers must see in the text (see ToolParser.markers)."""
    markers: list[str] = []
    if reasoning_parser is not None:
        cls = get_reasoning_parser(reasoning_parser)
        markers += [cls.start_tag, cls.end_tag]
    if tool_parser is not None:
        markers += get_tool_parser(tool_parser).markers
    return tuple(markers)


@dataclass
class ChoiceOutputParser:
    reasoning_parser: str | None = None  # a registered name (--reasoning-parser)
    tool_parser: str | None = None  # a registered name (--tool-call-parser); used in "auto"
    tool_mode: str = "none"  # none | auto | required | named
    named_function: str | None = None  # "named": the function the output is the arguments of
    is_parallel: bool = True  # False: only the first call is returned
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's tools
    starts_in_reasoning: bool = False  # see output_starts_in_reasoning
    include_reasoning: bool = True  # False: reasoning is parsed out and dropped
    id_factory: Callable[[], str] | None = None  # tool-call ids (tests pass a counter)
    harmony: bool = False  # the output is harmony (gpt-oss): parsers/harmony.py splits it
    harmony_prefix: str = ASSISTANT_START  # harmony: the prompt's unfinished last message

    def __post_init__(self):
        if self.tool_mode not in TOOL_MODES:
            raise ValueError(f"tool_mode: {self.tool_mode!r}; accepted: {', '.join(TOOL_MODES)}")
        self.num_calls = 0  # calls announced so far (after the parallel_tool_calls cut)
        self._harmony: HarmonyParser | None = None
        if self.harmony:
            self._harmony = HarmonyParser(self.id_factory or random_tool_call_id,
                                          self.harmony_prefix)
            return
        self._reasoning: ReasoningParser | None = None
        if self.reasoning_parser is not None:
            cls = get_reasoning_parser(self.reasoning_parser)
            self._reasoning = cls(prompt_ends_in_think=self.starts_in_reasoning)
        self._tools: ToolParser | None = None
        if self.tool_mode == "auto" and self.tool_parser is not None:
            self._tools = get_tool_parser(self.tool_parser)(self.id_factory, self.tools)
        self._constrained = (_ConstrainedCalls(self.tool_mode, self.named_function,
                                               self.id_factory or random_tool_call_id)
                             if self.tool_mode in ("required", "named") else None)

    @property
    def is_reasoning_end(self) -> bool:
        """True once the output is past the reasoning (always, without a reasoning parser)."""
        if self._harmony is not None:
            return self._harmony.is_in_answer
        return self._reasoning is None or self._reasoning.is_reasoning_end

    def feed(self, delta_text: str) -> DeltaMessage:
        """The next detokenized delta of this choice's output."""
        if not delta_text:
            return DeltaMessage()
        if self._harmony is not None:
            return self._calls_cut(self._harmony.feed(delta_text))
        if self._reasoning is None:
            delta = DeltaMessage(content=delta_text)
        else:
            delta = self._reasoning.feed(delta_text)
        return self._tool_stage(delta, is_final=False)

    def finish(self) -> DeltaMessage:
        """End of output: whatever either stage held back."""
        if self._harmony is not None:
            return self._calls_cut(self._harmony.finish())
        delta = self._reasoning.finish() if self._reasoning is not None else DeltaMessage()
        return self._tool_stage(delta, is_final=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when the output stopped normally after calls; "length" (cut by
        max_tokens) and the rest stay, so a client knows the calls may be incomplete."""
        return "tool_calls" if engine_reason == "stop" and self.num_calls else engine_reason

    def extract(self, text: str) -> ExtractedMessage:
        """A whole output (a fresh parser with the same settings; this one is untouched)."""
        fresh = dataclasses.replace(self)  # same settings, new stream state
        return merge_deltas([fresh.feed(text), fresh.finish()])

    def _tool_stage(self, delta: DeltaMessage, is_final: bool) -> DeltaMessage:
        content = delta.content or ""
        if self._tools is not None:
            out = self._tools.feed(content) if content else DeltaMessage()
            if is_final:
                last = self._tools.finish()
                out.content = "".join(filter(None, [out.content, last.content])) or None
                out.tool_calls += last.tool_calls
        elif self._constrained is not None:
            out = self._constrained.feed(content, is_final)
        else:
            out = DeltaMessage(content=content or None)
        out.reasoning = delta.reasoning
        return self._calls_cut(out)

    def _calls_cut(self, out: DeltaMessage) -> DeltaMessage:
        """The calls the request allows, one piece per call; the reasoning if it is wanted."""
        if not self.include_reasoning:
            out.reasoning = None
        if self.tool_mode == "none":  # harmony: a call the model made anyway is not returned
            out.tool_calls = []
        if not self.is_parallel:  # parallel_tool_calls false: the first call only
            out.tool_calls = [c for c in out.tool_calls if c.index == 0]
        self.num_calls += sum(1 for c in out.tool_calls if c.id is not None)
        out.tool_calls = _one_piece_per_call(out.tool_calls)
        return out


def _one_piece_per_call(pieces: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Consecutive pieces of one call as one piece (a chunk carries each index once, as
    OpenAI's and vLLM's do; some clients expect that)."""
    out: list[DeltaToolCall] = []
    for piece in pieces:
        last = out[-1] if out else None
        if last is not None and last.index == piece.index and piece.id is None:
            last.arguments = (last.arguments or "") + (piece.arguments or "")
        else:
            out.append(DeltaToolCall(piece.index, piece.id, piece.name, piece.arguments))
    return out


# A required call's element cut by max_tokens: {"name": "<whole name>", "parameters": <so far>
# (the schema orders name before parameters).
_CUT_REQUIRED = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"'
                           r'(?:\s*,\s*"parameters"\s*:\s*(?P<arguments>.*))?', re.DOTALL)


class _ConstrainedCalls:
    """tool_choice "required" / named: the constrained JSON becomes calls. A required call is
    sent whole when its array element closes; the named call when its object closes. When
    max_tokens cuts the output, the calls completed before the cut are returned whole and the
    cut one as it was generated, as OpenAI returns a cut call (finish_reason "length"): its
    name, once the name is whole, and its arguments' text so far, not valid JSON. The
    constrained JSON is never returned as content; a required call cut inside its name is
    dropped (there is no call to name)."""

    def __init__(self, mode: str, named: str | None, id_factory: Callable[[], str]):
        self.mode = mode
        self.named = named
        self.id_factory = id_factory
        self.text = ""  # the output so far
        self.num_calls = 0
        self._pos = 0  # how far `text` is scanned
        self._depth = 0
        self._in_string = False
        self._is_escaped = False
        self._element_start = -1

    def feed(self, content: str, is_final: bool) -> DeltaMessage:
        self.text += content
        calls: list[DeltaToolCall] = []
        for i in range(self._pos, len(self.text)):
            ch = self.text[i]
            if self._in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif ch == "\\":
                    self._is_escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if ch == "{" and self._depth == (1 if self.mode == "named" else 2):
                    self._element_start = i
            elif ch in "]}":
                self._depth -= 1
                if ch == "}" and self._depth == (0 if self.mode == "named" else 1):
                    calls += self._call(self.text[self._element_start : i + 1])
                    self._element_start = -1
        self._pos = len(self.text)
        if is_final and self._depth > 0 and self._element_start >= 0:
            calls += self._cut_call(self.text[self._element_start:])
        return DeltaMessage(tool_calls=calls)

    def _cut_call(self, element: str) -> list[DeltaToolCall]:
        """The call max_tokens cut: its name and its arguments' text so far."""
        if self.mode == "named":
            name, arguments = self.named, element
        else:
            m = _CUT_REQUIRED.match(element)
            if m is None:
                return []
            name, arguments = json.loads(f'"{m["name"]}"'), m["arguments"] or ""
        piece = DeltaToolCall(index=self.num_calls, id=self.id_factory(), name=name,
                              arguments=arguments)
        self.num_calls += 1
        return [piece]

    def _call(self, element: str) -> list[DeltaToolCall]:
        try:
            value = json.loads(element)
        except ValueError:  # the grammar makes this unreachable; a bad element is no call
            return []
        if self.mode == "named":
            name, arguments = self.named, value
        else:
            name, arguments = value.get("name"), value.get("parameters")
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return []
        piece = DeltaToolCall(index=self.num_calls, id=self.id_factory(), name=name,
                              arguments=json.dumps(arguments, ensure_ascii=False))
        self.num_calls += 1
        return [piece]
