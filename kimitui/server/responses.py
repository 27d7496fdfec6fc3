"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery: the request's input
(text, or items: messages, function calls and their outputs) becomes chat messages, the reply
is decoded as a chat reply, and it is written as a response of output items, or as the
Responses event stream. ``previous_response_id`` continues a response this server made, kept
in memory (the last RESPONSES_KEPT, not across a restart); llama-server refuses it.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kimitui.engine.interface import ServingEngine
from kimitui.server.chat import ChatEvent, ChatPath
from kimitui.server.intake import read_body, require_ready
from kimitui.server.params import ApiError, Fields, shown
from kimitui.server.shapes import event_stream, timings

RESPONSES_KEPT = 64
# Fields of a Responses request that are not chat-completions fields: translated below or
# taken as said. The rest (temperature, top_p, seed, llama-server's sampling fields) pass as they are.
OWN_FIELDS = frozenset({
    "input", "instructions", "max_output_tokens", "previous_response_id", "store", "text", "tools", "tool_choice",
    "reasoning", "truncation", "metadata", "user", "include", "model", "background", "prompt_cache_key", "safety_identifier",
    "service_tier", "stream_options",
})
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where}: expected a string or a list of content parts, got {shown(content)}")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(f"{where}[{i}]: {kind} parts are not supported (kimitui serves text models only)")
        else:
            raise ApiError(f"{where}[{i}].type: expected input_text or output_text, got {shown(kind)}")
    return parts


