"""The request side of harmony, the format gpt-oss speaks: whether the served model speaks it,
the prompt of a chat in it, and the constraint that shapes only the right channel. The output
side is parsers/harmony.py.

A model speaks harmony when its config's model_type is gpt_oss (a GGUF file: architecture
gpt-oss), or when the server runs with `--reasoning-parser openai_gptoss` or
`--tool-call-parser openai` (vLLM's rule and names). Its chats are then rendered here, not by a
chat template, the way openai-harmony renders them (tests/test_harmony.py compares the two):

- a system message: model identity, knowledge cutoff, today's date, `Reasoning: low|medium|high`
  (reasoning_effort; none/minimal read as low, xhigh as high), the valid channels (commentary
  only with tools, as vLLM does);
- a developer message: the conversation's leading system/developer messages as `# Instructions`
  and the tools as a TypeScript-like `functions` namespace;
- the turns: an assistant's reasoning (reasoning_content, reasoning or thinking) on the analysis
  channel, its content on final (on commentary, as a preamble, when it also calls tools), each
  call as `to=functions.NAME` on commentary ending in <|call|>, each tool result from
  `functions.NAME` (found by tool_call_id);
- history: analysis before the last final answer is dropped (that turn is over), the analysis of
  a turn still calling tools is kept (vLLM's rule; openai-harmony drops only before the first
  final when the last assistant message is final, the same for every ordinary conversation).

The text between markers is tokenized as plain text (split_special_tokens), piece by piece as
openai-harmony does, so a message holding "<|end|>" cannot forge a marker.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ladle.entrypoints.tools import ToolPlan
from ladle.parsers.harmony import (
    ASSISTANT_START,
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTIONS,
    MARKERS,
    MESSAGE,
    RETURN,
    START,
)
from ladle.parsers.reasoning import ReasoningParserManager
from ladle.parsers.tool import ToolParserManager
from ladle.protocol.chat import ChatCompletionRequest
from ladle.protocol.common import REASONING_EFFORTS, RequestError
from ladle.protocol.sampling import checked_structured_outputs, structured_outputs_params
from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.backend import MAX_JSON_WHITESPACE

HARMONY_MODEL_TYPES = ("gpt_oss",)
HARMONY_GGUF_ARCHITECTURES = ("gpt-oss",)
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high"}  # every OpenAI effort (protocol.common) onto harmony's three
MAX_SCHEMA_DEPTH = 64  # nesting a tool's parameters may have (the TypeScript is recursive)
MAX_NAME_CHARS = 256  # a function name: it becomes a recipient in a header
_NAME = re.compile(r"[^\s<|>]+")
_NO_OBJECT = {"type": "object", "additionalProperties": True}


@dataclass(frozen=True)
class HarmonyTokens:
    """This tokenizer's ids of the harmony markers (each must be one token)."""

    ids: dict[str, int]

    @classmethod
    def from_tokenizer(cls, tokenizer, why: str) -> HarmonyTokens:
        """ValueError naming `why` (what made the server speak harmony) when a marker is not a
        single token of this tokenizer."""
        vocab = tokenizer.get_vocab()
        missing = [m for m in MARKERS if m not in vocab]
        if missing:
            raise ValueError(f"{why}: the model speaks harmony, but its tokenizer has no "
                             f"{', '.join(missing)} token(s)")
        return cls({m: vocab[m] for m in MARKERS})

    @property
    def stop_token_ids(self) -> list[int]:
        """<|call|> and <|return|>: the assistant's turn ends on either."""
        return [self.ids[CALL], self.ids[RETURN]]


def harmony_reason(model_path: str | Path, reasoning_parser: str | None,
                   tool_call_parser: str | None) -> str | None:
    """Why the served model speaks harmony (a flag or its config), or None when it does not."""
    for flag, name, manager in (("--reasoning-parser", reasoning_parser, ReasoningParserManager),
                                ("--tool-call-parser", tool_call_parser, ToolParserManager)):
        if name is not None and getattr(manager.parsers.get(name), "is_harmony", False):
            return f"{flag} {name}"
    path = Path(model_path)
    if path.is_file():  # a GGUF file
        from ladle.models.gguf import read_metadata

        arch = read_metadata(path).get("general.architecture")
        return f"{path.name}: architecture {arch}" if arch in HARMONY_GGUF_ARCHITECTURES else None
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return f"{path}: model_type {model_type}" if model_type in HARMONY_MODEL_TYPES else None


