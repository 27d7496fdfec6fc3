"""The HTTP API: llama-server and OpenAI compatible routes over one shared Engine.

Generations run on their own threads (the engine blocks); the event loop only moves tokens.
The engine's TurnQueue serves requests first come first served, API and TUI alike, so the
app never decodes two replies at once and never needs a lock of its own. A client that goes
away cancels its generation, which frees the engine before the next token.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import threading
import time
import uuid
import weakref
from pathlib import Path
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kimitui import __version__
from kimitui.config import Settings
from kimitui.engine.metrics import Sampler
from kimitui.engine.generation import BANNED, Generation, GenerationResult, PromptProgress, Sampling, TokenEvent
from kimitui.engine.session import Engine
from kimitui.engine.saved_states import StateRefused
from kimitui.engine.state import ChatTemplateError, EngineError, EngineState
from kimitui.server import anthropic, prom, responses
from kimitui.server import tools as tool_calls
from kimitui.server.runner import is_loopback
from kimitui.server.params import (
    ApiError, Fields, Limits, chat_messages, check_prefill, check_request_size, choices_of, grammar_of, parse_body, prompts_of,
    refuse_not_offered, sampling_from, shown, slot_filename, token_ids,
)

log = logging.getLogger("kimitui.server")

# Reachable without a key, as in llama-server: load balancers probe /health, and clients list
# the models before they know which key goes where.
OPEN_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models"})
FINGERPRINT = f"b{__version__}-kimitui"  # OpenAI's system_fingerprint; llama-server's start with "b"
QUEUE_HEADER = "X-Queue-Position"
PIECES_PER_ENCODE = 4096  # /tokenize with_pieces: entries JSON-encoded at a time (see Api.tokenize)


TOO_LARGE = "request body too large"
WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def _host_name(header: str) -> str:
    """The name or address in a Host header, without its port."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    name, colon, port = header.rpartition(":")
    return (name if colon and port.isdigit() else header).rstrip(".")


def host_allowed(header: str, bind_host: str, allowed: frozenset[str]) -> bool:
    """Whether a request's Host header names this server: its own address (``bind_host``, or
    any of several comma-separated), an address of any interface when it listens on all of
    them, localhost when it listens on loopback, or one of ``allowed`` (server.allowed_hosts).
    Anything else is a page that rebound its own name here."""
    name = _host_name(header)
    if not name or "*" in allowed or name in allowed:
        return True
    binds = [b.strip().strip("[]").lower() for b in bind_host.split(",")]
    return any(_names_bind(name, bind) for bind in [b for b in binds if b] or [""])


def _names_bind(name: str, bind: str) -> bool:
    """Whether ``name`` (a Host header's, not in server.allowed_hosts) is the address ``bind``."""
    try:
        bind_ip = ipaddress.ip_address(bind)
    except ValueError:
        bind_ip = None
    loopback = is_loopback(bind)
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:  # a name: only those the server was given
        return name == bind or (name == "localhost" and (loopback or bind in WILDCARDS))
    return bind in WILDCARDS or ip == bind_ip or (loopback and ip.is_loopback)


def _content_length(scope) -> int:
    try:
        return int(Headers(scope=scope).get("content-length", "0"))
    except ValueError:
        return 0


def error_response(status: int, kind: str, message: str, headers: dict | None = None, path: str = "", **extra) -> JSONResponse:
    """An error as JSON: llama-server's (OpenAI's) shape, or Anthropic's on its routes."""
    if anthropic.is_anthropic(path):
        return JSONResponse(anthropic.error_body(status, message), status, headers=headers)
    return JSONResponse({"error": {"code": status, "type": kind, "message": message, **extra}}, status, headers=headers)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _Done:
    pass


async def run_generation(generation: Generation) -> AsyncIterator[TokenEvent]:
    """Iterate ``generation`` on a thread of its own and yield its events on the event loop.

    Leaving early for any reason (client gone, server stopping) cancels the generation, which
    gives up its turn while queued or stops within one token while decoding.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody will read the rest
            generation.cancel()

    def work() -> None:
        try:
            for event in generation:
                put(event)
            put(_Done)
        except Exception as exc:  # EngineError, or a bug: re-raised on the event loop
            put(exc)

    threading.Thread(target=work, name="kimitui-api-generation", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is _Done:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        generation.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def timings(r: GenerationResult) -> dict:
    """llama-server's timings block (prompt_n counts the prompt tokens evaluated, cache_n those
    reused from the last reply's context). A rate over zero time is null, not a made-up number."""

    def per_token(s: float, n: int) -> float | None:
        return s * 1000 / n if n else None

    def per_second(n: int, s: float) -> float | None:
        return n / s if s > 0 else None

    evaluated = r.prompt_tokens - r.cached_tokens
    return {
        "cache_n": r.cached_tokens,
        "prompt_n": evaluated,
        "prompt_ms": r.prompt_s * 1000,
        "prompt_per_token_ms": per_token(r.prompt_s, evaluated),
        "prompt_per_second": per_second(evaluated, r.prompt_s),
        "predicted_n": r.completion_tokens,
        "predicted_ms": r.decode_s * 1000,
        "predicted_per_token_ms": per_token(r.decode_s, r.completion_tokens),
        "predicted_per_second": per_second(r.completion_tokens, r.decode_s),
    }


def usage(results: list[GenerationResult], choices_per_prompt: int = 1) -> dict:
    """OpenAI's usage: each prompt counted once, however many choices it was given."""
    prompt = sum(r.prompt_tokens for r in results[::choices_per_prompt])
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }


def _piece(engine: Engine, token: int) -> tuple[str, list[int]]:
    raw = engine.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def native_probs(engine: Engine, events: list[TokenEvent], post_sampling: bool = False) -> list[dict]:
    """llama-server's completion_probabilities: each token, its log-probability and the top n;
    with post_sampling_probs, as llama-server gives them then: probabilities, under "prob"."""
    value, name, top_name = (math.exp, "prob", "top_probs") if post_sampling else (float, "logprob", "top_logprobs")
    out = []
    for e in events:
        if e.token_id < 0 or e.logprob is None:
            continue
        text, raw = _piece(engine, e.token_id)
        top = []
        for tid, lp in e.top:
            t_text, t_raw = _piece(engine, tid)
            top.append({"id": tid, "token": t_text, "bytes": t_raw, name: value(lp)})
        out.append({"id": e.token_id, "token": text, "bytes": raw, name: value(e.logprob), top_name: top})
    return out


