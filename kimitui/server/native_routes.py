"""llama-server's own routes: /completion, /tokenize, /detokenize, /apply-template, /health,
/props, /metrics, /slots and the slot actions, each answering as llama-server does."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kimitui import __version__
from kimitui.engine.generation import Generation, PromptProgress, Sampling, TokenEvent
from kimitui.engine.interface import ServingEngine
from kimitui.engine.metrics import Sampler
from kimitui.engine.saved_states import StateRefused
from kimitui.engine.state import EngineError, EngineState
from kimitui.server import prom
from kimitui.server import tools as tool_calls
from kimitui.server.decoding import Decoder, account, queue_counts, run_generation
from kimitui.server.intake import Intake, failure, read_body, require_ready, template_refusals
from kimitui.server.params import ApiError, Limits, chat_messages, check_prefill, shown, slot_filename, token_ids
from kimitui.server.shapes import dumps, event_stream, generation_settings, native_probs, native_result, only_fields, stream_error, timings

PIECES_PER_ENCODE = 4096  # /tokenize with_pieces: entries JSON-encoded at a time (see TextRoutes.tokenize)

# One reply's llama-server result, given its index, generation, events and text.
ResultWriter = Callable[[int, Generation, list[TokenEvent], str], dict]


@dataclass(eq=False)
class CompletionRoute:
    """llama-server's /completion (and /completions): one reply per prompt, in order."""

    engine: ServingEngine
    intake: Intake
    decoder: Decoder
    model_id: str

    async def completion(self, request: Request) -> Response:
        require_ready(self.engine)
        fields = await read_body(request)
        sampling = await self.intake.checked_sampling(request, fields, openai=False)
        stream = fields.boolean("stream", False)
        return_tokens = fields.boolean("return_tokens", False)
        per_token = fields.boolean("timings_per_token", False)
        wanted = fields.body.get("response_fields")
        if wanted is not None and (not isinstance(wanted, list) or not all(isinstance(f, str) for f in wanted)):
            raise ApiError("response_fields: expected a list of field names")
        token_lists = await self.intake.prompts(fields, sampling)

        def final(index: int, generation: Generation, events: list[TokenEvent], content: str) -> dict:
            body = native_result(self.engine, self.model_id, index, token_lists[index], generation, events, content, return_tokens=return_tokens)
            if sampling.n_probs and not stream:
                body["completion_probabilities"] = native_probs(self.engine, events, sampling.post_sampling)
            return only_fields(body, wanted) if wanted else body  # [] asks for everything, as in llama-server

        if not stream:
            return await self._whole(request, token_lists, sampling, final)
        return self._streamed(request, token_lists, sampling, per_token, final)

    async def _whole(self, request: Request, token_lists: list[list[int]], sampling: Sampling, final: ResultWriter) -> Response:
        done = await self.decoder.decode_each(request, token_lists, lambda _: sampling)
        if done is None:
            return Response(status_code=499)
        replies, headers = done

        def respond() -> JSONResponse:  # detokenizing each alternative and the JSON: off the event loop
            bodies = [final(i, generation, events, generation.result.text) for i, (generation, events) in enumerate(replies)]
            return JSONResponse(bodies[0] if len(bodies) == 1 else bodies, headers=headers)

        return await run_in_threadpool(respond)

    def _streamed(self, request: Request, token_lists: list[list[int]], sampling: Sampling, per_token: bool, final: ResultWriter) -> Response:
        first, headers = self.decoder.start(request, token_lists[0], sampling)

        async def sse() -> AsyncIterator[str]:
            for index, tokens in enumerate(token_lists):
                generation = first if index == 0 else self.decoder.start(request, tokens, sampling)[0]
                events: list[TokenEvent] = []
                try:
                    async for event in run_generation(generation):
                        if isinstance(event, PromptProgress):
                            yield dumps({"index": index, "content": "", "tokens": [], "stop": False, "id_slot": generation.result.slot,
                                         "prompt_progress": asdict(event)})
                            continue
                        events.append(event)
                        chunk = {"index": index, "content": event.text, "stop": False, "id_slot": generation.result.slot,
                                 "tokens": [event.token_id] if event.token_id >= 0 else []}
                        if sampling.n_probs and event.token_id >= 0:
                            chunk["completion_probabilities"] = native_probs(self.engine, [event], sampling.post_sampling)
                        if per_token:
                            chunk["timings"] = timings(generation.result)
                        yield dumps(chunk)
                except EngineError as exc:
                    yield stream_error(exc)
                    return
                finally:
                    account(request, generation.result)
                yield dumps(final(index, generation, events, ""))

        return event_stream(sse(), headers)