def _items(items: list, chat: list[dict]) -> None:
    """Input items as chat messages, appended to ``chat``: function calls join the assistant
    turn before them."""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where}: expected an item object, got {shown(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(f"{where}.role: expected user, system, developer or assistant, got {shown(role)}")
            chat.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not all(isinstance(v, str) for v in (name, call_id, arguments)):
                raise ApiError(f'{where}: expected {{"type": "function_call", "call_id": ..., "name": ..., "arguments": "JSON text"}}')
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if chat and chat[-1]["role"] == "assistant":
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ApiError(f"{where}.call_id: required, a string")
            chat.append({"role": "tool", "tool_call_id": call_id, "content": _text(output if output is not None else "", f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier reply's reasoning: the template renders replies without it
        else:
            raise ApiError(f"{where}.type: expected message, function_call, function_call_output or reasoning, got {shown(kind)}")


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise ApiError(f"tools: expected a list of tools, got {shown(value)}")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ApiError(f"tools[{i}].type: only function tools are run here, got {shown(kind)}")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value  # "auto", "none", "required"; anything else is refused as chat's tool_choice is


def _format(value: Any) -> dict | None:
    """text.format as chat's response_format."""
    if value is None:
        return None
    fmt = value.get("format") if isinstance(value, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError("text.format.schema: required with type json_schema, a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "reply"), "schema": fmt["schema"]}}
    raise ApiError(f"text.format.type: expected text, json_object or json_schema, got {shown(kind)}")


class Responses:
    """Responses made here, for ``previous_response_id``: each one's whole conversation."""

    def __init__(self) -> None:
        self.kept: OrderedDict[str, list[dict]] = OrderedDict()

    def chat_request(self, body: dict) -> tuple[dict, list[dict]]:
        """The chat-completions request a Responses request means, and its conversation without
        the instructions (what a later response continues)."""
        if body.get("background") not in (None, False):
            raise ApiError("background: not supported by kimitui (a response is answered while the request waits)")
        chat: list[dict] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str) or previous not in self.kept:
                raise ApiError(
                    f"previous_response_id: {shown(previous)} is not a response this server keeps (it keeps the last "
                    f"{RESPONSES_KEPT} made with store, in memory)", 404, "not_found_error",
                )
            self.kept.move_to_end(previous)
            chat = copy.deepcopy(self.kept[previous])  # a function_call item may join its last turn: the kept one stays
        given = body.get("input")
        if given is None:
            raise ApiError("input: required")
        if isinstance(given, str):
            chat.append({"role": "user", "content": given})
        elif isinstance(given, list):
            _items(given, chat)
        else:
            raise ApiError(f"input: expected text or a list of items, got {shown(given)}")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError(f"instructions: expected a string, got {shown(instructions)}")
        out = {k: v for k, v in body.items() if k not in OWN_FIELDS}
        # The instructions lead this response only: a continued one is given its own, as OpenAI's.
        out["messages"] = ([{"role": "system", "content": instructions}] if instructions is not None else []) + chat
        if body.get("max_output_tokens") is not None:
            out["max_tokens"] = body["max_output_tokens"]
        if body.get("tools"):
            out["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(body["tool_choice"])
        fmt = _format(body.get("text"))
        if fmt is not None:
            out["response_format"] = fmt
        return out, chat

    def keep(self, ident: str, chat: list[dict], text: str, calls: list[dict]) -> None:
        reply: dict = {"role": "assistant", "content": text}
        if calls:
            reply["tool_calls"] = copy.deepcopy(calls)
        self.kept[ident] = chat + [reply]
        while len(self.kept) > RESPONSES_KEPT:
            self.kept.popitem(last=False)


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _usage(result) -> dict:
    return {
        "input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _message_item(ident: str, text: str, status: str) -> dict:
    return {"id": ident, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict, status: str) -> dict:
    function = call["function"]
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"]}


class Shape:
    """What a response says besides its output: its id, model and the request's settings."""

    def __init__(self, ident: str, model: str, body: dict, previous: str | None) -> None:
        self.ident, self.model, self.created = ident, model, int(time.time())
        self.settings = {
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools", []), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous, "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}, "store": body.get("store", True),
        }

    def response(self, status: str, output: list[dict], end=None) -> dict:
        incomplete = status == "incomplete"
        return {
            "id": self.ident, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": _usage(end.result) if end is not None else None, **self.settings,
        }

    def whole(self, text: str, end) -> dict:
        """The response of a finished reply."""
        status = "incomplete" if end.finish == "length" else "completed"
        output = [_message_item(f"msg_{uuid.uuid4().hex}", text, status)] if text or not end.calls else []
        output += [_call_item(call, "completed") for call in end.calls]
        return self.response(status, output, end)


async def events(shape: Shape, replies: AsyncIterator, extra: Callable[[Any], dict], on_end: Callable[[str, Any], None]) -> AsyncIterator[dict]:
    """The Responses event stream for one reply. ``extra(event)`` adds llama-server's fields
    (timings, prompt_progress) to a delta or progress event; ``on_end(text, end)`` is called
    once the reply is whole."""
    number = 0

    def event(kind: str, **payload) -> dict:
        nonlocal number
        number += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": number - 1, **payload}, ensure_ascii=False, separators=(",", ":"))}

    yield event("response.created", response=shape.response("in_progress", []))
    yield event("response.in_progress", response=shape.response("in_progress", []))
    message_id, text, index = f"msg_{uuid.uuid4().hex}", "", 0
    opened = False

    def open_message():
        yield event("response.output_item.added", output_index=0, item={**_message_item(message_id, "", "in_progress"), "content": []})
        yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    async for reply in replies:
        if reply.kind == "progress":
            yield event("response.in_progress", response=shape.response("in_progress", []), **extra(reply))
        elif reply.kind == "text":
            if not opened:
                for e in open_message():
                    yield e
                opened = True
            text += reply.text
            yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0, delta=reply.text,
                        logprobs=[], **extra(reply))
        elif reply.kind == "error":
            yield event("error", code="server_error", message=reply.text, param=None)
            return
        elif reply.kind == "end":
            status = "incomplete" if reply.finish == "length" else "completed"
            output = []
            if not opened and not reply.calls:
                for e in open_message():
                    yield e
                opened = True
            if opened:
                item = _message_item(message_id, text, status)
                part = item["content"][0]
                yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text, logprobs=[])
                yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part)
                yield event("response.output_item.done", output_index=0, item=item)
                output.append(item)
                index = 1
            for call in reply.calls:
                item = _call_item(call, "completed")
                yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"],
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
                index += 1
            on_end(text, reply)
            # response.completed whatever the status, as llama-server ends it: the openai SDK's
            # stream helper waits for that event; a reply cut short says "incomplete" inside it.
            yield event("response.completed", response=shape.response(status, output, reply), **extra(reply))


@dataclass(eq=False)
class ResponsesRoutes:
    """POST /v1/responses, and the responses kept for previous_response_id."""

    engine: ServingEngine
    chat: ChatPath
    model_id: str
    kept: Responses = field(default_factory=Responses)

    async def respond(self, request: Request) -> Response:
        require_ready(self.engine)
        body = (await read_body(request)).body
        chat, conversation = self.kept.chat_request(body)
        fields = Fields(chat)
        if fields.body.get("n") not in (None, 1):
            raise ApiError("n: a response has one reply")
        call = await self.chat.prepare_chat(request, fields)
        shape = Shape(new_id(), self.model_id, body, body.get("previous_response_id"))
        store = Fields(body).boolean("store", True)

        def keep(text: str, end: ChatEvent) -> None:
            if store:
                self.kept.keep(shape.ident, conversation, text, end.calls)

        if not fields.boolean("stream", False):
            whole = await self.chat.chat_whole(request, call)
            if whole is None:
                return Response(status_code=499)
            text, end = whole
            keep(text, end)
            return JSONResponse(shape.whole(text, end), headers=request.state.headers)
        replies = await self.chat.chat_events(request, call)
        if replies is None:
            return Response(status_code=499)
        per_token = fields.boolean("timings_per_token", False)

        def extra(event: ChatEvent) -> dict:
            """llama-server's own fields on the Responses stream: prompt progress, timings."""
            if event.kind == "progress":
                return {"prompt_progress": asdict(event.progress)}
            if event.result is not None and (per_token or event.kind == "end"):
                return {"timings": timings(event.result)}
            return {}

        return event_stream(events(shape, replies, extra, keep), request.state.headers)
