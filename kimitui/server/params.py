"""Request bodies: parse, type-check and range-check, with errors that name the field.

Every handler goes through here before it touches the engine, so a client mistake is a 400
that says which field is wrong, never a 500 or a crash inside llama.cpp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kimitui.config import key_spec
from kimitui.engine.generation import BANNED, Sampling

# Sampling bounds. Temperature, top_p and seed are the [sampling] config keys'; the
# others keep llama.cpp's samplers out of undefined territory (repeat_penalty divides logits,
# so it may not be 0).
TEMPERATURE = key_spec("sampling.temperature").bounds
TOP_P = key_spec("sampling.top_p").bounds
PROBABILITY = (0.0, 1.0)
TOP_K = (0, 1 << 20)
REPEAT_PENALTY = (0.1, 10.0)
SEED = key_spec("sampling.seed").bounds
MAX_STOPS = 16
PENALTY = (-2.0, 2.0)  # presence and frequency penalties, OpenAI's range
BIAS = (-100.0, 100.0)  # OpenAI's logit_bias range (llama-server: false bans a token)
N_PROBS = (0, 100)  # llama-server's n_probs; each is an entry per token in the reply
TOP_LOGPROBS = (0, 20)  # OpenAI's limit
MAX_N = 8  # choices per request; each is a whole reply, one after the other
MIROSTAT_TAU = (0.0, 100.0)
MIROSTAT_ETA = (0.0, 1.0)
N_KEEP = (-1, 1 << 24)
# llama-server's fields kimitui does not offer: (name, the values that mean "off", why). Each is
# a 400 naming it when a request turns it on, never silently ignored; the README lists them.
NOT_OFFERED = (
    ("lora", ([],), "kimitui loads no LoRA adapters"),
    ("dry_multiplier", (0, 0.0), "llama-cpp-python's sampler chain has no DRY sampler"),
    ("xtc_probability", (0, 0.0), "llama-cpp-python's sampler chain has no XTC sampler"),
    ("dynatemp_range", (0, 0.0), "llama-cpp-python's sampler chain has no dynamic temperature"),
    ("top_n_sigma", (-1, -1.0), "llama-cpp-python's sampler chain has no top-n-sigma sampler"),
    ("adaptive_target", (-1, -1.0), "llama-cpp-python's sampler chain has no adaptive-p sampler"),
    ("samplers", (), "llama-cpp-python builds its sampler chain in one fixed order"),
    ("repeat_last_n", (64,), "llama-cpp-python's penalties look back a fixed 64 tokens"),
    ("min_keep", (0, 1), "llama-cpp-python's samplers keep at least one candidate, fixed"),
    ("n_indent", (0,), "not offered"),
    ("t_max_predict_ms", (0,), "not offered: give n_predict"),
    ("n_cache_reuse", (0,), "kimitui reuses only a prompt's common prefix"),
)


class ApiError(Exception):
    """An error answered as JSON ``{"error": {"code", "type", "message"}}``."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", **extra) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.extra = extra  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx)


def _fmt(value: float) -> str:
    return f"{value:g}"


