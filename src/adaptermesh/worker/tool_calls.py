"""Tool calls in chat completions: the request's ``tools`` and ``tool_choice`` checked (400
naming the field), the messages a chat template gets (an assistant's ``tool_calls``, ``tool``
messages), the grammar that enforces ``required`` and a named function, and the model's
output parsed back into OpenAI's ``tool_calls``, whole or as streamed deltas.

Output formats (``--tool-call-parser``; ``auto`` picks by the tokenizer's vocabulary, then the
model family):

* ``llama3_json`` (Llama 3.1+): the output is ``{"name": ..., "parameters": {...}}``, maybe
  after ``<|python_tag|>``, several separated by ``;``;
* ``hermes`` (Qwen2 / Qwen2.5 / Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks, maybe after some text;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``
  (the marker is a special token; the list alone is recognised too).

``tool_choice: "required"`` constrains the output to a JSON list of ``{"name", "parameters"}``
objects (at least one; one when ``parallel_tool_calls`` is false), each matching one tool's
parameters schema; a named function constrains it to that function's parameters. Either way
the parse does not depend on the model's own format. ``none`` renders the tools but parses
nothing; ``auto`` (the default with tools) parses the model's format.

Arguments are reported as the JSON text the model wrote, so a stream's argument fragments,
joined, equal the whole answer's ``arguments``.

As vLLM does: with ``parallel_tool_calls: false`` only the first call is kept (``required``'s
grammar allows just one); under ``auto``, an output whose calls name a function that is not
in ``tools``, or whose call is cut off (its object never closes, or its arguments are not a
JSON object), is returned as content, with no calls; ``finish_reason`` is ``tool_calls`` only
under ``auto`` (a named function and ``required`` end with ``stop``, as OpenAI and vLLM
answer them).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Literal

from adaptermesh.worker.grammar import GrammarSpec
from adaptermesh.worker.structured_request import bad_field, schema_spec

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedCall",
    "ToolCallStream",
    "ToolPlan",
    "detect_tool_parser",
    "parse_tool_calls",
    "template_messages",
    "tool_plan",
]

ToolFormat = Literal["llama3_json", "hermes", "mistral", "required", "named"]
# The choices of --tool-call-parser.
TOOL_CALL_PARSERS = ("auto", "llama3_json", "hermes", "mistral")
MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_MARKER = "[TOOL_CALLS]"
_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\r\n"


def detect_tool_parser(model_type: str, vocab: Container[str]) -> str:
    """The output format of a model: by the marker tokens its vocabulary has, else by its
    family (``model_type`` from config.json), else ``llama3_json``."""
    if _HERMES_OPEN in vocab:
        return "hermes"
    if _MISTRAL_MARKER in vocab:
        return "mistral"
    if _PYTHON_TAG in vocab:
        return "llama3_json"
    family = model_type.lower()
    if family.startswith("qwen"):
        return "hermes"
    if family.startswith(("mistral", "mixtral")):
        return "mistral"
    return "llama3_json"


# ------------------------------------------------------------------------------ the request
@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools mean for its generation and its answer."""

    tools: list[dict[str, Any]]  # as the template gets them (OpenAI's function shape)
    choice: str  # "auto", "none", "required" or "function"
    function: str | None  # the named function
    parallel: bool
    parser: str  # the model's format (TOOL_CALL_PARSERS without "auto")

    @property
    def format(self) -> ToolFormat | None:
        """How the output is parsed; None: it is not (``tool_choice: none``)."""
        if self.choice == "none":
            return None
        if self.choice == "required":
            return "required"
        if self.choice == "function":
            return "named"
        return self.parser  # type: ignore[return-value]

    def grammar_spec(self) -> GrammarSpec | None:
        """The constraint that enforces ``required`` or a named function (None otherwise)."""
        by_name = {tool["function"]["name"]: tool["function"] for tool in self.tools}
        if self.choice == "function":
            assert self.function is not None
            index = next(
                i for i, tool in enumerate(self.tools) if tool["function"]["name"] == self.function
            )
            return schema_spec(
                _parameters(by_name[self.function]), f"tools[{index}].function.parameters"
            )
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        options = []
        for function in by_name.values():
            parameters = dict(_parameters(function))
            for key in ("$defs", "definitions"):
                if isinstance(parameters.get(key), dict):
                    defs.setdefault(key, {}).update(parameters.pop(key))
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": function["name"]}, "parameters": parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if not self.parallel:
            schema["maxItems"] = 1
        schema.update(defs)
        return schema_spec(schema, "tools")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    def tool_specs(self) -> list[GrammarSpec]:
        """Each tool's parameters as a constraint of its own, named
        ``tools[i].function.parameters``: every definition compiles, whatever the choice."""
        return [
            schema_spec(tool["function"]["parameters"], f"tools[{i}].function.parameters")
            for i, tool in enumerate(self.tools)
        ]

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        fmt = self.format
        if fmt is None:
            return text, []
        content, calls = parse_tool_calls(fmt, text, self.function)
        forced = fmt in ("named", "required")
        if calls and not forced and not all(_usable(call, self.names) for call in calls):
            return text, []
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """The choice's ``finish_reason``: ``tool_calls`` for calls the model chose to make
        (``auto``) and stopped after; a forced call (named, ``required``) ends ``stop``."""
        if called and reason == "stop" and self.choice == "auto":
            return "tool_calls"
        return reason

    def stream(self) -> ToolCallStream:
        fmt = self.format
        assert fmt is not None
        forced = fmt in ("named", "required")
        return ToolCallStream(
            fmt,
            self.function,
            names=None if forced else self.names,
            limit=None if self.parallel else 1,
        )