# ---- the prompt -------------------------------------------------------------------------------
@dataclass(slots=True)
class _Message:
    """One harmony message (openai-harmony's Message, text content only)."""

    author: str  # the role, or a tool's name ("functions.get_weather")
    text: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def is_tool(self) -> bool:
        return self.author.startswith(FUNCTIONS)


@dataclass
class HarmonyPrompt:
    text: str  # the prompt with its markers
    token_ids: list[int]
    prefix: str  # the unfinished last message the output continues (parsers/harmony.py)


@dataclass
class _Pieces:
    """The prompt as (text, is_marker) pieces, each text piece tokenized on its own."""

    items: list[tuple[str, bool]] = field(default_factory=list)

    def text(self, text: str) -> None:
        if text:
            self.items.append((text, False))

    def marker(self, marker: str) -> None:
        self.items.append((marker, True))


def render_harmony(messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                   tokenizer, tokens: HarmonyTokens, reasoning_effort: str | None = None,
                   model_identity: str | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, date: str | None = None
                   ) -> HarmonyPrompt:
    """A chat (messages as request.template_messages() gives them: text content, developer as
    system) as a harmony prompt. RequestError naming the field for what harmony cannot say."""
    if add_generation_prompt and continue_final_message:
        raise RequestError("continue_final_message: cannot be used with add_generation_prompt; "
                           "set add_generation_prompt to false", param="continue_final_message")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise RequestError("continue_final_message: the last message must be an assistant one",
                           param="continue_final_message")
    functions = _function_tools(tools or [])
    instructions, turns = _leading_instructions(messages)
    conversation = [_Message("system", _system_text(
        model_identity or MODEL_IDENTITY, _effort(reasoning_effort),
        date or datetime.date.today().isoformat(), bool(functions)))]
    if instructions is not None or functions:
        conversation.append(_Message("developer", _developer_text(instructions, functions)))
    converted = _turns(turns, len(messages) - len(turns))
    if continue_final_message and not converted[-1]:  # an empty answer to continue
        converted[-1] = [_Message("assistant", "", channel="final")]
    num_open = len(converted[-1]) if continue_final_message else 0
    flat = [m for group in converted for m in group]
    conversation += _drop_old_analysis(flat, num_kept=num_open)
    pieces = _Pieces()
    for i, msg in enumerate(conversation):
        _render(msg, pieces, is_open=continue_final_message and i == len(conversation) - 1)
    if add_generation_prompt:
        pieces.marker(START)
        pieces.text("assistant")
    text = "".join(t for t, _ in pieces.items)
    prefix = text[text.rfind(START):] if add_generation_prompt or continue_final_message else ""
    return HarmonyPrompt(text, _tokenize(pieces.items, tokenizer, tokens), prefix)


def _effort(effort: str | None) -> str:
    if effort is None:
        return "medium"  # openai-harmony's default
    if effort not in EFFORTS:
        raise RequestError(f"reasoning_effort: {effort!r}; accepted: "
                           + ", ".join(REASONING_EFFORTS), param="reasoning_effort")
    return EFFORTS[effort]


def _leading_instructions(messages: list[dict[str, Any]]
                          ) -> tuple[str | None, list[dict[str, Any]]]:
    """The leading system/developer messages' text (the instructions) and the rest."""
    num = 0
    while num < len(messages) and messages[num].get("role") in ("system", "developer"):
        num += 1
    if num == 0:
        return None, messages
    return "\n\n".join(_text(m) for m in messages[:num]), messages[num:]


