"""Request bodies: parse, type-check and range-check, with errors that name the field.

Every handler goes through here before it touches the engine, so a client mistake is a 400
that says which field is wrong, never a 500 or a crash inside llama.cpp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kimitui.engine.session import Sampling

# Sampling bounds. temperature matches the [sampling] config key; the others keep llama.cpp's
# samplers out of undefined territory (repeat_penalty divides logits, so it may not be 0).
TEMPERATURE = (0.0, 5.0)
PROBABILITY = (0.0, 1.0)
TOP_K = (0, 1 << 20)
REPEAT_PENALTY = (0.1, 10.0)
SEED = (-1, 0xFFFFFFFF)
MAX_STOPS = 16


class ApiError(Exception):
    """An error answered as JSON ``{"error": {"code", "type", "message"}}``."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


def _fmt(value: float) -> str:
    return f"{value:g}"


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_body(raw: bytes) -> dict:
    if not raw.strip():
        raise ApiError("request body: expected a JSON object, got an empty body")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError("request body: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ApiError(f"request body: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ApiError("request body: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(f"request body: expected a JSON object, got {type(data).__name__ if data is not None else 'null'}")
    return data


class Fields:
    """Typed reads from a JSON object. A missing key or null means "use the default"."""

    def __init__(self, body: dict) -> None:
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def number(self, name: str, default: float, low: float, high: float) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ApiError(f"{name}: expected a number between {_fmt(low)} and {_fmt(high)}, got {_shown(value)}")
        return float(value)

    def integer(self, name: str, default: int, low: int, high: int) -> int:
        value = self.body.get(name)
        if value is None:
            return default
        # 3.0 is an integer to JSON encoders in other languages; accept it, refuse 3.5.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ApiError(f"{name}: expected an integer between {low} and {high}, got {_shown(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ApiError(f"{name}: expected true or false, got {_shown(value)}")
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise ApiError(f"{name}: expected a string, got {_shown(value)}")
        return value

    def obj(self, name: str) -> dict:
        value = self.body.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ApiError(f"{name}: expected an object, got {_shown(value)}")
        return value

    def stops(self, name: str = "stop") -> tuple[str, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ApiError(f"{name}: expected a string or a list of strings, got {_shown(value)}")
        if len(items) > MAX_STOPS:
            raise ApiError(f"{name}: at most {MAX_STOPS} stop strings, got {len(items)}")
        # An empty stop string would end every reply before its first character; nobody means that.
        return tuple(s for s in items if s)

    def unsupported(self, name: str, allowed: Any) -> None:
        """Refuse a feature we do not implement rather than silently ignoring it."""
        value = self.body.get(name)
        if value is not None and value != allowed:
            raise ApiError(f"{name}: not supported by kimitui (only {json.dumps(allowed)})")


@dataclass
class Limits:
    max_n_predict: int
    default_n_predict: int
    defaults: Sampling  # the configured temperature/top_p/...; requests override field by field


def sampling_from(fields: Fields, limits: Limits, *, openai: bool) -> Sampling:
    """The shared sampling fields. llama-server's names everywhere; OpenAI's token limit names too."""
    d = limits.defaults
    cap = limits.max_n_predict
    if openai:
        name = "max_completion_tokens" if fields.has("max_completion_tokens") else "max_tokens"
        max_tokens = fields.integer(name, limits.default_n_predict, 1, cap)
        fields.unsupported("n", 1)
        fields.unsupported("logprobs", False)
        fields.unsupported("tools", [])
        fields.unsupported("tool_choice", "none")
        fields.unsupported("presence_penalty", 0)
        fields.unsupported("frequency_penalty", 0)
        fields.unsupported("logit_bias", {})
        fields.unsupported("response_format", {"type": "text"})
    else:
        # llama-server: -1 means "until the context is full"; here, until the configured cap.
        n_predict = fields.integer("n_predict", limits.default_n_predict, -1, cap)
        max_tokens = cap if n_predict == -1 else n_predict
    seed = fields.integer("seed", -1, *SEED)
    return Sampling(
        temperature=fields.number("temperature", d.temperature, *TEMPERATURE),
        top_p=fields.number("top_p", d.top_p, *PROBABILITY),
        top_k=fields.integer("top_k", d.top_k, *TOP_K),
        min_p=fields.number("min_p", d.min_p, *PROBABILITY),
        repeat_penalty=fields.number("repeat_penalty", d.repeat_penalty, *REPEAT_PENALTY),
        max_tokens=max_tokens,
        seed=None if seed == -1 else seed,
        stop=fields.stops(),
    )


def token_ids(value: Any, name: str, n_vocab: int) -> list[int]:
    """A list of token ids, each checked against the vocabulary (llama.cpp does not check)."""
    if not isinstance(value, list):
        raise ApiError(f"{name}: expected a list of token ids, got {_shown(value)}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise ApiError(f"{name}[{i}]: expected a token id between 0 and {n_vocab - 1}, got {_shown(t)}")
    return list(value)


def prompt_of(value: Any, name: str, n_vocab: int) -> str | list[int]:
    """One prompt: text, token ids, or a one-element list of either (as OpenAI clients send)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return prompt_of(value[0], f"{name}[0]", n_vocab)
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise ApiError(f"{name}: only one prompt per request is supported, got {len(value)}")
    if isinstance(value, list):
        return token_ids(value, name, n_vocab)
    if value is None:
        raise ApiError(f"{name}: required")
    raise ApiError(f"{name}: expected a string or a list of token ids, got {_shown(value)}")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(value: Any) -> list[dict]:
    """OpenAI messages reduced to what a chat template renders: role and plain text."""
    if value is None:
        raise ApiError("messages: required")
    if not isinstance(value, list) or not value:
        raise ApiError(f"messages: expected a non-empty list of messages, got {_shown(value)}")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError(f"{where}: expected an object with role and content, got {_shown(msg)}")
        role = msg.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role: expected one of {', '.join(ROLES)}, got {_shown(role)}")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise ApiError(f"{where}.content: expected a string or a list of text parts, got {_shown(content)}")
        out.append({"role": ROLES[role], "content": content})
    return out
