"""Chat tool calling on the API side: `plan_tools` checks tools / tool_choice /
parallel_tool_calls and says how calls are produced (free text parsed by the tool parser, or a
JSON constraint for "required" and a named function). Turning the output into calls is
parsers/choice.py's ChoiceOutputParser, which serving_chat.choice_parser configures from the
plan."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ladle.protocol.chat import ChatCompletionRequest
from ladle.protocol.common import RequestError, unsupported
from ladle.protocol.sampling import checked_structured_outputs, structured_outputs_params
from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.xgrammar_backend import MAX_JSON_WHITESPACE

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How a chat request's tool calls come about."""

    mode: str  # "none" (no calls), "auto" (the tool parser reads free text),
    # "required" (a constrained JSON array of calls) or "named" (constrained arguments of one)
    parameters: dict[str, dict] = field(default_factory=dict)  # tool name -> parameters schema
    named: str | None = None  # the function of a named tool_choice
    is_parallel: bool = True  # parallel_tool_calls: more than one call allowed
    constraint: StructuredOutputsParams | None = None  # required / named: the output's schema

    @property
    def is_constrained(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(request: ChatCompletionRequest, *, enable_auto_tool_choice: bool,
               tool_call_parser: str | None, backend: str = "auto",
               harmony: bool = False) -> ToolPlan:
    """Check the request's tool fields (RequestError naming the field) and plan the calls.
    harmony: the model speaks harmony (gpt-oss), whose calls need no tool parser flags; its
    constraints are entrypoints/harmony.harmony_constraint's (this plan's are replaced)."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice: requires tools", param="tool_choice")
        return ToolPlan("none")
    parameters = _check_tools(request.tools, backend)
    is_parallel = request.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", parameters)
    has_format = _has_constraint(request)
    if choice == "auto" and harmony:  # strict tools and formats: harmony_constraint
        return ToolPlan("auto", parameters, is_parallel=is_parallel)
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            param = "tool_choice" if "tool_choice" in request.model_fields_set else "tools"
            raise RequestError(f'{param}: "auto" tool choice requires the server to run with '
                               "--enable-auto-tool-choice and --tool-call-parser (or send "
                               'tool_choice "none", "required" or a named function)', param=param)
        strict = {f["name"] for f in (t["function"] for t in request.tools) if f.get("strict")}
        constraint = None
        if strict:
            if tool_call_parser != "hermes":
                raise unsupported("tools", "strict: true needs --tool-call-parser hermes (its "
                                  "call format is what the constraint writes)")
            if has_format:
                raise RequestError("tools: strict: true constrains the calls, so it cannot be "
                                   "combined with response_format or structured outputs",
                                   param="tools")
            tag = _hermes_structural_tag(parameters, strict, is_parallel)
            constraint = checked_structured_outputs("tools", {"structural_tag": tag}, backend)
        return ToolPlan("auto", parameters, is_parallel=is_parallel, constraint=constraint)
    # A forced call is the whole output, so it is what the constraint shapes. response_format
    # (and Responses' text.format) shapes text items only, and a forced call leaves none:
    # OpenAI accepts the pair (instructor sends it), so it is checked, then has nothing to
    # constrain. vLLM's structured_outputs / guided_* name a constraint for the whole output,
    # which would contradict the call's.
    if _has_whole_output_constraint(request):
        raise RequestError("tool_choice: a required or named tool_choice constrains the whole "
                           "output, so it cannot be combined with structured_outputs or "
                           "guided_* (response_format is accepted: it shapes text, and a "
                           "forced call writes none)", param="tool_choice")
    if has_format:
        structured_outputs_params(request, backend)  # a bad format is still a 400
    if choice == "required":
        schema = _calls_schema(parameters, is_parallel)
        return ToolPlan("required", parameters, is_parallel=is_parallel,
                        constraint=checked_structured_outputs("tools", {"json": schema}, backend))
    name = _named_function(choice)
    if name not in parameters:
        raise RequestError(f"tool_choice: function {name!r} is not among the tools ("
                           + ", ".join(parameters) + ")", param="tool_choice")
    return ToolPlan("named", parameters, named=name, is_parallel=is_parallel,
                    constraint=StructuredOutputsParams(json=parameters[name]))


def _check_tools(tools: list[dict[str, Any]], backend: str) -> dict[str, dict]:
    parameters: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise unsupported(f"tools.{i}", 'only tools of type "function" with a "function" '
                              "object are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools.{i}.function.name: must be a non-empty string",
                               param=f"tools.{i}.function.name")
        if name in parameters:
            raise RequestError(f"tools.{i}.function.name: {name!r} appears twice",
                               param=f"tools.{i}.function.name")
        schema = fn.get("parameters")
        if schema is None:
            schema = _NO_PARAMETERS
        param = f"tools.{i}.function.parameters"
        if not isinstance(schema, dict):
            raise RequestError(f"{param}: must be a JSON Schema object", param=param)
        checked_structured_outputs(param, {"json": schema}, backend)
        parameters[name] = schema
    return parameters


def _named_function(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return name
    raise RequestError('tool_choice: must be "none", "auto", "required" or {"type": "function", '
                       f'"function": {{"name": ...}}}}; got {choice!r}', param="tool_choice")


def _has_constraint(request: ChatCompletionRequest) -> bool:
    fmt = request.response_format
    return (fmt is not None and fmt.type != "text") or _has_whole_output_constraint(request)


def _has_whole_output_constraint(request: ChatCompletionRequest) -> bool:
    """vLLM's structured_outputs or guided_* fields."""
    return bool(request.structured_outputs or any(
        getattr(request, f) is not None
        for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")))


def _calls_schema(parameters: dict[str, dict], is_parallel: bool) -> dict:
    """tool_choice "required" (as vLLM does it): a JSON array of {"name", "parameters"} objects,
    each naming one tool and holding that tool's arguments."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in parameters.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not is_parallel:
        schema["maxItems"] = 1
    return schema


def _hermes_structural_tag(parameters: dict[str, dict], strict: set[str],
                           is_parallel: bool) -> str:
    """`strict: true` with tool_choice "auto": text is free until the model opens a call
    (<tool_call>); the call must then name a tool, in the hermes format, and a strict tool's
    arguments follow its schema (other tools' are any JSON object). Without parallel calls the
    output ends after the first call."""
    tags = [{"type": "tag",
             "begin": '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ',
             "content": {"type": "json_schema",
                         "json_schema": schema if name in strict else {"type": "object"},
                         "max_whitespace_cnt": MAX_JSON_WHITESPACE},
             "end": "}\n</tool_call>"}
            for name, schema in parameters.items()]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
        "at_least_one": False, "stop_after_first": not is_parallel}})