def chat_logprobs(engine: Engine, events: list[TokenEvent], n_top: int) -> dict:
    content = []
    for entry in native_probs(engine, events):
        top = [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in entry["top_logprobs"][:n_top]]
        content.append({"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"], "top_logprobs": top})
    return {"content": content, "refusal": None}


def text_logprobs(engine: Engine, events: list[TokenEvent], n_top: int) -> dict:
    """OpenAI completions' logprobs: parallel lists, the alternatives as {token: logprob}."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for entry in native_probs(engine, events):
        offsets.append(offset)
        offset += len(entry["token"])
        tokens.append(entry["token"])
        lps.append(entry["logprob"])
        tops.append({t["token"]: t["logprob"] for t in entry["top_logprobs"][:n_top]})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def only_fields(body: dict, paths: list[str]) -> dict:
    """llama-server's response_fields: just these keys, a "/" path reaching into objects
    (named by the whole path, as llama-server names them)."""
    out = {}
    for path in paths:
        node: Any = body
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def openai_finish(r: GenerationResult) -> str:
    return "length" if r.finish_reason == "length" else "stop"


def _engine_error(generation: Generation, exc: EngineError) -> ApiError:
    # A failure before the prompt was accepted is about the request; later ones are ours.
    if generation.result.prompt_tokens == 0:
        return ApiError(str(exc))
    return ApiError(str(exc), 500, "server_error")


def _canonical(name: bytes) -> bytes:
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def origin_allowed(origin: str, cors_origins: frozenset[str]) -> bool:
    """An origin listed exactly, "*", or, for the entry "localhost" (llama-server's word), a
    page served from this machine's loopback names on any port."""
    import re

    if origin in cors_origins or "*" in cors_origins:
        return True
    return "localhost" in cors_origins and re.fullmatch(LOOPBACK_ORIGINS, origin) is not None


class _Origin:
    """Outermost: the report to ``on_request``, and what a browser could abuse. A foreign Host
    header (DNS rebinding) and a request from a web origin not in server.cors_origins get 403
    before anything else runs; a preflight from such an origin gets 200 without any grant (as
    llama-server answers: the browser then refuses the request); preflights from allowed origins
    are answered by Starlette's CORSMiddleware, inside this."""

    def __init__(
        self, app, bind_host: str, allowed_hosts: frozenset[str], cors_origins: frozenset[str],
        on_request: Callable[[dict], None] | None,
    ) -> None:
        self.app = app
        self.bind_host = bind_host
        self.allowed_hosts = allowed_hosts
        self.cors_origins = cors_origins
        self.on_request = on_request

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app fails before answering, ServerErrorMiddleware sends a 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # Header names as llama-server writes them ("Access-Control-Allow-Origin"): HTTP
                # says case does not matter, but some clients look them up case by case.
                message = {**message, "headers": [(_canonical(k), v) for k, v in message.get("headers", [])]}
            await send(message)

        try:
            await self._checked(scope, receive, send_status)
        finally:
            if self.on_request is not None:
                self._report(scope, status, time.perf_counter() - started)

    async def _checked(self, scope, receive, send) -> None:
        headers = Headers(scope=scope)
        host, origin = headers.get("host", ""), headers.get("origin")
        if not host_allowed(host, self.bind_host, self.allowed_hosts):
            response = error_response(
                403, "invalid_request_error",
                f"Host {_host_name(host)!r} is not this server's name: add it to server.allowed_hosts to allow it", path=scope["path"],
            )
        elif origin is not None and not origin_allowed(origin, self.cors_origins):
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                response = Response(status_code=200)  # no grant: the browser refuses the request
            else:
                response = error_response(
                    403, "invalid_request_error",
                    f"cross-origin requests from {origin} are refused: add it to server.cors_origins to allow it", path=scope["path"],
                )
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)

    def _report(self, scope, status: int, duration_s: float) -> None:
        state = scope.get("state") or {}
        client = scope.get("client")
        record = {
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "client": f"{client[0]}:{client[1]}" if client else None,
            "prompt_tokens": state.get("prompt_tokens"),
            "tokens": state.get("tokens"),
            "queue_position": state.get("queue_position"),
            "duration_s": duration_s,
        }
        try:
            self.on_request(record)
        except Exception:  # a display callback must never break the API
            log.exception("on_request callback failed")


class _Guard:
    """Inner app middleware: the API key, JSON bodies only, the body size limit.

    The limit is here rather than Starlette's ``max_body_size``, which answers in plain text;
    clients of this API expect JSON errors. Only application/json bodies are read: a web page
    can send text/plain across origins without a preflight, never JSON.
    """

    def __init__(self, app, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    @staticmethod
    def _json_body(scope) -> bool:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return True
        headers = Headers(scope=scope)
        if "content-type" not in headers and headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers:
            return True  # no body at all (llama-server's POST /slots/{id}?action=erase)
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        return media == "application/json"

    def _limited(self, receive):
        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:  # a chunked upload, counted as it arrives
                    raise ApiError(TOO_LARGE, 413)
            return message

        return receive_limited

    def _authorized(self, scope) -> bool:
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return hmac.compare_digest(token.strip().encode(), self.api_key)
        # Anthropic's header, which llama-server also takes.
        return hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), self.api_key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            response = error_response(
                401, "authentication_error", "missing or wrong API key (send Authorization: Bearer KEY, or X-Api-Key: KEY)",
                headers={"WWW-Authenticate": "Bearer"}, path=scope["path"],
            )
            await response(scope, receive, send)
        elif not self._json_body(scope):
            given = Headers(scope=scope).get("content-type") or "none"
            await error_response(415, "invalid_request_error", f"Content-Type must be application/json (got {given})", path=scope["path"])(
                scope, receive, send,
            )
        elif _content_length(scope) > self.max_body:  # refused before the upload is read
            await error_response(413, "invalid_request_error", TOO_LARGE, path=scope["path"])(scope, receive, send)
        else:
            await self.app(scope, self._limited(receive), send)


@dataclass
class ChatCall:
    """A chat request ready to decode (Api.prepare_chat)."""

    tokens: list[int]
    sampling: Sampling
    calling: str | None  # the template's tool-call format, when the reply may call tools
    n: int  # choices


@dataclass
class ChatEvent:
    """What Api.chat_events yields: "progress", "text" (a delta), "end" or "error"."""

    kind: str
    text: str = ""
    progress: PromptProgress | None = None
    result: GenerationResult | None = None
    calls: list[dict] = field(default_factory=list)  # at the end: the tool calls, OpenAI's shape
    finish: str = ""  # at the end: OpenAI's finish_reason
    stop_word: str = ""  # at the end: the stop string that ended it, if one did


