"""A request read into what the engine takes: whether the engine answers at all, the body, the
prompt's tokens (text, ids or a chat), the sampling, and the slot and progress asked for. Each
mistake is a 400 that names the field (params.py) before the engine decodes anything."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from kimitui.config import Settings
from kimitui.engine.generation import Sampling
from kimitui.engine.interface import ServingEngine
from kimitui.engine.state import ChatTemplateError, EngineState
from kimitui.server.params import (
    ApiError, Fields, Limits, check_request_size, grammar_of, parse_body, prompts_of, refuse_not_offered, sampling_from, token_ids,
)

LARGE_BODY = 65536  # bytes: a body this large is parsed off the event loop


def require_ready(engine: ServingEngine) -> None:
    """The engine's lifecycle decides (a failure it can mend lets the request through)."""
    refused = engine.lifecycle.refusal()
    if refused is not None:
        raise ApiError(failure(engine) if engine.state is EngineState.FAILED else refused, 503, "unavailable_error")


def failure(engine: ServingEngine) -> str:
    if engine.load_error:
        return f"the model failed to load: {engine.load_error}"
    return engine.lifecycle.reason or "the engine failed"


async def read_body(request: Request) -> Fields:
    raw = await request.body()
    # A large body (server.max_body allows megabytes) takes tens of milliseconds to parse: off the event loop.
    return Fields(parse_body(raw) if len(raw) < LARGE_BODY else await run_in_threadpool(parse_body, raw))


@contextmanager
def template_refusals() -> Iterator[None]:
    """The chat template refusing the messages is the request's mistake: a 400 on messages."""
    try:
        yield
    except ChatTemplateError as exc:
        raise ApiError(f"messages: {exc}") from None


def limits_of(settings: Settings) -> Limits:
    """What the configuration lets one request ask for, and the sampling it gets by default."""
    cap = settings["server.max_n_predict"]
    return Limits(
        max_n_predict=cap,
        max_entries=settings["server.max_request_entries"],
        default_n_predict=min(settings["sampling.max_tokens"], cap),
        defaults=Sampling(
            temperature=settings["sampling.temperature"], top_p=settings["sampling.top_p"],
            seed=None if settings["sampling.seed"] == -1 else settings["sampling.seed"],
        ),
    )


@dataclass(eq=False)
class Intake:
    """Reads a request against the engine it asks (its vocabulary, context and slots) and the
    server's limits."""

    engine: ServingEngine
    limits: Limits

    @property
    def n_vocab(self) -> int:
        return self.engine.llm.n_vocab()

    async def checked_sampling(self, request: Request, fields: Fields, *, openai: bool) -> Sampling:
        """What every request that decodes checks first: no field that is not offered, its slot
        and progress, then its sampling."""
        refuse_not_offered(fields)
        self.read_slot_and_progress(request, fields)
        return await self.sampling(fields, openai=openai)

    def read_slot_and_progress(self, request: Request, fields: Fields) -> None:
        """The request's ``id_slot`` (-1: the slot whose cached prompt fits best) and
        ``return_progress``, for Decoder.start."""
        asked = fields.integer("id_slot", -1, -1, self.engine.slots.count - 1)
        request.state.slot = None if asked == -1 else asked
        request.state.progress = fields.boolean("return_progress", False)
        if request.state.progress and not fields.boolean("stream", False):
            raise ApiError("return_progress: prompt progress is sent on a streamed reply only (give stream: true)")

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

    async def prompts(self, fields: Fields, sampling: Sampling, choices: int = 1) -> list[list[int]]:
        """The tokens of each of the request's prompts, once the replies asked for (``choices``
        per prompt) are within the server's limit."""
        prompts = prompts_of(fields.body.get("prompt"), "prompt", self.n_vocab)
        check_request_size(self.limits, choices * len(prompts), sampling)
        return [await self.prompt_tokens(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)]

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

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], tuple[str, ...]]:
        """The chat's prompt tokens and the template's stop strings."""
        with template_refusals():
            return await run_in_threadpool(self.engine.chat_prompt, messages, tools)

    async def chat_tokens(self, messages: list[dict], max_tokens: int, tools: list[dict] | None = None) -> tuple[list[int], tuple[str, ...]]:
        """chat_prompt, refused when it leaves no room for the reply."""
        tokens, stops = await self.chat_prompt(messages, tools)
        # Engine.chat would drop old turns to make room; an API client gets told instead.
        if self.engine.slot_ctx - len(tokens) < min(max_tokens, 16):
            raise self._too_long("messages", len(tokens))
        return tokens, stops

    def _too_long(self, name: str, n_prompt: int) -> ApiError:
        return ApiError(
            f"{name}: the prompt is {n_prompt} tokens; {self.engine.context_words}", 400,
            "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=self.engine.slot_ctx,
        )
