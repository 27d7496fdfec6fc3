"""Tool calls (OpenAI's ``tools`` and ``tool_choice``) in the formats Kimi K2 and K3 speak.

The model's chat template renders the tools, and the model answers with a section of calls.
Kimi K2 (and its kimi-k2 / deepseek2 GGUFs) writes each call as ``functions.NAME:INDEX`` and
its arguments as JSON::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Kimi K3 writes tags (its template's open_tag / close_tag), the arguments as one JSON block or
one tag per argument, after its think and response parts::

    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>json type="object"<|sep|>{"city": "Paris"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>

The reply is read back into OpenAI's ``tool_calls``. With ``tool_choice`` "required" or a named
function a grammar makes the reply such a section, its arguments matching each function's JSON
schema (llama-cpp-python's schema converter), as llama-server constrains a required call. The
format is told by the chat template; one that speaks neither is refused with a line naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kimitui.server.params import ApiError

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MAX_TOOLS = 64
_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")  # OpenAI's rule for function names
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"\s*(?:functions\.)?([A-Za-z0-9_\-.]+):(\d+)\s*" + re.escape(ARGUMENT_BEGIN) + r"(.*?)" + re.escape(CALL_END),
    re.S,
)


K3_TOOLS_OPEN, K3_TOOLS_CLOSE = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
_K3_CALL = re.compile(r'<\|open\|>call tool="([^"]*)" index="(\d+)"<\|sep\|>(.*?)<\|close\|>call<\|sep\|>', re.S)
_K3_JSON = re.compile(r'<\|open\|>json type="object"<\|sep\|>(.*?)<\|close\|>json<\|sep\|>', re.S)
_K3_ARGUMENT = re.compile(r'<\|open\|>argument key="([^"]*)" type="([a-z]+)"<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>', re.S)
_K3_RESPONSE = re.compile(r"<\|open\|>response<\|sep\|>(.*?)<\|close\|>response<\|sep\|>", re.S)


def tool_format(template: str) -> str | None:
    """"k2", "k3", or None: which tool-call format the chat template speaks."""
    if SECTION_BEGIN in template:
        return "k2"
    if "open_tag('call'" in template or '<|open|>call' in template:
        return "k3"
    return None


def tools_of(value: Any) -> list[dict]:
    """OpenAI's tools list, checked: each a function with a name and, optionally, a JSON
    schema of its parameters."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(f"tools: expected a list of tools, got {type(value).__name__}")
    if len(value) > MAX_TOOLS:
        raise ApiError(f"tools: at most {MAX_TOOLS} tools, got {len(value)}")
    names = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(f'{where}: expected {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ApiError(f"{where}.function.name: expected 1 to 64 letters, digits, _ or -, got {json.dumps(name)[:40]}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise ApiError(f"{where}.function.parameters: expected a JSON schema object")
        if name in names:
            raise ApiError(f"{where}.function.name: {name} is given twice")
        names.add(name)
    return value


def _own_definitions(schema: Any, prefix: str) -> Any:
    """A copy of ``schema`` whose $defs / definitions and the refs to them carry ``prefix``: the
    converter names a rule after its definition, so two tools' "Item" must not meet."""
    if isinstance(schema, list):
        return [_own_definitions(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("$defs", "definitions") and isinstance(value, dict):
            out[key] = {prefix + name: _own_definitions(inner, prefix) for name, inner in value.items()}
        elif key == "$ref" and isinstance(value, str):
            out[key] = re.sub(r"^#/(\$defs|definitions)/", lambda m: m.group(0) + prefix, value)
        else:
            out[key] = _own_definitions(value, prefix)
    return out


def tool_choice_of(value: Any, tools: list[dict]) -> str | dict:
    """"none", "auto" (the default with tools), "required", or one named function."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise ApiError(f"tool_choice: {value} needs tools")
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise ApiError(f"tool_choice.function.name: {json.dumps(name)[:40]} is not one of the tools")
        return value
    raise ApiError('tool_choice: expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def calls_grammar(tools: list[dict], choice: str | dict, form: str = "k2", *, several: bool = True) -> str:
    """GBNF for a reply that is a section of calls (one or more with ``several``, OpenAI's
    parallel_tool_calls; exactly one for a named function), each to a listed function with
    arguments its schema accepts. Kimi K3's reply
    may first close an opened think part and give an empty response part, as its format has."""
    from llama_cpp.llama_grammar import SchemaConverter

    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    calls = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = _own_definitions(function.get("parameters") or {"type": "object"}, f"t{i}-")
        try:
            arguments = converter.visit(converter.resolve_refs(schema, ""), f"tool-{i}-arguments")
        except Exception as exc:  # noqa: BLE001 - the converter raises what it meets (asserts, ValueError)
            raise ApiError(f"tools[{i}].function.parameters: cannot be turned into a grammar ({type(exc).__name__}: {exc})") from None
        if form == "k3":
            opening = json.dumps(f'<|open|>call tool="{function["name"]}" index="')
            middle = json.dumps('"<|sep|><|open|>json type="object"<|sep|>')
            calls.append(f'{opening} [1-9] [0-9]? {middle} {arguments} {json.dumps("<|close|>json<|sep|><|close|>call<|sep|>")}')
        else:
            literal = json.dumps(f"{CALL_BEGIN}functions.{function['name']}:")
            calls.append(f"{literal} [0-9] [0-9]? {json.dumps(ARGUMENT_BEGIN)} {arguments} {json.dumps(CALL_END)}")
    call = converter._add_rule("tool-call", " | ".join(f"( {c} )" for c in calls))  # its name: a schema may have taken "tool-call"
    repeat = "+" if several and not isinstance(choice, dict) else ""
    if form == "k3":
        preamble = f'{json.dumps("<|close|>think<|sep|>")}? {json.dumps("<|open|>response<|sep|><|close|>response<|sep|>")}?'
        converter._rules["root"] = f"{preamble} {json.dumps(K3_TOOLS_OPEN)} {call}{repeat} {json.dumps(K3_TOOLS_CLOSE)}"
    else:
        converter._rules["root"] = f"{json.dumps(SECTION_BEGIN)} {call}{repeat} {json.dumps(SECTION_END)}"
    return converter.format_grammar()


def read_calls(text: str, form: str = "k2") -> tuple[str, list[dict]]:
    """(the reply's content, OpenAI tool_calls); no section: (text, [])."""
    if form == "k3":
        return _read_k3(text)
    at = text.find(SECTION_BEGIN)
    if at == -1:
        return text, []
    calls = []
    for name, index, arguments in _CALL.findall(text[at:]):
        calls.append({
            "id": f"functions.{name}:{index}",
            "type": "function",
            "function": {"name": name, "arguments": arguments.strip()},
        })
    return text[:at], calls


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def k3_content(text: str) -> str:
    """What a Kimi K3 reply says to the user: its response part, without the think part and
    the tags (the whole text when it has neither)."""
    response = _K3_RESPONSE.search(text)
    if response is not None:
        return response.group(1)
    closed = text.find("<|close|>think<|sep|>")
    if closed != -1:
        text = text[closed + len("<|close|>think<|sep|>"):]
    return text.split("<|open|>response<|sep|>", 1)[-1]


def _read_k3(text: str) -> tuple[str, list[dict]]:
    at = text.find(K3_TOOLS_OPEN)
    if at == -1:
        return k3_content(text), []
    content = k3_content(text[:at])
    calls = []
    for name, index, body in _K3_CALL.findall(text[at:]):
        name = _unescape(name)
        block = _K3_JSON.search(body)
        if block is not None:
            arguments = block.group(1).strip()
        else:
            values = {}
            for key, kind, value in _K3_ARGUMENT.findall(body):
                try:
                    values[_unescape(key)] = value if kind == "string" else json.loads(value)
                except ValueError:
                    values[_unescape(key)] = value  # what the model wrote, for the client to judge
            arguments = json.dumps(values, ensure_ascii=False)
        calls.append({"id": f"functions.{name}:{index}", "type": "function", "function": {"name": name, "arguments": arguments}})
    return content, calls