def _text(message: dict[str, Any]) -> str:
    """A message's text; text parts joined with newlines, as request.template_messages() does."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def _system_text(identity: str, effort: str, date: str, has_functions: bool) -> str:
    channels = "analysis, commentary, final" if has_functions else "analysis, final"
    valid = f"# Valid channels: {channels}. Channel must be included for every message."
    if has_functions:
        valid += "\nCalls to these tools must go to the commentary channel: 'functions'."
    top = f"{identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}"
    return "\n\n".join([top, f"Reasoning: {effort}", valid])


def _developer_text(instructions: str | None, functions: list[dict[str, Any]]) -> str:
    sections = [] if instructions is None else ["# Instructions", instructions]
    if functions:
        sections.append("# Tools\n\n" + _functions_namespace(functions))
    return "\n\n".join(sections)


def _turns(messages: list[dict[str, Any]], offset: int) -> list[list[_Message]]:
    """Each chat message as its harmony messages (`offset`: index of the first in the request,
    for error fields)."""
    call_names: dict[str, str] = {}
    last_call: str | None = None
    out: list[list[_Message]] = []
    for i, msg in enumerate(messages, start=offset):
        role = msg.get("role")
        group: list[_Message] = []
        if role == "assistant":
            reasoning = next((msg[k] for k in ("reasoning_content", "reasoning", "thinking")
                              if isinstance(msg.get(k), str) and msg[k]), None)
            if reasoning is not None:
                group.append(_Message("assistant", reasoning, channel="analysis"))
            calls = msg.get("tool_calls") or []
            if _text(msg):
                group.append(_Message("assistant", _text(msg),
                                      channel="commentary" if calls else "final"))
            for j, call in enumerate(calls):
                name, arguments = _call(call, f"messages.{i}.tool_calls.{j}")
                last_call = name
                if isinstance(call.get("id"), str):
                    call_names[call["id"]] = name
                group.append(_Message("assistant", arguments, channel="commentary",
                                      recipient=FUNCTIONS + name, content_type="json"))
        elif role in ("tool", "function"):
            name = call_names.get(msg.get("tool_call_id")) or msg.get("name") or last_call
            if not isinstance(name, str) or not name:
                raise RequestError(f"messages.{i}.tool_call_id: names no earlier tool call, and "
                                   "the message has no name", param=f"messages.{i}.tool_call_id")
            _check_name(name, f"messages.{i}.name")
            group.append(_Message(FUNCTIONS + name, _text(msg), channel="commentary",
                                  recipient="assistant"))
        elif role in ("system", "developer"):  # after the conversation started: instructions
            group.append(_Message("developer", _developer_text(_text(msg), [])))
        else:
            group.append(_Message("user", _text(msg)))
        out.append(group)
    return out


def _call(call: dict[str, Any], path: str) -> tuple[str, str]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{path}.function.name: must be a string", param=f"{path}.function.name")
    _check_name(fn["name"], f"{path}.function.name")
    arguments = fn.get("arguments")
    if not isinstance(arguments, str):  # an object: as JSON text
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return fn["name"], arguments


def _check_name(name: str, path: str) -> None:
    if len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
        raise RequestError(f"{path}: {name[:80]!r} cannot name a harmony recipient (1 to "
                           f"{MAX_NAME_CHARS} characters, no whitespace, '<', '|' or '>')",
                           param=path)


def _drop_old_analysis(messages: list[_Message], num_kept: int) -> list[_Message]:
    """Analysis before the last final answer belongs to a finished turn: dropped. The last
    `num_kept` messages (the one continue_final_message continues) do not count as final."""
    searched = messages[: len(messages) - num_kept]
    last_final = max((i for i, m in enumerate(searched)
                      if m.author == "assistant" and m.channel == "final"), default=-1)
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]


def _render(msg: _Message, out: _Pieces, is_open: bool) -> None:
    """One message, split into pieces exactly where openai-harmony tokenizes it."""
    out.marker(START)
    out.text(msg.author)
    if msg.recipient is not None and msg.recipient != "all":
        out.text(f" to={msg.recipient}")
    if msg.channel is not None:
        out.marker(CHANNEL)
        out.text(msg.channel)
    if msg.content_type is not None:
        if msg.content_type.startswith(CONSTRAIN):
            out.text(" ")
            out.marker(CONSTRAIN)
            out.text(msg.content_type[len(CONSTRAIN):])
        else:
            out.text(f" {msg.content_type}")
    out.marker(MESSAGE)
    out.text(msg.text)
    if not is_open:
        is_call = msg.author == "assistant" and msg.recipient is not None
        out.marker(CALL if is_call else END)


def _tokenize(pieces: list[tuple[str, bool]], tokenizer, tokens: HarmonyTokens) -> list[int]:
    texts = [t for t, is_marker in pieces if not is_marker]
    encoded = iter(tokenizer(texts, add_special_tokens=False, split_special_tokens=True)[
        "input_ids"] if texts else [])
    ids: list[int] = []
    for text, is_marker in pieces:
        ids += [tokens.ids[text]] if is_marker else next(encoded)
    return ids


# ---- tools as TypeScript (openai-harmony's rendering of a JSON Schema) -----------------------
def _function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            _check_name(fn["name"], f"tools.{i}.function.name")
            out.append({"name": fn["name"], "description": fn.get("description") or "",
                        "parameters": fn.get("parameters"), "path": f"tools.{i}.function"})
    return out


def _functions_namespace(functions: list[dict[str, Any]]) -> str:
    lines = ["## functions\n", "namespace functions {\n"]
    for fn in functions:
        lines += [f"// {line}" for line in _lines(str(fn["description"]))]
        params = fn["parameters"]
        if params is None:
            lines.append(f"type {fn['name']} = () => any;\n")
        else:
            ts = _typescript(params, "", 0, f"{fn['path']}.parameters")
            lines.append(f"type {fn['name']} = (_: {ts}) => any;\n")
    lines.append("} // namespace functions")
    return "\n".join(lines)


def _lines(text: str) -> list[str]:
    """Rust's str::lines: split on \\n, one trailing \\r dropped per line, no last empty line."""
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [p.removesuffix("\r") for p in parts]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _is_enum(schema: Any) -> bool:
    return isinstance(schema, dict) and isinstance(schema.get("enum"), list) and bool(
        schema["enum"])