class Api:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        cap = settings["server.max_n_predict"]
        self.limits = Limits(
            max_n_predict=cap,
            max_entries=settings["server.max_request_entries"],
            default_n_predict=min(settings["sampling.max_tokens"], cap),
            defaults=Sampling(
                temperature=settings["sampling.temperature"], top_p=settings["sampling.top_p"],
                seed=None if settings["sampling.seed"] == -1 else settings["sampling.seed"],
            ),
        )
        # Its own sampler: scraping must not disturb the rates and history the TUI's sampler keeps.
        self.sampler = Sampler(engine.metrics, model_path=engine.model_path)
        self.aliases = sorted({a.strip() for a in settings["server.alias"].split(",") if a.strip()})
        self.tags = list(settings["server.tags"])
        # The first alias in alphabetical order, as llama-server names a model with several.
        self.model_id = self.aliases[0] if self.aliases else engine.model_path.name
        self.verbose = settings["server.verbose"]
        self.slots_endpoint = settings["server.slots_endpoint"]
        self.slot_save_path = settings["server.slot_save_path"]
        self.created = int(time.time())
        # Replies this API started that have not taken their turn yet (their thread is starting):
        # a burst of requests reaching an idle engine must not all be told "position 0". Weak,
        # so a reply whose stream never began leaves no count behind.
        self._arriving: weakref.WeakSet[Generation] = weakref.WeakSet()
        self.kept_responses = responses.Responses()  # for previous_response_id

    # -- helpers -------------------------------------------------------------------------

    def require_ready(self) -> None:
        """The engine's lifecycle decides (a failure it can mend lets the request through)."""
        refused = self.engine.lifecycle.refusal()
        if refused is not None:
            raise ApiError(self.failure() if self.engine.state is EngineState.FAILED else refused, 503, "unavailable_error")

    def failure(self) -> str:
        if self.engine.load_error:
            return f"the model failed to load: {self.engine.load_error}"
        return self.engine.lifecycle.reason or "the engine failed"

    def queue(self) -> tuple[int, int]:
        """(processing, deferred): the turn holder and those waiting behind it."""
        waiting = self.engine.turns.waiting
        processing = min(1, waiting)
        return processing, waiting - processing

    @property
    def n_vocab(self) -> int:
        return self.engine.llm.n_vocab()

    async def body(self, request: Request) -> Fields:
        raw = await request.body()
        # A large body (server.max_body allows megabytes) takes tens of milliseconds to parse: off the event loop.
        return Fields(parse_body(raw) if len(raw) < 65536 else await run_in_threadpool(parse_body, raw))

    def _too_long(self, name: str, n_prompt: int) -> ApiError:
        return ApiError(
            f"{name}: the prompt is {n_prompt} tokens; {self.engine.context_words}", 400,
            "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=self.engine.slot_ctx,
        )

    async def prompt_tokens(self, prompt: str | list, name: str) -> list[int]:
        if isinstance(prompt, str):
            tokens = await run_in_threadpool(self.engine.tokenize, prompt)
        elif any(isinstance(p, str) for p in prompt):  # llama-server's mixed prompt: text parts tokenized in place
            tokens = []
            for part in prompt:
                tokens += await run_in_threadpool(self.engine.tokenize, part, add_special=not tokens) if isinstance(part, str) else [part]
            tokens = token_ids(tokens, name, self.n_vocab)
        else:
            tokens = prompt
        if not tokens:
            raise ApiError(f"{name}: the prompt is empty")
        if len(tokens) >= self.engine.slot_ctx:
            raise self._too_long(name, len(tokens))
        return tokens

    async def chat_tokens(self, messages: list[dict], max_tokens: int, tools: list[dict] | None = None) -> tuple[list[int], tuple[str, ...]]:
        try:
            tokens, stops = await run_in_threadpool(self.engine.chat_prompt, messages, tools)
        except ChatTemplateError as exc:
            raise ApiError(f"messages: {exc}") from None
        # Engine.chat would drop old turns to make room; an API client gets told instead.
        if self.engine.slot_ctx - len(tokens) < min(max_tokens, 16):
            raise self._too_long("messages", len(tokens))
        return tokens, stops

    async def sampling(self, fields: Fields, *, openai: bool) -> Sampling:
        """The request's sampling, its grammar (if any) checked by llama.cpp's own parser.
        Off the event loop: a logit bias keyed by text is tokenized, a schema becomes a grammar."""
        sampling = await run_in_threadpool(
            sampling_from, fields, self.limits, openai=openai, n_vocab=self.n_vocab,
            tokenize=lambda text: self.engine.tokenize(text, add_special=False),
        )
        if sampling.grammar is not None:
            error = await run_in_threadpool(self.engine.grammar_error, sampling.grammar)
            if error is not None:
                raise ApiError(f"{grammar_of(fields)[1]}: llama.cpp refused the grammar: {error}")
        return sampling

    def read_slot_and_progress(self, request: Request, fields: Fields) -> None:
        """The request's ``id_slot`` (-1: the slot whose cached prompt fits best) and
        ``return_progress``, for start()."""
        asked = fields.integer("id_slot", -1, -1, self.engine.slots.count - 1)
        request.state.slot = None if asked == -1 else asked
        request.state.progress = fields.boolean("return_progress", False)
        if request.state.progress and not fields.boolean("stream", False):
            raise ApiError("return_progress: prompt progress is sent on a streamed reply only (give stream: true)")

    def start(self, request: Request, tokens: list[int], sampling: Sampling) -> tuple[Generation, dict]:
        state = request.state
        generation = self.engine.complete(tokens, sampling, getattr(state, "slot", None), getattr(state, "progress", False))
        # Ahead of this request when it arrives (0 = starts now): replies in line or computing,
        # and replies of this API that arrived just before and are still taking their turn.
        ahead = sum(1 for g in list(self._arriving) if g.ticket is None and not g.cancelled)
        position = self.engine.turns.waiting + ahead
        self._arriving.add(generation)
        request.state.queue_position = position
        return generation, {QUEUE_HEADER: str(position)}

    async def collect(self, request: Request, generation: Generation) -> list[TokenEvent] | None:
        """Every event of a non-streamed reply, or None when the client left first (then cancelled)."""

        async def drain() -> list[TokenEvent]:
            return [event async for event in run_generation(generation)]

        collector = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler itself is cancelled (server stopping)
            watcher.cancel()
            if not collector.done():
                generation.cancel()
                collector.cancel()
        try:
            return collector.result() if collector.done() else None
        except EngineError as exc:
            raise _engine_error(generation, exc) from None
        finally:
            self.account(request, generation.result)

    async def decode_each(self, request: Request, asked: list[list[int]], sampling_for) -> tuple[list[tuple[Generation, list[TokenEvent]]], dict] | None:
        """Each reply of a non-streamed request, one after the other: (generation, events) for
        each entry of ``asked`` (prompt tokens) and the last one's headers; None when the client
        left first."""
        replies, headers = [], {}
        for index, tokens in enumerate(asked):
            generation, headers = self.start(request, tokens, sampling_for(index))
            events = await self.collect(request, generation)
            if events is None:
                return None
            replies.append((generation, events))
        return replies, headers

    @staticmethod
    def account(request: Request, result: GenerationResult) -> None:
        request.state.prompt_tokens = result.prompt_tokens
        request.state.tokens = result.completion_tokens

    def stop_type(self, result: GenerationResult, stops: tuple[str, ...], ids: list[int]) -> tuple[str, str]:
        """llama-server's stop_type and stopping_word. The engine cuts a stop string out of the
        text, so the raw tokens tell a stop word from an end-of-generation token."""
        if result.finish_reason == "length":
            return "limit", ""
        if result.finish_reason != "stop":
            return "none", ""
        raw = self.engine.detokenize(ids) if stops else ""
        found = [(raw.find(s), s) for s in stops if s in raw]
        return ("word", min(found)[1]) if found else ("eos", "")

    # -- llama-server routes ---------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        state = self.engine.state
        if self.engine.lifecycle.refusal() is None:
            return JSONResponse({"status": "ok"})
        status = "error" if state is EngineState.FAILED else "loading model"
        message = self.failure() if state is EngineState.FAILED else "Loading model"
        return JSONResponse(
            {
                "status": status,
                "progress": self.engine.load_progress,
                "error": {"code": 503, "type": "unavailable_error", "message": message},
            },
            503,
        )

    def native_result(
        self, index: int, prompt: list[int], generation: Generation, events: list[TokenEvent], content: str, *, return_tokens: bool = True,
    ) -> dict:
        """llama-server's own result object: /completion's reply, and the ``__verbose`` of an
        OpenAI reply. Its prompt is the prompt's tokens as text, special tokens included."""
        r, sampling = generation.result, generation.sampling
        ids = [e.token_id for e in events if e.token_id >= 0]
        stop_type, word = self.stop_type(r, sampling.stop, ids)
        return {
            "index": index,
            "content": content,
            "tokens": ids if return_tokens else [],
            "id_slot": r.slot,
            "stop": True,
            "model": self.model_id,
            "tokens_predicted": r.completion_tokens,
            "tokens_evaluated": r.prompt_tokens,
            "tokens_cached": r.cached_tokens,
            "generation_settings": self.generation_settings(sampling),
            "prompt": self.engine.detokenize(prompt, special=True),
            "has_new_line": "\n" in r.text,
            # llama-server's meaning: the reply was cut because the context filled (a prompt
            # that does not fit is refused, never cut).
            "truncated": r.context_full,
            "stop_type": stop_type,
            "stopping_word": word,
            "timings": timings(r),
        }

    def generation_settings(self, s: Sampling) -> dict:
        return {
            "n_predict": s.max_tokens,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "typical_p": s.typical_p,
            "repeat_last_n": 64,
            "repeat_penalty": s.repeat_penalty,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "mirostat": s.mirostat,
            "mirostat_tau": s.mirostat_tau,
            "mirostat_eta": s.mirostat_eta,
            "n_keep": s.n_keep,
            "n_discard": s.n_discard,
            "ignore_eos": s.ignore_eos,
            "seed": -1 if s.seed is None else s.seed,
            "stop": list(s.stop),
            # As llama-server shows it, ignore_eos's bans included; a ban is null (JSON has no -inf).
            "logit_bias": [
                {"token": t, "bias": None if b <= BANNED else b}
                for t, b in s.bias(self.engine.end_of_generation if s.ignore_eos else ()).items()
            ],
        }

    async def completion(self, request: Request) -> Response:
        """llama-server's /completion (and /completions): one reply per prompt, in order."""
        self.require_ready()
        fields = await self.body(request)
        refuse_not_offered(fields)
        self.read_slot_and_progress(request, fields)
        sampling = await self.sampling(fields, openai=False)
        stream = fields.boolean("stream", False)
        return_tokens = fields.boolean("return_tokens", False)
        per_token = fields.boolean("timings_per_token", False)
        wanted = fields.body.get("response_fields")
        if wanted is not None and (not isinstance(wanted, list) or not all(isinstance(f, str) for f in wanted)):
            raise ApiError("response_fields: expected a list of field names")
        prompts = prompts_of(fields.body.get("prompt"), "prompt", self.n_vocab)
        check_request_size(self.limits, len(prompts), sampling)
        token_lists = [await self.prompt_tokens(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)]

        def final(index: int, generation: Generation, events: list[TokenEvent], content: str) -> dict:
            body = self.native_result(index, token_lists[index], generation, events, content, return_tokens=return_tokens)
            if sampling.n_probs and not stream:
                body["completion_probabilities"] = native_probs(self.engine, events, sampling.post_sampling)
            return only_fields(body, wanted) if wanted else body  # [] asks for everything, as in llama-server

        if not stream:
            done = await self.decode_each(request, token_lists, lambda _: sampling)
            if done is None:
                return Response(status_code=499)
            replies, headers = done

            def respond() -> JSONResponse:  # detokenizing each alternative and the JSON: off the event loop
                bodies = [final(i, generation, events, generation.result.text) for i, (generation, events) in enumerate(replies)]
                return JSONResponse(bodies[0] if len(bodies) == 1 else bodies, headers=headers)

            return await run_in_threadpool(respond)

        first, headers = self.start(request, token_lists[0], sampling)

        async def sse() -> AsyncIterator[str]:
            for index, tokens in enumerate(token_lists):
                generation = first if index == 0 else self.start(request, tokens, sampling)[0]
                events: list[TokenEvent] = []
                try:
                    async for event in run_generation(generation):
                        if isinstance(event, PromptProgress):
                            yield _dumps({"index": index, "content": "", "tokens": [], "stop": False, "id_slot": generation.result.slot,
                                          "prompt_progress": asdict(event)})
                            continue
                        events.append(event)
                        chunk = {"index": index, "content": event.text, "stop": False, "id_slot": generation.result.slot,
                                 "tokens": [event.token_id] if event.token_id >= 0 else []}
                        if sampling.n_probs and event.token_id >= 0:
                            chunk["completion_probabilities"] = native_probs(self.engine, [event], sampling.post_sampling)
                        if per_token:
                            chunk["timings"] = timings(generation.result)
                        yield _dumps(chunk)
                except EngineError as exc:
                    yield _dumps({"error": {"code": 500, "type": "server_error", "message": str(exc)}})
                    return
                finally:
                    self.account(request, generation.result)
                yield _dumps(final(index, generation, events, ""))

        return EventSourceResponse(sse(), headers=headers, sep="\n", ping=0)

    async def apply_template(self, request: Request) -> Response:
        """llama-server's /apply-template: the chat prompt the model would be given, as text."""
        self.require_ready()
        fields = await self.body(request)
        messages = chat_messages(fields.body.get("messages"))
        check_prefill(fields, messages)
        tools = tool_calls.tools_of(fields.body.get("tools")) or None
        try:
            rendered = await run_in_threadpool(self.engine.render_chat, messages, tools)
        except ChatTemplateError as exc:
            raise ApiError(f"messages: {exc}") from None
        return JSONResponse({"prompt": rendered.prompt})

    def offered_tools(self, fields: Fields) -> tuple[list[dict], Any, bool]:
        """The request's tools, its tool_choice, and whether a reply may call one (checked
        against the template's tool-call format)."""
        tools = tool_calls.tools_of(fields.body.get("tools"))
        choice = tool_calls.tool_choice_of(fields.body.get("tool_choice"), tools)
        calling = bool(tools) and choice != "none"
        if calling:
            self.tool_format()
        return tools, choice, calling

    def tool_format(self) -> str:
        """The tool-call format of the chat template in use; a 400 where it has none."""
        form = tool_calls.tool_format(self.engine.template_text)
        if form is None:
            raise ApiError(
                f"tools: the chat template of {self.engine.model_path.name} has no Kimi K2 or K3 tool-call section, the "
                "formats kimitui reads (give one with --chat-template-file)"
            )
        return form

    async def chat_input_tokens(self, request: Request) -> Response:
        """llama-server's /chat/completions/input_tokens: the length of a chat request's prompt,
        in tokens, without a reply."""
        self.require_ready()
        fields = await self.body(request)
        return JSONResponse({"input_tokens": await self.prompt_length(fields)})

    async def prompt_length(self, fields: Fields) -> int:
        """The tokens of the prompt a chat request gives the model, tools included."""
        messages = chat_messages(fields.body.get("messages"))
        check_prefill(fields, messages)
        tools, _, calling = self.offered_tools(fields)
        try:
            tokens, _ = await run_in_threadpool(self.engine.chat_prompt, messages, tools if calling else None)
        except ChatTemplateError as exc:
            raise ApiError(f"messages: {exc}") from None
        return len(tokens)

    async def tokenize(self, request: Request) -> Response:
        self.require_ready()
        fields = await self.body(request)
        content = fields.string("content")
        if content is None:
            raise ApiError("content: required")
        add_special = fields.boolean("add_special", False)
        parse_special = fields.boolean("parse_special", True)
        with_pieces = fields.boolean("with_pieces", False)
        tokens = await run_in_threadpool(self.engine.tokenize, content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": tokens})

        def pieces() -> Response:  # a token at a time: off the event loop
            # Encoded a few thousand entries at a time: one json.dumps of 100k entries holds the
            # GIL for a quarter of a second, and the event loop with it.
            parts = []
            for start in range(0, len(tokens), PIECES_PER_ENCODE):
                out = []
                for t in tokens[start : start + PIECES_PER_ENCODE]:
                    raw = self.engine.token_bytes(t)
                    try:
                        piece: str | list[int] = raw.decode("utf-8")
                    except UnicodeDecodeError:  # part of a multi-byte character: bytes, as llama-server does
                        piece = list(raw)
                    out.append({"id": t, "piece": piece})
                parts.append(json.dumps(out, ensure_ascii=False, separators=(",", ":"))[1:-1])
            return Response('{"tokens":[' + ",".join(parts) + "]}", media_type="application/json")

        return await run_in_threadpool(pieces)

    async def detokenize(self, request: Request) -> Response:
        self.require_ready()
        fields = await self.body(request)
        if not fields.has("tokens"):
            raise ApiError("tokens: required")
        ids = token_ids(fields.body["tokens"], "tokens", self.n_vocab)
        return JSONResponse({"content": await run_in_threadpool(self.engine.detokenize, ids)})

    async def slots(self, request: Request) -> Response:
        """llama-server's /slots: each slot's share of the context, whether a reply is being
        computed in it, and how many prompt tokens it holds cached."""
        if not self.slots_endpoint:
            raise ApiError("the /slots endpoint is off (--no-slots)", 501, "not_supported_error")
        self.require_ready()
        processing, _ = self.queue()
        engine = self.engine
        return JSONResponse([
            {
                "id": slot.id,
                "n_ctx": engine.slot_ctx,
                "is_processing": processing > 0 and slot.id == engine.slots.active,
                "n_cached": engine.llm.n_tokens if slot.id == engine.slots.active else len(slot.tokens),
            }
            for slot in engine.slots.slots
        ])

    async def slot_action(self, request: Request) -> Response:
        """llama-server's POST /slots/{id}?action=save|restore|erase, with --slot-save-path."""
        if not self.slot_save_path:
            raise ApiError("slot actions are off: start with --slot-save-path DIR (server.slot_save_path)", 501, "not_supported_error")
        self.require_ready()
        raw = request.path_params["id_slot"]
        if not raw.isdecimal() or not 0 <= int(raw) < self.engine.slots.count:
            raise ApiError(f"id_slot: {raw!r} is not a slot (there are {self.engine.slots.count}: 0 to {self.engine.slots.count - 1})")
        slot, action = int(raw), request.query_params.get("action")
        if action not in ("save", "restore", "erase"):
            raise ApiError(f"action: expected save, restore or erase, got {shown(action)}")
        name = ""
        if action != "erase":
            name = slot_filename((await self.body(request)).body.get("filename"))
        started = time.perf_counter()
        try:
            tokens, size = await run_in_threadpool(self.engine.slot_file, action, slot, Path(self.slot_save_path), name)
        except StateRefused as exc:
            raise ApiError(f"filename: {exc}") from None
        except FileNotFoundError:
            raise ApiError(f"filename: {Path(self.slot_save_path) / name}: no such saved slot", 404, "not_found_error") from None
        except OSError as exc:
            verb = "write" if action == "save" else "read"
            raise ApiError(f"filename: could not {verb} {Path(self.slot_save_path) / name}: {exc.strerror or exc}", 500, "server_error") from None
        except EngineError as exc:
            if self.engine.lifecycle.refusal() is not None:  # the engine failed or closed meanwhile
                raise ApiError(str(exc), 503, "unavailable_error") from None
            raise ApiError(str(exc)) from None
        ms = (time.perf_counter() - started) * 1000.0
        if action == "erase":
            return JSONResponse({"id_slot": slot, "n_erased": tokens})
        if action == "save":
            return JSONResponse({"id_slot": slot, "filename": name, "n_saved": tokens, "n_written": size, "timings": {"save_ms": ms}})
        return JSONResponse({"id_slot": slot, "filename": name, "n_restored": tokens, "n_read": size, "timings": {"restore_ms": ms}})

    async def props(self, request: Request) -> Response:
        self.require_ready()
        processing, deferred = self.queue()
        defaults = Sampling(**{**vars(self.limits.defaults), "max_tokens": self.limits.default_n_predict})
        return JSONResponse(
            {
                "default_generation_settings": {
                    "n_ctx": self.engine.slot_ctx,
                    "is_processing": processing > 0,
                    "params": self.generation_settings(defaults),
                },
                "total_slots": self.engine.slots.count,
                "model_path": str(self.engine.model_path),
                "n_ctx": self.engine.n_ctx,
                "chat_template": self.engine.template_text,
                "build_info": f"kimitui {__version__}",
                "max_n_predict": self.limits.max_n_predict,
                "queue": {"processing": processing, "deferred": deferred},
            }
        )

    async def metrics(self, request: Request) -> Response:
        processing, deferred = self.queue()
        text = prom.render(self.sampler.sample(), processing=processing, deferred=deferred)
        return Response(text, media_type=prom.CONTENT_TYPE)

    # -- OpenAI routes ---------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self.require_ready()
        info = self.engine.inspect()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_id,
                        "aliases": self.aliases or [self.model_id],
                        "tags": self.tags,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kimitui",
                        "meta": {
                            "name": info.name,
                            "size": info.file_bytes,
                            "n_vocab": self.n_vocab,
                            "n_ctx_train": info.context_length,
                            "n_ctx": self.engine.n_ctx,
                        },
                    }
                ],
            }
        )

    async def openai_completions(self, request: Request) -> Response:
        self.require_ready()
        fields = await self.body(request)
        refuse_not_offered(fields)
        self.read_slot_and_progress(request, fields)
        sampling = await self.sampling(fields, openai=True)
        fields.unsupported("echo", False)
        fields.unsupported("suffix", "")
        fields.unsupported("best_of", 1)
        n = choices_of(fields)
        prompts = prompts_of(fields.body.get("prompt"), "prompt", self.n_vocab)
        check_request_size(self.limits, n * len(prompts), sampling)
        token_lists = [await self.prompt_tokens(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)]
        # OpenAI numbers the choices prompt by prompt: n for the first prompt, then n for the next.
        asked = [tokens for tokens in token_lists for _ in range(n)]
        return await self._openai_reply(request, fields, sampling, asked, chat=False, per_prompt=n)

    async def chat_completions(self, request: Request) -> Response:
        self.require_ready()
        fields = await self.body(request)
        call = await self.prepare_chat(request, fields)
        return await self._openai_reply(request, fields, call.sampling, [call.tokens] * call.n, chat=True, calling=call.calling, per_prompt=call.n)

    async def prepare_chat(self, request: Request, fields: Fields) -> ChatCall:
        """A chat request's prompt tokens and sampling, checked: what /v1/chat/completions takes,
        and what the Anthropic and Responses requests are turned into."""
        refuse_not_offered(fields)
        self.read_slot_and_progress(request, fields)
        sampling = await self.sampling(fields, openai=True)
        n = choices_of(fields)
        check_request_size(self.limits, n, sampling)
        messages = chat_messages(fields.body.get("messages"))
        check_prefill(fields, messages)
        tools, choice, calling = self.offered_tools(fields)
        form = self.tool_format() if calling else None
        if calling:
            if choice != "auto":
                if sampling.grammar is not None:
                    raise ApiError(f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} makes its own grammar; drop grammar, json_schema or response_format")
                several = fields.boolean("parallel_tool_calls", True)
                sampling.grammar = tool_calls.calls_grammar(tools, choice, form, several=several)
                error = await run_in_threadpool(self.engine.grammar_error, sampling.grammar)
                if error is not None:
                    raise ApiError(f"tools: llama.cpp refused the grammar made from their parameters: {error}")
            sampling.special = True  # the section's markers are special tokens in Kimi's vocabulary
        if calling and fields.boolean("stream", False):
            # Such a reply is sent once whole (its calls are known only at its end): what comes per token cannot be.
            for name in ("logprobs", "timings_per_token", "return_progress"):
                if fields.body.get(name):
                    raise ApiError(f"{name}: not offered on a streamed reply that may call tools (it is sent once whole)")
        tokens, template_stops = await self.chat_tokens(messages, sampling.max_tokens, tools if calling else None)
        sampling.stop = tuple(dict.fromkeys(sampling.stop + template_stops))
        return ChatCall(tokens, sampling, form, n)

    @staticmethod
    def read_reply(r: GenerationResult, calling: str | None) -> tuple[str, list[dict], str]:
        """A chat reply's text, its tool calls (OpenAI's shape) and OpenAI's finish_reason."""
        if calling:
            content, calls = tool_calls.read_calls(r.text, calling)
            if calls:
                return content, calls, "length" if r.finish_reason == "length" else "tool_calls"
            return content, [], openai_finish(r)
        return r.text, [], openai_finish(r)

    async def chat_whole(self, request: Request, call: ChatCall) -> tuple[str, ChatEvent] | None:
        """One chat reply decoded whole: its text (tool calls read out) and its end event; None
        when the client left first."""
        done = await self.decode_each(request, [call.tokens], lambda _: call.sampling)
        if done is None:
            return None
        (generation, events), = done[0]
        request.state.headers = done[1]
        content, calls, finish = self.read_reply(generation.result, call.calling)
        return content, self._chat_end(generation, events, calls, finish)

    async def chat_events(self, request: Request, call: ChatCall) -> AsyncIterator[ChatEvent] | None:
        """One chat reply as events, for the APIs that stream in their own shape (Anthropic's,
        Responses'): PromptProgress, text deltas, then the end (or an error). A reply that may call
        tools is decoded whole first (its calls are known only at its end): None if the client
        left meanwhile. ``request.state.headers`` holds the reply's headers once it returns."""
        if call.calling:
            whole = await self.chat_whole(request, call)
            if whole is None:
                return None

            async def at_once() -> AsyncIterator[ChatEvent]:
                content, end = whole
                if content:
                    yield ChatEvent("text", content, result=end.result)
                yield end

            return at_once()
        generation, request.state.headers = self.start(request, call.tokens, call.sampling)

        async def streamed() -> AsyncIterator[ChatEvent]:
            events = []
            try:
                async for event in run_generation(generation):
                    if isinstance(event, PromptProgress):
                        yield ChatEvent("progress", progress=event, result=generation.result)
                        continue
                    events.append(event)
                    if event.text:
                        yield ChatEvent("text", event.text, result=generation.result)
            except EngineError as exc:
                yield ChatEvent("error", str(exc))
                return
            finally:
                self.account(request, generation.result)
            yield self._chat_end(generation, events, [], openai_finish(generation.result))

        return streamed()

    def _chat_end(self, generation: Generation, events: list[TokenEvent], calls: list[dict], finish: str) -> ChatEvent:
        ids = [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]
        _, word = self.stop_type(generation.result, generation.sampling.stop, ids)
        return ChatEvent("end", result=generation.result, calls=calls, finish=finish, stop_word=word)

    # -- Anthropic routes (anthropic.py) ----------------------------------------------------

    async def anthropic_messages(self, request: Request) -> Response:
        self.require_ready()
        chat = anthropic.chat_request((await self.body(request)).body)
        fields = Fields(chat)
        call = await self.prepare_chat(request, fields)
        asked = fields.stops()  # the request's own stop strings (the template's end of turn is not one)
        ident = anthropic.new_id()
        if not fields.boolean("stream", False):
            whole = await self.chat_whole(request, call)
            if whole is None:
                return Response(status_code=499)
            text, end = whole
            return JSONResponse(anthropic.message(ident, self.model_id, text, end, asked), headers=request.state.headers)
        replies = await self.chat_events(request, call)
        if replies is None:
            return Response(status_code=499)
        stream = anthropic.events(ident, self.model_id, len(call.tokens), replies, asked)
        return EventSourceResponse(stream, headers=request.state.headers, sep="\n", ping=0)

    async def anthropic_count_tokens(self, request: Request) -> Response:
        """The prompt a Messages request would give the model, in tokens (tools included)."""
        self.require_ready()
        fields = Fields(anthropic.chat_request((await self.body(request)).body))
        return JSONResponse({"input_tokens": await self.prompt_length(fields)})

    # -- OpenAI's Responses route (responses.py) --------------------------------------------

    async def openai_responses(self, request: Request) -> Response:
        self.require_ready()
        body = (await self.body(request)).body
        chat, conversation = self.kept_responses.chat_request(body)
        fields = Fields(chat)
        if fields.body.get("n") not in (None, 1):
            raise ApiError("n: a response has one reply")
        call = await self.prepare_chat(request, fields)
        shape = responses.Shape(responses.new_id(), self.model_id, body, body.get("previous_response_id"))
        store = Fields(body).boolean("store", True)

        def keep(text: str, end: ChatEvent) -> None:
            if store:
                self.kept_responses.keep(shape.ident, conversation, text, end.calls)

        if not fields.boolean("stream", False):
            whole = await self.chat_whole(request, call)
            if whole is None:
                return Response(status_code=499)
            text, end = whole
            keep(text, end)
            return JSONResponse(shape.whole(text, end), headers=request.state.headers)
        replies = await self.chat_events(request, call)
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

        stream = responses.events(shape, replies, extra, keep)
        return EventSourceResponse(stream, headers=request.state.headers, sep="\n", ping=0)

    async def _whole_as_stream(self, request, asked, sampling_for, envelope, message_of, include_usage: bool, per_prompt: int, debug) -> Response:
        """A streamed reply that may call tools: each choice is decoded whole (its calls are
        known only at its end), then sent as OpenAI's chunks: role, content, one chunk per call."""
        done = await self.decode_each(request, asked, sampling_for)
        if done is None:
            return Response(status_code=499)
        decoded, headers = done
        replies = [generation.result for generation, _ in decoded]
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, finish: str | None = None, **more) -> str:
            return _dumps(envelope([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra, **more))

        async def sse() -> AsyncIterator[str]:
            for index, r in enumerate(replies):
                message, finish = message_of(r)
                yield chunk(index, {"role": "assistant", "content": None})
                if message.get("content"):
                    yield chunk(index, {"content": message["content"]})
                for i, call in enumerate(message.get("tool_calls", [])):
                    yield chunk(index, {"tool_calls": [{"index": i, **call}]})
                yield chunk(index, {}, finish, timings=timings(r), **debug(index, *decoded[index]))
            if include_usage:
                yield _dumps(envelope([], usage=usage(replies, per_prompt), timings=timings(replies[-1])))
            yield "[DONE]"

        return EventSourceResponse(sse(), headers=headers, sep="\n", ping=0)

    @staticmethod
    def _include_usage(fields: Fields) -> bool:
        options = Fields(fields.obj("stream_options"))
        try:
            return options.boolean("include_usage", False)
        except ApiError as exc:
            raise ApiError(f"stream_options.{exc.message}") from None

    async def _openai_reply(
        self, request, fields: Fields, sampling: Sampling, asked: list[list[int]], *, chat: bool, calling: str | None = None,
        per_prompt: int = 1,
    ) -> Response:
        """OpenAI's reply shape for one choice per entry of ``asked`` (prompt tokens), decoded one
        after the other; each later choice gets the next seed, so sampled choices differ. With
        ``calling`` (the tool-call format, when tools are offered) each reply is read for tool calls; streamed, it is sent once
        whole, as the calls are known only at its end."""
        stream = fields.boolean("stream", False)
        include_usage = self._include_usage(fields)
        per_token = fields.boolean("timings_per_token", False)
        verbose = fields.boolean("verbose", self.verbose)
        logprobs = sampling.n_probs > 0
        n_top = fields.integer("top_logprobs", 0, 0, 20) if chat else (fields.integer("logprobs", 0, 0, 5) if logprobs else 0)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def sampling_for(index: int) -> Sampling:
            if index == 0 or sampling.seed is None:
                return sampling
            return replace(sampling, seed=(sampling.seed + index) & 0xFFFFFFFF)

        def envelope(choices: list, **extra) -> dict:
            return {"id": ident, "object": obj + (".chunk" if chat and stream else ""), "created": created,
                    "model": self.model_id, "system_fingerprint": FINGERPRINT, "choices": choices, **extra}

        def probs(events: list[TokenEvent]) -> dict | None:
            if not logprobs:
                return None
            return chat_logprobs(self.engine, events, n_top) if chat else text_logprobs(self.engine, events, n_top)

        def message_of(r: GenerationResult) -> tuple[dict, str]:
            content, calls, finish = self.read_reply(r, calling)
            if calls:
                return {"role": "assistant", "content": content or None, "tool_calls": calls}, finish
            return {"role": "assistant", "content": content}, finish

        def debug(index: int, generation: Generation, events: list[TokenEvent]) -> dict:
            """llama-server's __verbose, when asked for: its own result, the prompt as the model saw it."""
            return {"__verbose": self.native_result(index, asked[index], generation, events, generation.result.text)} if verbose else {}

        if calling and stream:
            return await self._whole_as_stream(request, asked, sampling_for, envelope, message_of, include_usage, per_prompt, debug)

        if not stream:
            done = await self.decode_each(request, asked, sampling_for)
            if done is None:
                return Response(status_code=499)

            def respond() -> JSONResponse:  # detokenizing each alternative and the JSON: off the event loop
                choices, results, headers = [], [], done[1]
                for index, (generation, events) in enumerate(done[0]):
                    r = generation.result
                    results.append(r)
                    if chat:
                        message, finish = message_of(r)
                        choices.append({"index": index, "message": message, "logprobs": probs(events), "finish_reason": finish})
                    else:
                        choices.append({"index": index, "text": r.text, "logprobs": probs(events), "finish_reason": openai_finish(r)})
                timing = timings(results[0]) if len(results) == 1 else None
                return JSONResponse(
                    envelope(choices, usage=usage(results, per_prompt), **({"timings": timing} if timing else {}), **debug(0, *done[0][0])),
                    headers=headers,
                )

            return await run_in_threadpool(respond)

        # With include_usage, OpenAI sends "usage": null on every chunk but the extra last one.
        extra = {"usage": None} if include_usage else {}

        def choice(index: int, text: str | None, finish: str | None, events: list[TokenEvent] = (), first: bool = False) -> dict:
            lp = probs(list(events)) if events else None
            if not chat:
                return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            if first:
                delta = {"role": "assistant", "content": None}
            else:
                delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        first_generation, headers = self.start(request, asked[0], sampling_for(0))

        async def sse() -> AsyncIterator[str]:
            results = []
            for index, tokens in enumerate(asked):
                generation = first_generation if index == 0 else self.start(request, tokens, sampling_for(index))[0]
                if chat:
                    yield _dumps(envelope([choice(index, None, None, first=True)], **extra))
                events: list[TokenEvent] = []
                try:
                    async for event in run_generation(generation):
                        if isinstance(event, PromptProgress):  # as llama-server sends it: an empty delta
                            empty = choice(index, None, None, first=True) if chat else choice(index, "", None)
                            yield _dumps(envelope([empty], **extra, prompt_progress=asdict(event)))
                            continue
                        events.append(event)
                        more = {"timings": timings(generation.result)} if per_token else {}
                        yield _dumps(envelope([choice(index, event.text, None, [event] if event.token_id >= 0 else ())], **extra, **more))
                except EngineError as exc:
                    yield _dumps({"error": {"code": 500, "type": "server_error", "message": str(exc)}})
                    return
                finally:
                    self.account(request, generation.result)
                r = generation.result
                results.append(r)
                yield _dumps(envelope([choice(index, None, openai_finish(r))], **extra, timings=timings(r), **debug(index, generation, events)))
            if include_usage:
                yield _dumps(envelope([], usage=usage(results, per_prompt), timings=timings(results[-1])))
            yield "[DONE]"

        return EventSourceResponse(sse(), headers=headers, sep="\n", ping=0)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc.status, exc.kind, exc.message, path=request.url.path, **exc.extra)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    messages = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path}",
    }
    return error_response(
        exc.status_code, kinds.get(exc.status_code, "invalid_request_error"),
        messages.get(exc.status_code, exc.detail), headers=exc.headers, path=request.url.path,
    )


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(500, "server_error", f"internal error: {type(exc).__name__}", path=request.url.path)