def _usable(call: ParsedCall, names: frozenset[str]) -> bool:
    """A whole call to a known function whose arguments are a JSON object."""
    if not call.complete or call.name not in names:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    at = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_field(at, f"must be an object, got {_type_name(tool)}")
    if tool.get("type") != "function":
        raise bad_field(f"{at}.type", f"must be 'function', got {tool.get('type')!r}")
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise bad_field(f"{at}.{unknown[0]}", "is not a field of a tool", "unknown_field")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_field(f"{at}.function", f"must be an object, got {_type_name(function)}")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise bad_field(
            f"{at}.function.{unknown[0]}", "is not a field of a function", "unknown_field"
        )
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise bad_field(
            f"{at}.function.name", "must be 1 to 64 letters, digits, underscores or dashes"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_field(f"{at}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad_field(
                f"{at}.function.parameters",
                f"must be a JSON schema object, got {_type_name(parameters)}",
            )
        if parameters.get("type", "object") != "object":
            raise bad_field(f"{at}.function.parameters.type", "must be 'object'")
        schema_spec(parameters, f"{at}.function.parameters")  # its size and shape
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_field(f"{at}.function.strict", "must be a boolean")
    clean: dict[str, Any] = {"name": name}
    if description is not None:
        clean["description"] = description
    clean["parameters"] = _parameters(function)
    return {"type": "function", "function": clean}


def tool_plan(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, parser: str
) -> ToolPlan | None:
    """The plan of a chat request's ``tools`` / ``tool_choice`` (None without tools); a 400
    naming the field when one is malformed."""
    if tools is None or tools == []:
        if tool_choice in (None, "none", "auto"):
            return None
        raise bad_field("tool_choice", "needs tools: the request defines no functions")
    if not isinstance(tools, list):
        raise bad_field("tools", f"must be a list of tools, got {_type_name(tools)}")
    if len(tools) > MAX_TOOLS:
        raise bad_field("tools", f"must have at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = [_check_tool(index, tool) for index, tool in enumerate(tools)]
    seen: set[str] = set()
    for index, tool in enumerate(checked):
        name = tool["function"]["name"]
        if name in seen:
            raise bad_field(f"tools[{index}].function.name", f"{name!r} is defined twice")
        seen.add(name)
    function: str | None = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise bad_field(
                "tool_choice",
                f"must be 'auto', 'none', 'required' or a named function, got {tool_choice!r}",
            )
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise bad_field(
                "tool_choice.type", f"must be 'function', got {tool_choice.get('type')!r}"
            )
        named = tool_choice.get("function")
        if not isinstance(named, dict) or not isinstance(named.get("name"), str):
            raise bad_field("tool_choice.function.name", "must name a function")
        function = named["name"]
        if function not in seen:
            raise bad_field(
                "tool_choice.function.name", f"{function!r} is not one of the request's tools"
            )
        choice = "function"
    else:
        raise bad_field(
            "tool_choice", f"must be a string or a named function, got {_type_name(tool_choice)}"
        )
    return ToolPlan(
        checked,
        choice,
        function,
        True if parallel_tool_calls is None else parallel_tool_calls,
        parser,
    )


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The chat's messages as its template gets them: an assistant's ``tool_calls`` with
    their arguments as objects (templates serialise them themselves), a tool message's
    ``tool_call_id`` and ``name``. A malformed tool call is a 400 naming it."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        calls = message.tool_calls
        if calls is not None:
            if message.role != "assistant":
                raise bad_field(
                    f"messages[{index}].tool_calls", "only assistant messages have tool calls"
                )
            item["tool_calls"] = _template_calls(index, calls)
        if message.tool_call_id is not None:
            if not isinstance(message.tool_call_id, str):
                raise bad_field(f"messages[{index}].tool_call_id", "must be a string")
            item["tool_call_id"] = message.tool_call_id
        elif message.role == "tool":
            raise bad_field(
                f"messages[{index}].tool_call_id",
                "is required: a tool message answers the tool call with this id",
                "missing_field",
            )
        if message.name is not None:
            if not isinstance(message.name, str):
                raise bad_field(f"messages[{index}].name", "must be a string")
            item["name"] = message.name
        out.append(item)
    return out


def _template_calls(index: int, calls: Any) -> list[dict[str, Any]]:
    at = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad_field(at, f"must be a list, got {_type_name(calls)}")
    out = []
    for j, call in enumerate(calls):
        here = f"{at}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad_field(here, "must be an object with a function")
        function = call["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{here}.function.name", "must be a non-empty string")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise bad_field(f"{here}.function.arguments", "must be JSON text") from None
        out.append(
            {
                "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{j}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


# ---------------------------------------------------------------------------- the parsing
@dataclass(slots=True)
class ParsedCall:
    """One call found in the output; ``arguments`` is JSON text (so far, while streaming)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False  # the call's object (or the named output) is closed

    def as_openai(self, call_id: str | None = None) -> dict[str, Any]:
        return {
            "id": call_id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class _Snapshot:
    content: str  # text that is content (safe to send)
    calls: list[ParsedCall] = field(default_factory=list)
    decided: bool = True  # False: the text so far could still start a call region


def _skip(text: str, i: int, chars: str = _WHITESPACE) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string starting at ``text[i] == '"'``, or None if open."""
    j = i + 1
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2
            continue
        if char == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``i``, or None when the text ends first."""
    if i >= len(text):
        return None
    char = text[i]
    if char == '"':
        return _string_end(text, i)
    if char in "{[":
        depth = 0
        j = i
        while j < len(text):
            char = text[j]
            if char == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n;":
        j += 1
    return j if j < len(text) else None


def _scan_call(text: str, i: int) -> tuple[ParsedCall | None, int | None]:
    """The call object starting at ``text[i] == '{'`` (as far as the text goes) and the index
    after it (None while open). A closed object without a string ``name`` is no call."""
    call = ParsedCall()
    j = _skip(text, i + 1)
    args: tuple[int, int | None] | None = None
    while j < len(text):
        if text[j] == "}":
            if call.name is None:
                return None, j + 1
            call.complete = True
            return _with_arguments(call, text, args), j + 1
        if text[j] == ",":
            j = _skip(text, j + 1)
            continue
        if text[j] != '"':
            return None, len(text)  # not a call object
        key_end = _string_end(text, j)
        if key_end is None:
            break
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            return None, len(text)
        j = _skip(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            return None, len(text)
        j = _skip(text, j + 1)
        end = _value_end(text, j)
        if key == "name" and end is not None:
            try:
                name = json.loads(text[j:end])
            except ValueError:
                return None, len(text)
            call.name = name if isinstance(name, str) else None
        elif key in _ARGUMENT_KEYS and args is None:
            args = (j, end)
        if end is None:
            break
        j = _skip(text, end)
    return _with_arguments(call, text, args), None


def _with_arguments(call: ParsedCall, text: str, args: tuple[int, int | None] | None) -> ParsedCall:
    if args is None:
        call.arguments = "{}" if call.complete else ""
        return call
    start, end = args
    if end is None:
        # An open object: every character so far is its text. Other open values wait.
        call.arguments = text[start:] if text[start : start + 1] == "{" else ""
        return call
    raw = text[start:end]
    if raw.startswith('"'):
        try:
            decoded = json.loads(raw)
        except ValueError:
            decoded = raw
        call.arguments = decoded if isinstance(decoded, str) else raw
    else:
        call.arguments = raw
    return call


def _scan_sequence(text: str, i: int, separators: str) -> list[ParsedCall]:
    """Call objects from ``i`` on, separated by ``separators`` (and whitespace); stops at
    anything else (a list's ``]``, a closing tag)."""
    calls: list[ParsedCall] = []
    while True:
        i = _skip(text, i, _WHITESPACE + separators)
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = _scan_call(text, i)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        i = end


def _prefix_hold(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could start ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _snapshot(fmt: ToolFormat, text: str, final: bool, function: str | None) -> _Snapshot:
    if fmt == "named":
        start = _skip(text, 0)
        end = _value_end(text, start)
        call = ParsedCall(function, text[start:end] if end is not None else text[start:])
        call.complete = end is not None
        return _Snapshot("", [call])
    if fmt == "hermes":
        at = text.find(_HERMES_OPEN)
        if at < 0:
            hold = 0 if final else _prefix_hold(text, _HERMES_OPEN)
            return _Snapshot(text[: len(text) - hold], decided=hold == 0)
        calls: list[ParsedCall] = []
        i = at
        while i >= 0:
            start = i + len(_HERMES_OPEN)
            calls.extend(_scan_sequence(text, start, ""))
            close = text.find(_HERMES_CLOSE, start)
            if close < 0:
                break
            i = text.find(_HERMES_OPEN, close)
        return _Snapshot(text[:at], calls)
    start = _skip(text, 0)
    rest = text[start:]
    if fmt == "llama3_json":
        if rest.startswith(_PYTHON_TAG):
            return _Snapshot("", _scan_sequence(text, start + len(_PYTHON_TAG), ";"))
        if not rest or (not final and _PYTHON_TAG.startswith(rest)):
            return _Snapshot("", decided=False)
        if rest.startswith("{"):
            return _Snapshot("", _scan_sequence(text, start, ";"))
        return _Snapshot(text)
    # mistral and required: a JSON list of call objects.
    if rest.startswith(_MISTRAL_MARKER):
        start += len(_MISTRAL_MARKER)
        rest = text[start:].lstrip(_WHITESPACE)
        start = len(text) - len(rest)
        if not rest:
            return _Snapshot("", decided=False)
    elif not final and (not rest or _MISTRAL_MARKER.startswith(rest) or rest == "["):
        return _Snapshot("", decided=False)
    if rest.startswith("["):
        return _Snapshot("", _scan_sequence(text, start + 1, ","))
    return _Snapshot(text)


def parse_tool_calls(
    fmt: ToolFormat, text: str, function: str | None = None
) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a whole output: the text before the calls (None when empty
    and there are calls) and every call with a name. An output in which no call is found is
    all content."""
    snapshot = _snapshot(fmt, text, True, function)
    calls = [call for call in snapshot.calls if call.name is not None]
    if not calls:
        return text, []
    return snapshot.content or None, calls


class ToolCallStream:
    """One streamed choice's output as OpenAI's deltas: ``feed`` each text increment and get
    the deltas to send (``{"content": ...}`` or ``{"tool_calls": [...]}``), ``finish`` at the
    end. A call's first delta carries its index, id, type and name with empty arguments; its
    arguments follow in fragments as the model writes them."""

    def __init__(
        self,
        fmt: ToolFormat,
        function: str | None = None,
        *,
        names: frozenset[str] | None = None,
        limit: int | None = None,
    ) -> None:
        self.format = fmt
        self.function = function
        self.names = names  # the known functions (None: not checked)
        self.limit = limit  # the most calls sent (None: all)
        self.text = ""
        self.sent_content = 0
        self.sent_arguments: list[int] = []
        self.ids: list[str] = []
        # A first call to an unknown function turns the output into content (as a whole
        # answer's would be); a later one, after calls were sent, is dropped.
        self.as_content = False
        self.dropped = False

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if self.as_content:
            return self._deltas(_Snapshot(self.text))
        return self._deltas(_snapshot(self.format, self.text, False, self.function))

    def finish(self) -> list[dict[str, Any]]:
        snapshot = _snapshot(self.format, self.text, True, self.function)
        if self.as_content or (
            not self.called and not any(call.name is not None for call in snapshot.calls)
        ):
            # No call after all: everything not yet sent is content.
            snapshot = _Snapshot(self.text)
        return self._deltas(snapshot)

    def _deltas(self, snapshot: _Snapshot) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        named = [call for call in snapshot.calls if call.name is not None]
        if (
            self.names is not None
            and not self.called
            and any(call.name not in self.names for call in named)
        ):
            self.as_content = True
            snapshot, named = _Snapshot(self.text), []
        if len(snapshot.content) > self.sent_content and not self.called:
            deltas.append({"content": snapshot.content[self.sent_content :]})
            self.sent_content = len(snapshot.content)
        if self.names is not None:
            known = []
            for call in named:
                if call.name not in self.names:
                    self.dropped = True
                    break
                known.append(call)
            named = known
        if self.limit is not None:
            named = named[: self.limit]
        for index, call in enumerate(named):
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": self.ids[index],
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            sent = self.sent_arguments[index]
            if len(call.arguments) > sent:
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": index, "function": {"arguments": call.arguments[sent:]}}
                        ]
                    }
                )
                self.sent_arguments[index] = len(call.arguments)
        return deltas