class TextRoutes:
    """Text and tokens without a reply: /tokenize, /detokenize, /apply-template."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    async def apply_template(self, request: Request) -> Response:
        """llama-server's /apply-template: the chat prompt the model would be given, as text."""
        require_ready(self.engine)
        fields = await read_body(request)
        messages = chat_messages(fields.body.get("messages"))
        check_prefill(fields, messages)
        tools = tool_calls.tools_of(fields.body.get("tools")) or None
        with template_refusals():
            rendered = await run_in_threadpool(self.engine.render_chat, messages, tools)
        return JSONResponse({"prompt": rendered.prompt})

    async def tokenize(self, request: Request) -> Response:
        require_ready(self.engine)
        fields = await read_body(request)
        content = fields.string("content")
        if content is None:
            raise ApiError("content: required")
        add_special = fields.boolean("add_special", False)
        parse_special = fields.boolean("parse_special", True)
        with_pieces = fields.boolean("with_pieces", False)
        tokens = await run_in_threadpool(self.engine.tokenize, content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": tokens})
        return await run_in_threadpool(self._pieces, tokens)  # a token at a time: off the event loop

    def _pieces(self, tokens: list[int]) -> Response:
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

    async def detokenize(self, request: Request) -> Response:
        require_ready(self.engine)
        fields = await read_body(request)
        if not fields.has("tokens"):
            raise ApiError("tokens: required")
        ids = token_ids(fields.body["tokens"], "tokens", self.engine.llm.n_vocab())
        return JSONResponse({"content": await run_in_threadpool(self.engine.detokenize, ids)})


class StatusRoutes:
    """What the server reports: /health, /props, /metrics."""

    def __init__(self, engine: ServingEngine, limits: Limits) -> None:
        self.engine = engine
        self.limits = limits
        # Its own sampler: scraping must not disturb the rates and history the TUI's sampler keeps.
        self.sampler = Sampler(engine.metrics, model_path=engine.model_path)

    async def health(self, request: Request) -> Response:
        state = self.engine.state
        if self.engine.lifecycle.refusal() is None:
            return JSONResponse({"status": "ok"})
        status = "error" if state is EngineState.FAILED else "loading model"
        message = failure(self.engine) if state is EngineState.FAILED else "Loading model"
        return JSONResponse(
            {
                "status": status,
                "progress": self.engine.load_progress,
                "error": {"code": 503, "type": "unavailable_error", "message": message},
            },
            503,
        )

    async def props(self, request: Request) -> Response:
        require_ready(self.engine)
        processing, deferred = queue_counts(self.engine)
        defaults = Sampling(**{**vars(self.limits.defaults), "max_tokens": self.limits.default_n_predict})
        return JSONResponse(
            {
                "default_generation_settings": {
                    "n_ctx": self.engine.slot_ctx,
                    "is_processing": processing > 0,
                    "params": generation_settings(self.engine, defaults),
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
        processing, deferred = queue_counts(self.engine)
        text = prom.render(self.sampler.sample(), processing=processing, deferred=deferred)
        return Response(text, media_type=prom.CONTENT_TYPE)


@dataclass(eq=False)
class SlotRoutes:
    """llama-server's /slots and its slot actions."""

    engine: ServingEngine
    listed: bool  # server.slots_endpoint
    save_path: str  # server.slot_save_path ("": slot actions are off)

    async def slots(self, request: Request) -> Response:
        """llama-server's /slots: each slot's share of the context, whether a reply is being
        computed in it, and how many prompt tokens it holds cached."""
        if not self.listed:
            raise ApiError("the /slots endpoint is off (--no-slots)", 501, "not_supported_error")
        require_ready(self.engine)
        processing, _ = queue_counts(self.engine)
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
        if not self.save_path:
            raise ApiError("slot actions are off: start with --slot-save-path DIR (server.slot_save_path)", 501, "not_supported_error")
        require_ready(self.engine)
        raw = request.path_params["id_slot"]
        if not raw.isdecimal() or not 0 <= int(raw) < self.engine.slots.count:
            raise ApiError(f"id_slot: {raw!r} is not a slot (there are {self.engine.slots.count}: 0 to {self.engine.slots.count - 1})")
        slot, action = int(raw), request.query_params.get("action")
        if action not in ("save", "restore", "erase"):
            raise ApiError(f"action: expected save, restore or erase, got {shown(action)}")
        name = ""
        if action != "erase":
            name = slot_filename((await read_body(request)).body.get("filename"))
        started = time.perf_counter()
        try:
            tokens, size = await run_in_threadpool(self.engine.slot_file, action, slot, Path(self.save_path), name)
        except StateRefused as exc:
            raise ApiError(f"filename: {exc}") from None
        except FileNotFoundError:
            raise ApiError(f"filename: {Path(self.save_path) / name}: no such saved slot", 404, "not_found_error") from None
        except OSError as exc:
            verb = "write" if action == "save" else "read"
            raise ApiError(f"filename: could not {verb} {Path(self.save_path) / name}: {exc.strerror or exc}", 500, "server_error") from None
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