def shown(value: Any) -> str:
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
    except ValueError as exc:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        raise ApiError(f"request body: a number is too long ({exc})") from None
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
            raise ApiError(f"{name}: expected a number between {_fmt(low)} and {_fmt(high)}, got {shown(value)}")
        return float(value)

    def integer(self, name: str, default: int, low: int, high: int) -> int:
        value = self.body.get(name)
        if value is None:
            return default
        # 3.0 is an integer to JSON encoders in other languages; accept it, refuse 3.5.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ApiError(f"{name}: expected an integer between {low} and {high}, got {shown(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return self._typed(name, default, bool, "true or false")

    def string(self, name: str, default: str | None = None) -> str | None:
        return self._typed(name, default, str, "a string")

    def obj(self, name: str) -> dict:
        return self._typed(name, {}, dict, "an object")

    def _typed(self, name: str, default: Any, kind: type, expected: str) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, kind):
            raise ApiError(f"{name}: expected {expected}, got {shown(value)}")
        return value

    def stops(self, name: str = "stop") -> tuple[str, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ApiError(f"{name}: expected a string or a list of strings, got {shown(value)}")
        if len(items) > MAX_STOPS:
            raise ApiError(f"{name}: at most {MAX_STOPS} stop strings, got {len(items)}")
        # An empty stop string would end every reply before its first character; nobody means that.
        return tuple(s for s in items if s)

    def unsupported(self, name: str, *allowed: Any, why: str | None = None) -> None:
        """Refuse a feature we do not implement rather than silently ignoring it: any value but
        ``allowed`` (what means "off") is a 400 saying ``why`` (else which value is taken)."""
        value = self.body.get(name)
        if value is not None and value not in allowed:
            raise ApiError(f"{name}: not supported by kimitui ({why or 'only ' + json.dumps(allowed[0])})")


def logit_bias(value: Any, name: str, n_vocab: int, tokenize) -> dict[int, float]:
    """OpenAI's {"token id": bias}, llama-server's [[token id or text, bias or false], ...] or
    {"text": bias} (text: each of its tokens; false: never sampled)."""
    if value is None:
        return {}
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list):
        raise ApiError(f"{name}: expected an object of token id -> bias, or a list of [token, bias] pairs, got {shown(value)}")
    bias: dict[int, float] = {}
    for i, pair in enumerate(pairs):
        where = f"{name}[{i}]" if not isinstance(value, dict) else f"{name}.{pair[0]}"
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ApiError(f"{where}: expected [token, bias], got {shown(pair)}")
        key, amount = pair
        if amount is False:
            amount = BANNED
        elif isinstance(amount, bool) or not isinstance(amount, (int, float)) or not BIAS[0] <= amount <= BIAS[1]:
            raise ApiError(f"{where}: expected a bias between -100 and 100 or false, got {shown(amount)}")
        if isinstance(value, dict) and key.isascii() and key.lstrip("-").isdecimal():
            if len(key) > 12:  # no vocabulary is that large (and int() refuses past 4,300 digits)
                raise ApiError(f"{name}: token id {key[:20]}... is outside the vocabulary (0 to {n_vocab - 1})")
            key = int(key)  # OpenAI's "token id" keys; other keys are text, as llama-server takes them
        if isinstance(key, str):
            ids = tokenize(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        else:
            raise ApiError(f"{where}: expected a token id or text, got {shown(key)}")
        for t in ids:
            if not 0 <= t < n_vocab:
                raise ApiError(f"{where}: token id {t} is outside the vocabulary (0 to {n_vocab - 1})")
            bias[t] = float(amount)
    return bias


def grammar_of(fields: Fields) -> tuple[str | None, str | None]:
    """(GBNF, the field it came from) for the reply's shape: llama-server's grammar or
    json_schema, or OpenAI's response_format (json_object, json_schema); llama-cpp-python turns
    schemas into grammars. The caller checks that llama.cpp parses the grammar."""
    from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

    given = [n for n in ("grammar", "json_schema", "response_format") if fields.has(n)]
    if len(given) > 1:
        raise ApiError(f"{given[1]}: give one of grammar, json_schema and response_format, not both {given[0]} and {given[1]}")
    if not given:
        return None, None
    name = given[0]
    if name == "grammar":
        text = fields.string("grammar")
        return (text or None), name
    if name == "json_schema":
        schema = fields.obj("json_schema")
    else:
        fmt = fields.obj("response_format")
        kind = fmt.get("type")
        if kind == "text":
            return None, None
        if kind == "json_object":
            schema = fmt.get("schema")  # llama-server's extension; OpenAI's has none
            if schema is None:
                return JSON_GBNF, name
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict):
                raise ApiError("response_format.json_schema: expected an object with a schema")
            schema = inner.get("schema", inner)
            name = "response_format.json_schema.schema"
        else:
            raise ApiError(f"response_format.type: expected text, json_object or json_schema, got {shown(kind)}")
    if not isinstance(schema, dict):
        raise ApiError(f"{name}: expected a JSON schema object, got {shown(schema)}")
    try:
        return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)._grammar, name
    except Exception as exc:  # noqa: BLE001 - the converter raises what it meets
        raise ApiError(f"{name}: cannot be turned into a grammar ({type(exc).__name__}: {exc})") from None


@dataclass
class Limits:
    max_n_predict: int
    default_n_predict: int
    defaults: Sampling  # the configured temperature/top_p/...; requests override field by field
    # What one request may make the server keep: every token of every reply, each with its
    # alternatives (server.max_request_entries).
    max_entries: int = 262_144


def check_request_size(limits: Limits, replies: int, sampling: Sampling) -> None:
    """Refused at parse time, before any token: replies x max tokens x (1 + alternatives)
    above the server's limit. Each entry is kept until the reply's JSON is sent."""
    per_token = 1 + sampling.n_probs
    entries = replies * sampling.max_tokens * per_token
    if entries > limits.max_entries:
        raise ApiError(
            f"max_tokens: {replies} replies x {sampling.max_tokens} tokens x {per_token} (the token and its alternatives) "
            f"= {entries:,} entries, above this server's limit of {limits.max_entries:,} (server.max_request_entries); "
            "ask for fewer tokens, choices, prompts or alternatives"
        )


