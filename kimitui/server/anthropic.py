"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat
machinery: a request is turned into the chat-completions request it means, decoded the same
way, and the reply is written in Anthropic's shape (a message of content blocks, or its event
stream). As llama-server does it, with two differences a client notices: a tool result comes
before the text of the same user turn (a chat template wants the answer right after the call),
and ``tool_choice: {"type": "tool", "name": ...}`` makes that tool's call, not any call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kimitui.engine.interface import ServingEngine
from kimitui.server.chat import ChatPath
from kimitui.server.intake import read_body, require_ready
from kimitui.server.params import ApiError, Fields, shown
from kimitui.server.shapes import event_stream

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# A Messages request's fields that are not chat-completions fields: translated below, or taken as
# said (one model; no reasoning budget; metadata is the client's own).
OWN_FIELDS = frozenset({
    "messages", "system", "stop_sequences", "tools", "tool_choice", "model", "metadata", "thinking", "service_tier",
    "container", "mcp_servers", "output_config", "anthropic_version",
})


def _text_of(value: Any, where: str) -> str:
    """A string, or a list of text blocks (joined by newlines, as chat text parts are)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(f"{where}: expected a string or a list of text blocks, got {shown(value)}")
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(f"{where}[{i}]: expected a text block ({{\"type\": \"text\", \"text\": ...}}), got {shown(block)}")
        parts.append(block["text"])
    return "\n".join(parts)


def _message(msg: Any, where: str) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages
    (before its text), an assistant turn's tool_use blocks its tool_calls."""
    if not isinstance(msg, dict):
        raise ApiError(f"{where}: expected an object with role and content, got {shown(msg)}")
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise ApiError(f"{where}.role: expected user or assistant, got {shown(role)}")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(f"{where}.content: expected a string or a list of content blocks, got {shown(content)}")
    texts, calls, results, thoughts = [], [], [], []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use" and role == "assistant":
            name, ident, given = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(ident, str) or not isinstance(given, dict):
                raise ApiError(f'{at}: expected {{"type": "tool_use", "id": ..., "name": ..., "input": {{...}}}}')
            calls.append({"id": ident, "type": "function", "function": {"name": name, "arguments": json.dumps(given, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            ident = block.get("tool_use_id")
            if not isinstance(ident, str):
                raise ApiError(f"{at}.tool_use_id: required for a tool result, a string")
            answer = _text_of(block.get("content", ""), f"{at}.content")
            # Anthropic's flag has no place in a chat template; the model is told in words.
            if block.get("is_error") is True:
                answer = f"Error: {answer}"
            results.append({"role": "tool", "tool_call_id": ident, "content": answer})
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])  # an earlier turn's reasoning, for templates that render it
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted reasoning: nothing a local template can render
        elif kind in ("image", "document"):
            raise ApiError(f"{at}: {kind} blocks are not supported (kimitui serves text models only)")
        else:
            raise ApiError(f"{at}.type: expected text, tool_use (assistant) or tool_result (user), got {shown(kind)}")
    out = list(results)
    if texts or calls or thoughts or not results:
        message: dict = {"role": role, "content": texts}
        if calls:
            message["tool_calls"] = calls
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        out.append(message)
    return out


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise ApiError(f"tools: expected a list of tools, got {shown(value)}")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ApiError(f'tools[{i}]: expected {{"name": ..., "description": ..., "input_schema": {{...}}}}')
        if tool.get("type") not in (None, "custom"):
            raise ApiError(f"tools[{i}].type: {tool['type']} is one of Anthropic's server tools, which kimitui does not run")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> tuple[Any, bool]:
    """OpenAI's tool_choice for Anthropic's, and whether several calls may be made."""
    if not isinstance(value, dict):
        raise ApiError(f"tool_choice: expected an object with a type, got {shown(value)}")
    kind = value.get("type")
    several = value.get("disable_parallel_tool_use") is not True
    if kind == "auto":
        return "auto", several
    if kind == "any":
        return "required", several
    if kind == "none":
        return "none", several
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise ApiError("tool_choice.name: required with type tool")
        return {"type": "function", "function": {"name": value["name"]}}, several
    raise ApiError(f"tool_choice.type: expected auto, any, tool or none, got {shown(kind)}")


def chat_request(body: dict) -> dict:
    """The chat-completions request an Anthropic Messages request means. Fields are checked
    here under Anthropic's names; sampling fields it shares keep their names."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError("messages: required")
    if not isinstance(messages, list):
        raise ApiError(f"messages: expected a list of messages, got {shown(messages)}")
    chat: list[dict] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, msg in enumerate(messages):
        chat += _message(msg, f"messages[{i}]")
    if not chat:
        chat.append({"role": "user", "content": ""})  # llama-server answers an empty conversation too
    # Anthropic's own fields are translated; the rest (temperature, top_k, seed, cache_prompt,
    # llama-server's sampling fields) pass on as they are, refused there by name where not offered.
    out: dict = {k: v for k, v in body.items() if k not in OWN_FIELDS}
    out["messages"] = chat
    if body.get("stop_sequences") is not None:
        out["stop"] = list(Fields(body).stops("stop_sequences"))
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            out["tool_choice"], out["parallel_tool_calls"] = _tool_choice(body["tool_choice"])
    elif body.get("tool_choice") is not None and _tool_choice(body["tool_choice"])[0] not in ("auto", "none"):
        raise ApiError("tool_choice: asks for a tool call, but no tools are given")
    return out


def _usage(result) -> dict:
    """Anthropic's usage: input_tokens are the prompt's evaluated tokens, the rest were read
    from the context's cache."""
    return {
        "input_tokens": max(0, result.prompt_tokens - result.cached_tokens), "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": result.cached_tokens, "output_tokens": result.completion_tokens,
    }


def _stop(finish: str, stop_word: str, asked: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence: a stop sequence the request gave is named;
    the chat template's own end of turn is end_turn."""
    if finish == "stop" and stop_word and stop_word in asked:
        return "stop_sequence", stop_word
    return STOP_REASONS.get(finish, "end_turn"), None


def _tool_use(call: dict) -> dict:
    try:
        given = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        given = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": given if isinstance(given, dict) else {}}


def message(ident: str, model: str, text: str, end, asked: tuple[str, ...]) -> dict:
    """The whole reply: ``end`` is the chat reply's end event (ChatPath.chat_events)."""
    reason, sequence = _stop(end.finish, end.stop_word, asked)
    content = [{"type": "text", "text": text}] if text or not end.calls else []
    content += [_tool_use(call) for call in end.calls]
    return {
        "id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(end.result),
    }


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _event(name: str, payload: dict) -> dict:
    return {"event": name, "data": json.dumps({"type": name, **payload}, ensure_ascii=False, separators=(",", ":"))}


async def events(ident: str, model: str, n_prompt: int, replies: AsyncIterator, asked: tuple[str, ...]) -> AsyncIterator[dict]:
    """Anthropic's event stream for one reply: message_start, a text block's start, deltas and
    stop, one block per tool call, message_delta (stop reason, usage), message_stop."""
    head = {"id": ident, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None, "stop_sequence": None}
    started = False
    index, text_open = 0, False
    async for event in replies:
        if event.kind == "progress":
            continue
        if not started:  # once the prompt is evaluated: what of it the cache held is known then
            usage = {**_usage(event.result), "output_tokens": 0} if event.result is not None else {
                "input_tokens": n_prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
            yield _event("message_start", {"message": {**head, "usage": usage}})
            started = True
        if event.kind == "text":
            if not text_open:
                yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                text_open = True
            yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": event.text}})
        elif event.kind == "error":
            yield _event("error", {"error": {"type": "api_error", "message": event.text}})
            return
        elif event.kind == "end":
            if not text_open and not event.calls:  # a reply of no text still has its (empty) text block
                yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                text_open = True
            if text_open:
                yield _event("content_block_stop", {"index": index})
                index += 1
            for call in event.calls:
                block = _tool_use(call)
                given = json.dumps(block.pop("input"), ensure_ascii=False)
                yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": given}})
                yield _event("content_block_stop", {"index": index})
                index += 1
            reason, sequence = _stop(event.finish, event.stop_word, asked)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": _usage(event.result)})
            yield _event("message_stop", {})


@dataclass(eq=False)
class AnthropicRoutes:
    """POST /v1/messages and /v1/messages/count_tokens."""

    engine: ServingEngine
    chat: ChatPath
    model_id: str

    async def messages(self, request: Request) -> Response:
        require_ready(self.engine)
        fields = Fields(chat_request((await read_body(request)).body))
        call = await self.chat.prepare_chat(request, fields)
        asked = fields.stops()  # the request's own stop strings (the template's end of turn is not one)
        ident = new_id()
        if not fields.boolean("stream", False):
            whole = await self.chat.chat_whole(request, call)
            if whole is None:
                return Response(status_code=499)
            text, end = whole
            return JSONResponse(message(ident, self.model_id, text, end, asked), headers=request.state.headers)
        replies = await self.chat.chat_events(request, call)
        if replies is None:
            return Response(status_code=499)
        return event_stream(events(ident, self.model_id, len(call.tokens), replies, asked), request.state.headers)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt a Messages request would give the model, in tokens (tools included)."""
        require_ready(self.engine)
        fields = Fields(chat_request((await read_body(request)).body))
        return JSONResponse({"input_tokens": await self.chat.prompt_length(fields)})
