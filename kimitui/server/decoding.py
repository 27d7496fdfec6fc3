"""A request's replies on the engine: each takes its turn in the engine's TurnQueue (API and TUI
alike, first come first served), runs on a thread of its own (the engine blocks) while the event
loop only moves its tokens, and is cancelled when its client goes away, which frees the engine
before the next token."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import AsyncIterator

from starlette.requests import Request

from kimitui.engine.generation import Generation, GenerationResult, Sampling, TokenEvent
from kimitui.engine.interface import ServingEngine
from kimitui.engine.state import EngineError
from kimitui.server.params import ApiError

QUEUE_HEADER = "X-Queue-Position"


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


def queue_counts(engine: ServingEngine) -> tuple[int, int]:
    """(processing, deferred): the turn holder and those waiting behind it."""
    waiting = engine.turns.waiting
    processing = min(1, waiting)
    return processing, waiting - processing


def account(request: Request, result: GenerationResult) -> None:
    """What the request report (guard.OriginCheck) says of the reply."""
    request.state.prompt_tokens = result.prompt_tokens
    request.state.tokens = result.completion_tokens


def _engine_error(generation: Generation, exc: EngineError) -> ApiError:
    # A failure before the prompt was accepted is about the request; later ones are ours.
    if generation.result.prompt_tokens == 0:
        return ApiError(str(exc))
    return ApiError(str(exc), 500, "server_error")


class Decoder:
    """Starts a request's replies on the engine, telling each where it stands in line, and
    collects the replies that are not streamed."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        # Replies started here that have not taken their turn yet (their thread is starting):
        # a burst of requests reaching an idle engine must not all be told "position 0". Weak,
        # so a reply whose stream never began leaves no count behind.
        self._arriving: weakref.WeakSet[Generation] = weakref.WeakSet()

    def start(self, request: Request, tokens: list[int], sampling: Sampling) -> tuple[Generation, dict]:
        """A reply to ``tokens`` in the request's slot (Intake.read_slot_and_progress), and the
        header that tells its place in line."""
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
            account(request, generation.result)

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