def _token_limit(fields: Fields, name: str, default: int, low: int, cap: int) -> int:
    """A token limit above the server's cap is clamped to it, as llama-server clamps to its
    context; below ``low`` or not an integer it is the client's mistake."""
    value = fields.body.get(name)
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())  # no float(): an int may be past its range
    if whole and not isinstance(value, bool) and value > cap:
        return cap
    return fields.integer(name, default, low, cap)


def sampling_from(fields: Fields, limits: Limits, *, openai: bool, n_vocab: int, tokenize) -> Sampling:
    """The shared sampling fields. llama-server's names everywhere; OpenAI's token limit names too."""
    d = limits.defaults
    cap = limits.max_n_predict
    if openai:
        name = "max_completion_tokens" if fields.has("max_completion_tokens") else "max_tokens"
        max_tokens = _token_limit(fields, name, limits.default_n_predict, 1, cap)
    else:
        # llama-server: -1 means "until the context is full"; here, until the configured cap.
        n_predict = _token_limit(fields, "n_predict", limits.default_n_predict, -1, cap)
        max_tokens = cap if n_predict == -1 else n_predict
    seed = fields.integer("seed", -1 if d.seed is None else d.seed, *SEED)
    grammar, _ = grammar_of(fields)
    return Sampling(
        temperature=fields.number("temperature", d.temperature, *TEMPERATURE),
        top_p=fields.number("top_p", d.top_p, *TOP_P),
        top_k=fields.integer("top_k", d.top_k, *TOP_K),
        min_p=fields.number("min_p", d.min_p, *PROBABILITY),
        repeat_penalty=fields.number("repeat_penalty", d.repeat_penalty, *REPEAT_PENALTY),
        max_tokens=max_tokens,
        seed=None if seed == -1 else seed,
        stop=fields.stops(),
        presence_penalty=fields.number("presence_penalty", 0.0, *PENALTY),
        frequency_penalty=fields.number("frequency_penalty", 0.0, *PENALTY),
        logit_bias=logit_bias(fields.body.get("logit_bias"), "logit_bias", n_vocab, tokenize),
        grammar=grammar,
        n_probs=_n_probs(fields, openai),
        post_sampling=fields.boolean("post_sampling_probs", False),
        cache_prompt=fields.boolean("cache_prompt", True),
        typical_p=fields.number("typical_p", 1.0, *PROBABILITY),
        mirostat=fields.integer("mirostat", 0, 0, 2),
        mirostat_tau=fields.number("mirostat_tau", 5.0, *MIROSTAT_TAU),
        mirostat_eta=fields.number("mirostat_eta", 0.1, *MIROSTAT_ETA),
        ignore_eos=fields.boolean("ignore_eos", False),
        n_keep=fields.integer("n_keep", 0, *N_KEEP),
        n_discard=fields.integer("n_discard", 0, 0, N_KEEP[1]),
    )


def refuse_not_offered(fields: Fields) -> None:
    """What is deliberately not offered (NOT_OFFERED): a 400 naming the field when turned on."""
    for name, off, why in NOT_OFFERED:
        fields.unsupported(name, *off, why=why)


def _n_probs(fields: Fields, openai: bool) -> int:
    """Log-probabilities asked for: llama-server's n_probs; OpenAI chat's logprobs (a flag) with
    top_logprobs; OpenAI completions' logprobs (a count)."""
    if not openai:
        return fields.integer("n_probs", 0, *N_PROBS)
    value = fields.body.get("logprobs")
    if isinstance(value, bool) or value is None:
        top = fields.integer("top_logprobs", 0, *TOP_LOGPROBS)
        if top and not value:
            raise ApiError("top_logprobs: needs logprobs: true")
        return max(top, 1) if value else 0
    return fields.integer("logprobs", 0, 0, 5)  # the completions API: how many alternatives


def choices_of(fields: Fields) -> int:
    return fields.integer("n", 1, 1, MAX_N)