def _default_note(schema: dict, enum_as_json: bool) -> str:
    """The `default: ...` note: a string as "s" unless the schema is an enum (then as JSON, or
    bare where openai-harmony writes it bare); anything else as compact JSON."""
    value = schema["default"]
    if isinstance(value, str) and not _is_enum(schema):
        return f'default: "{value}"'
    if isinstance(value, str) and not enum_as_json:
        return f"default: {value}"
    return f"default: {_json(value)}"


def _typescript(schema: Any, indent: str, depth: int, path: str) -> str:
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestError(f"{path}: nested deeper than {MAX_SCHEMA_DEPTH} levels", param=path)
    if not isinstance(schema, dict):
        return "any"
    one_of, kind = schema.get("oneOf"), schema.get("type")
    if isinstance(one_of, list):
        return "".join(f"\n{indent} | " + _variant(v, indent, depth, path, notes=_notes(v))
                       for v in one_of)
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent, depth, path)
    if kind == "string":
        values = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)] if isinstance(
            schema.get("enum"), list) else []
        return " | ".join(values) if values else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        if "items" in schema:
            return _typescript(schema["items"], indent, depth + 1, path) + "[]"
        return "Array<any>"
    return "any"


def _notes(variant: Any) -> list[str]:
    """A top-level oneOf variant's trailing notes: its description and default."""
    if not isinstance(variant, dict):
        return []
    notes = [variant["description"]] if isinstance(variant.get("description"), str) else []
    if "default" in variant:
        notes.append(_default_note(variant, enum_as_json=True))
    return notes


def _variant(variant: Any, indent: str, depth: int, path: str, notes: list[str]) -> str:
    ts = _typescript(variant, indent + "   ", depth + 1, path)
    if isinstance(variant, dict) and variant.get("nullable") is True and "null" not in ts:
        ts += " | null"
    return ts + (f" // {' '.join(notes)}" if notes else "")


def _object(schema: dict, indent: str, depth: int, path: str) -> str:
    out = []
    if isinstance(schema.get("description"), str):
        out.append(f"{indent}// {schema['description']}\n")
    out.append("{\n")
    props = schema.get("properties")
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    for key, val in (props.items() if isinstance(props, dict) else ()):
        val = val if isinstance(val, dict) else {}
        mark = "" if key in required else "?"
        if isinstance(val.get("title"), str):
            out.append(f"{indent}// {val['title']}\n{indent}//\n")
        if "oneOf" not in val and isinstance(val.get("description"), str):
            out.append(f"{indent}// {val['description']}\n")
        examples = val.get("examples")
        if isinstance(examples, list) and examples:
            out.append(f"{indent}// Examples:\n")
            out += [f'{indent}// - "{ex}"\n' for ex in examples if isinstance(ex, str)]
        if isinstance(val.get("oneOf"), list):
            out.append(_one_of_property(key, mark, val, indent, depth, path))
            continue
        ts = _typescript(val, indent + "    ", depth + 1, path)
        if val.get("nullable") is True and "null" not in ts:
            ts += " | null"
        note = (f" // {_default_note(val, enum_as_json=False)}"
                if "default" in val and "oneOf" not in val else "")
        out.append(f"{indent}{key}{mark}: {ts},{note}\n")
    out.append(f"{indent}}}")
    return "".join(out)


def _one_of_property(key: str, mark: str, val: dict, indent: str, depth: int, path: str) -> str:
    """A property whose schema is a oneOf: its notes above, one variant per line."""
    variants = val["oneOf"]
    desc = val.get("description") if isinstance(val.get("description"), str) else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    is_desc_above = desc is not None and first.get("description") != desc
    out = [f"{indent}// {desc}\n"] if is_desc_above else []
    if "default" in val:
        out.append(f"{indent}// {_default_note(val, enum_as_json=False)}\n")
    out.append(f"{indent}{key}{mark}:\n")
    for i, variant in enumerate(variants):
        notes = []
        if isinstance(variant, dict):
            vdesc = variant.get("description")
            if not (i == 0 and is_desc_above) and isinstance(vdesc, str) and vdesc != desc:
                notes.append(vdesc)
            if "default" in variant:
                notes.append(_default_note(variant, enum_as_json=False))
        out.append(f"{indent} | " + _variant(variant, indent, depth, path, notes) + "\n")
    out.append(f"{indent},\n")
    return "".join(out)