def create_app(
    engine: Engine,
    settings: Settings,
    *,
    api_key: str | None = None,
    on_request: Callable[[dict], None] | None = None,
    bind_host: str | None = None,
) -> Starlette:
    """The API over ``engine``. ``api_key`` None means the configured server.api_key ("" = none).

    ``on_request(record)`` is called on the event loop's thread after every request with
    method, path, status, client, prompt_tokens, tokens, queue_position and duration_s.
    ``bind_host``: the address it listens on (default server.host), for the Host header check.
    """
    api = Api(engine, settings)
    key = settings["server.api_key"] if api_key is None else api_key
    origins = frozenset(settings["server.cors_origins"])
    post, get = ["POST"], ["GET"]
    routes = [
        Route("/health", api.health, methods=get),
        Route("/completion", api.completion, methods=post),
        Route("/tokenize", api.tokenize, methods=post),
        Route("/detokenize", api.detokenize, methods=post),
        Route("/apply-template", api.apply_template, methods=post),
        Route("/props", api.props, methods=get),
        Route("/slots", api.slots, methods=get),
        Route("/slots/{id_slot}", api.slot_action, methods=post),
        Route("/metrics", api.metrics, methods=get),
        Route("/v1/models", api.models, methods=get),
        Route("/v1/completions", api.openai_completions, methods=post),
        Route("/v1/chat/completions", api.chat_completions, methods=post),
        Route("/v1/chat/completions/input_tokens", api.chat_input_tokens, methods=post),
        Route("/chat/completions/input_tokens", api.chat_input_tokens, methods=post),
        # llama-server's aliases, for clients configured with a base URL without /v1.
        Route("/models", api.models, methods=get),
        Route("/completions", api.completion, methods=post),  # llama-server's own, as there
        Route("/chat/completions", api.chat_completions, methods=post),
        Route("/v1/health", api.health, methods=get),
        Route("/v1/messages", api.anthropic_messages, methods=post),
        Route("/v1/responses", api.openai_responses, methods=post),
        Route("/responses", api.openai_responses, methods=post),
        Route("/v1/messages/count_tokens", api.anthropic_count_tokens, methods=post),
    ]
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(
                _Origin, bind_host=settings["server.host"] if bind_host is None else bind_host, allowed_hosts=frozenset(h.lower() for h in settings["server.allowed_hosts"]),
                cors_origins=origins, on_request=on_request,
            ),
            # Preflights of allowed origins end here, before the key check (browsers send none).
            Middleware(
                CORSMiddleware, allow_origins=sorted(origins - {"localhost"}),
                allow_origin_regex=LOOPBACK_ORIGINS if "localhost" in origins else None, allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version", "Anthropic-Beta",
                               "Anthropic-Dangerous-Direct-Browser-Access"], expose_headers=[QUEUE_HEADER], max_age=600,
            ),
            Middleware(_Guard, api_key=key or None, max_body=settings["server.max_body"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
    )