def token_ids(value: Any, name: str, n_vocab: int) -> list[int]:
    """A list of token ids, each checked against the vocabulary (llama.cpp does not check)."""
    if not isinstance(value, list):
        raise ApiError(f"{name}: expected a list of token ids, got {shown(value)}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise ApiError(f"{name}[{i}]: expected a token id between 0 and {n_vocab - 1}, got {shown(t)}")
    return list(value)


MAX_PROMPTS = 16  # prompts per request, answered one after the other


def prompts_of(value: Any, name: str, n_vocab: int) -> list[str | list[int]]:
    """The request's prompts: text, token ids, {"prompt_string": text} (llama-server), a mix of
    text and ids in one list (llama-server joins them), or a list of any of these, one reply each."""
    if value is None:
        raise ApiError(f"{name}: required")
    if isinstance(value, list) and value and all(isinstance(v, (str, list, dict)) for v in value):
        if len(value) > MAX_PROMPTS:
            raise ApiError(f"{name}: at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        return [_one_prompt(v, f"{name}[{i}]", n_vocab) for i, v in enumerate(value)]
    return [_one_prompt(value, name, n_vocab)]


def _one_prompt(value: Any, name: str, n_vocab: int) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        text = value.get("prompt_string")
        if not isinstance(text, str):
            raise ApiError(f"{name}: expected {{\"prompt_string\": text}}, got {shown(value)}")
        if value.get("multimodal_data"):
            raise ApiError(f"{name}.multimodal_data: kimitui serves text models only")
        return text
    if isinstance(value, list) and any(isinstance(v, str) for v in value):
        if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
            raise ApiError(f"{name}: expected text and token ids, got {shown(value)}")
        return value  # mixed: the caller tokenizes the text parts
    if isinstance(value, list):
        return token_ids(value, name, n_vocab)
    raise ApiError(f"{name}: expected a string or a list of token ids, got {shown(value)}")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(value: Any) -> list[dict]:
    """OpenAI messages reduced to what a chat template renders: role and plain text."""
    if value is None:
        raise ApiError("messages: required")
    if not isinstance(value, list) or not value:
        raise ApiError(f"messages: expected a non-empty list of messages, got {shown(value)}")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError(f"{where}: expected an object with role and content, got {shown(msg)}")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(f"{where}.role: expected one of {', '.join(ROLES)}, got {shown(role)}")
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
                parts.append(part["text"])
            # llama.cpp's joins: a newline between parts, two in a final assistant message
            # (the text a reply continues).
            content = ("\n\n" if role == "assistant" and i == len(value) - 1 else "\n").join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise ApiError(f"{where}.content: expected a string or a list of text parts, got {shown(content)}")
        message = {"role": ROLES[role], "content": content}
        # What a template renders of tool use: the calls an assistant turn made, and which call a
        # tool's answer belongs to.
        if role == "assistant" and msg.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ApiError(f"{where}.tool_call_id: required for a tool's answer, a string")
            message["tool_call_id"] = call_id
        if isinstance(msg.get("name"), str):
            message["name"] = msg["name"]
        # An earlier reply's reasoning, for the templates that render it (Qwen3's, Kimi's think part).
        if role == "assistant" and isinstance(msg.get("reasoning_content"), str):
            message["reasoning_content"] = msg["reasoning_content"]
        out.append(message)
    return out


def _tool_calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise ApiError(f"{where}: expected a list of tool calls")
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments", ""), str):
            raise ApiError(f'{where}[{i}]: expected {{"id": ..., "type": "function", "function": {{"name": ..., "arguments": "JSON text"}}}}')
    return value


def check_prefill(fields: "Fields", messages: list[dict]) -> None:
    """The turn flags of a chat request, against its messages. A final assistant message is
    continued (see Engine.render_chat); ``continue_final_message`` asks for that explicitly,
    and ``add_generation_prompt`` false is taken only with it (the reply always fills a turn)."""
    add = fields.boolean("add_generation_prompt", True)
    cont = fields.boolean("continue_final_message", False)
    if add and not cont and len(messages) >= 2 and messages[-1]["role"] == messages[-2]["role"] == "assistant":
        raise ApiError("messages: two assistant messages at the end; only the last one can be continued")
    if add and cont:
        raise ApiError("add_generation_prompt, continue_final_message: at most one may be true (give add_generation_prompt false)")
    if cont and messages[-1]["role"] != "assistant":
        raise ApiError("continue_final_message: the last message must be the assistant's, to continue it")
    if not add and not cont:
        raise ApiError("add_generation_prompt: false is taken only with continue_final_message true (a reply always fills a turn)")


FILENAME_REFUSED = set(':*?"<>|/\\')


def slot_filename(value: Any) -> str:
    """A saved slot's file name, as llama-server checks it: a plain name inside the slot
    directory (no path, no '..', no control or reserved characters, no leading or trailing
    space, no trailing dot)."""
    if not isinstance(value, str) or not value:
        raise ApiError(f"filename: required, a file name, got {shown(value)}")
    bad = next((c for c in value if c in FILENAME_REFUSED or ord(c) < 32 or 127 <= ord(c) < 160 or c in "\ufeff\ufffd\u2215\u2216\uff0e"
                or 0xD800 <= ord(c) < 0xE000), None)
    why = (
        f"the character {bad!r} is refused" if bad is not None
        else "longer than 255 bytes" if len(value.encode("utf-8")) > 255
        else "'..' is refused" if ".." in value or value == "."
        else "a leading or trailing space is refused" if value != value.strip(" ")
        else "a trailing dot is refused" if value.endswith(".")
        else None
    )
    if why is not None:
        raise ApiError(f"filename: {shown(value)} is not a plain file name ({why})")
    return value