# ---- the constraint ---------------------------------------------------------------------------
_ANALYSIS = {"type": "tag", "begin": f"{CHANNEL}analysis{MESSAGE}",
             "content": {"type": "any_text", "excludes": [START, CHANNEL, MESSAGE]}, "end": END}
_FINAL = f"{CHANNEL}final{MESSAGE}"


def harmony_constraint(request: ChatCompletionRequest, plan: ToolPlan,
                       backend: str = "auto") -> StructuredOutputsParams | None:
    """The structural tag that shapes a harmony reply, or None when nothing is constrained:
    any number of analysis messages (free text), then what the request asks for —
    - tool_choice required / named: one call on commentary, `to=functions.NAME` (one of the
      tools / the named one) with `<|constrain|>json` or `json`, its arguments the tool's
      schema; nothing after it but the stop token;
    - response_format (or structured_outputs / guided_*): the final message, its text that
      constraint;
    - with tools in auto mode next to such a format, or with strict tools: the final message
      (free text without a format) or a call (a strict tool's arguments its schema, any other's
      any object).
    A structural_tag the client sent stays as it is: it shapes the whole output."""
    own = None if plan.is_constrained else structured_outputs_params(request, backend)
    if own is not None and own.kind == "structural_tag":
        return own
    strict = {f["name"] for f in (t.get("function") or {} for t in request.tools or [])
              if f.get("strict")}
    if plan.mode == "required":
        calls = list(plan.parameters.items())
    elif plan.mode == "named":
        calls = [(plan.named, plan.parameters[plan.named])]
    elif plan.mode == "auto" and (strict or own is not None):
        calls = [(n, s if n in strict else _NO_OBJECT) for n, s in plan.parameters.items()]
    else:
        calls = []
    if not calls and own is None:
        return None
    answers = [_call_format(name, schema) for name, schema in calls]
    if not plan.is_constrained:
        answers.append({"type": "sequence", "elements": [
            _const(_FINAL), {"type": "any_text"} if own is None else _text_format(own)]})
    prelude = {"type": "star", "content": {"type": "sequence", "elements": [
        _ANALYSIS, _const(ASSISTANT_START)]}}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        prelude, answers[0] if len(answers) == 1 else {"type": "or", "elements": answers}]}}
    param = ("tool_choice" if plan.is_constrained else "tools" if own is None
             else "response_format")
    return checked_structured_outputs(param, {"structural_tag": json.dumps(tag),
                                              "backend": own.backend if own else None}, backend)


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _call_format(name: str, schema: dict) -> dict[str, Any]:
    """A call's header in any of the forms gpt-oss writes, then its arguments."""
    to = f"to={FUNCTIONS}{name}"
    headers = [f"{CHANNEL}commentary {to} {CONSTRAIN}json{MESSAGE}",
               f" {to}{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}",
               f" {to}{CHANNEL}commentary json{MESSAGE}"]
    return {"type": "sequence", "elements": [
        {"type": "or", "elements": [_const(h) for h in headers]},
        {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}]}


def _text_format(params: StructuredOutputsParams) -> dict[str, Any]:
    """A request's constraint as the format of the final message's text."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else _NO_OBJECT
        if isinstance(schema, str):
            schema = json.loads(schema)
        return {"type": "json_schema", "json_schema": schema,
                "max_whitespace_cnt": 0 if params.disable_any_whitespace else MAX_JSON_WHITESPACE}
    if kind == "regex":
        return {"type": "regex", "pattern": params.regex}
    if kind == "choice":
        return {"type": "or", "elements": [_const(c) for c in params.choice]}
    from ladle.structured_output.xgrammar_backend import _is_ebnf

    return {"type": "grammar", "grammar": params.grammar,
            "syntax": "ebnf" if _is_ebnf(params.grammar) else "lark"}


def reasoning_token_count(output_token_ids: Iterable[int], tokens: HarmonyTokens) -> int:
    """Output tokens before the answer: through the last <|end|> (the messages before the
    final one, analysis), or all of them when the output never left its first message."""
    ids = list(output_token_ids)
    end = tokens.ids[END]
    last = max((i for i, t in enumerate(ids) if t == end), default=-1)
    return last + 1 if last >= 0 else len(ids)
