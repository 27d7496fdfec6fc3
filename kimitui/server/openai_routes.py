"""OpenAI's routes: /v1/models, /v1/completions, /v1/chat/completions (through the chat path)
and llama-server's /v1/chat/completions/input_tokens, with the reply written in OpenAI's shape
(OpenAIReply): whole, streamed as chunks, or, for a reply that may call tools, decoded whole and
then sent as chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kimitui.engine.generation import Generation, GenerationResult, PromptProgress, Sampling, TokenEvent
from kimitui.engine.interface import ServingEngine
from kimitui.engine.state import EngineError
from kimitui.server.chat import ChatPath, read_reply
from kimitui.server.decoding import Decoder, account, run_generation
from kimitui.server.intake import Intake, read_body, require_ready
from kimitui.server.params import ApiError, Fields, choices_of
from kimitui.server.shapes import (
    FINGERPRINT, chat_logprobs, dumps, event_stream, native_result, openai_finish, stream_error, text_logprobs, timings, usage,
)


@dataclass(eq=False)
class OpenAIRoutes:
    engine: ServingEngine
    intake: Intake
    decoder: Decoder
    chat: ChatPath
    model_id: str
    aliases: list[str]  # server.alias: the model's names, sorted (model_id is the first)
    tags: list[str]  # server.tags
    verbose: bool  # server.verbose: every reply has llama-server's __verbose
    created: int = field(default_factory=lambda: int(time.time()))

    async def models(self, request: Request) -> Response:
        require_ready(self.engine)
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
                            "n_vocab": self.engine.llm.n_vocab(),
                            "n_ctx_train": info.context_length,
                            "n_ctx": self.engine.n_ctx,
                        },
                    }
                ],
            }
        )

    async def completions(self, request: Request) -> Response:
        require_ready(self.engine)
        fields = await read_body(request)
        sampling = await self.intake.checked_sampling(request, fields, openai=True)
        fields.unsupported("echo", False)
        fields.unsupported("suffix", "")
        fields.unsupported("best_of", 1)
        n = choices_of(fields)
        token_lists = await self.intake.prompts(fields, sampling, n)
        # OpenAI numbers the choices prompt by prompt: n for the first prompt, then n for the next.
        asked = [tokens for tokens in token_lists for _ in range(n)]
        reply = OpenAIReply(self, fields, sampling, asked, chat=False, per_prompt=n)
        return await reply.respond(request)

    async def chat_completions(self, request: Request) -> Response:
        require_ready(self.engine)
        fields = await read_body(request)
        call = await self.chat.prepare_chat(request, fields)
        reply = OpenAIReply(self, fields, call.sampling, [call.tokens] * call.n, chat=True, calling=call.calling, per_prompt=call.n)
        return await reply.respond(request)

    async def chat_input_tokens(self, request: Request) -> Response:
        """llama-server's /chat/completions/input_tokens: the length of a chat request's prompt,
        in tokens, without a reply."""
        require_ready(self.engine)
        fields = await read_body(request)
        return JSONResponse({"input_tokens": await self.chat.prompt_length(fields)})


def _include_usage(fields: Fields) -> bool:
    options = Fields(fields.obj("stream_options"))
    try:
        return options.boolean("include_usage", False)
    except ApiError as exc:
        raise ApiError(f"stream_options.{exc.message}") from None


class OpenAIReply:
    """OpenAI's reply shape for one choice per entry of ``asked`` (prompt tokens), decoded one
    after the other; each later choice gets the next seed, so sampled choices differ. With
    ``calling`` (the tool-call format, when tools are offered) each reply is read for tool calls;
    streamed, it is sent once whole, as the calls are known only at its end."""

    def __init__(
        self, routes: OpenAIRoutes, fields: Fields, sampling: Sampling, asked: list[list[int]], *, chat: bool,
        calling: str | None = None, per_prompt: int = 1,
    ) -> None:
        self.engine, self.decoder, self.model_id = routes.engine, routes.decoder, routes.model_id
        self.sampling, self.asked, self.chat, self.calling, self.per_prompt = sampling, asked, chat, calling, per_prompt
        self.stream = fields.boolean("stream", False)
        self.include_usage = _include_usage(fields)
        self.per_token = fields.boolean("timings_per_token", False)
        self.verbose = fields.boolean("verbose", routes.verbose)
        self.logprobs = sampling.n_probs > 0
        self.n_top = fields.integer("top_logprobs", 0, 0, 20) if chat else (fields.integer("logprobs", 0, 0, 5) if self.logprobs else 0)
        self.ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and self.stream else "")
        # With include_usage, OpenAI sends "usage": null on every chunk but the extra last one.
        self.chunk_usage = {"usage": None} if self.include_usage else {}

    async def respond(self, request: Request) -> Response:
        if self.calling and self.stream:
            return await self._whole_as_stream(request)
        if self.stream:
            return self._streamed(request)
        return await self._whole(request)

    def sampling_for(self, index: int) -> Sampling:
        if index == 0 or self.sampling.seed is None:
            return self.sampling
        return replace(self.sampling, seed=(self.sampling.seed + index) & 0xFFFFFFFF)

    def envelope(self, choices: list, **extra) -> dict:
        return {"id": self.ident, "object": self.object, "created": self.created,
                "model": self.model_id, "system_fingerprint": FINGERPRINT, "choices": choices, **extra}

    def probs(self, events: list[TokenEvent]) -> dict | None:
        if not self.logprobs:
            return None
        return chat_logprobs(self.engine, events, self.n_top) if self.chat else text_logprobs(self.engine, events, self.n_top)

    def message_of(self, r: GenerationResult) -> tuple[dict, str]:
        content, calls, finish = read_reply(r, self.calling)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": calls}, finish
        return {"role": "assistant", "content": content}, finish

    def debug(self, index: int, generation: Generation, events: list[TokenEvent]) -> dict:
        """llama-server's __verbose, when asked for: its own result, the prompt as the model saw it."""
        if not self.verbose:
            return {}
        return {"__verbose": native_result(self.engine, self.model_id, index, self.asked[index], generation, events, generation.result.text)}

    def usage_chunk(self, results: list[GenerationResult]) -> str:
        """The extra last chunk of a stream with include_usage."""
        return dumps(self.envelope([], usage=usage(results, self.per_prompt), timings=timings(results[-1])))

    async def _whole(self, request: Request) -> Response:
        done = await self.decoder.decode_each(request, self.asked, self.sampling_for)
        if done is None:
            return Response(status_code=499)
        decoded, headers = done

        def respond() -> JSONResponse:  # detokenizing each alternative and the JSON: off the event loop
            choices, results = [], []
            for index, (generation, events) in enumerate(decoded):
                r = generation.result
                results.append(r)
                if self.chat:
                    message, finish = self.message_of(r)
                    choices.append({"index": index, "message": message, "logprobs": self.probs(events), "finish_reason": finish})
                else:
                    choices.append({"index": index, "text": r.text, "logprobs": self.probs(events), "finish_reason": openai_finish(r)})
            timing = timings(results[0]) if len(results) == 1 else None
            return JSONResponse(
                self.envelope(choices, usage=usage(results, self.per_prompt), **({"timings": timing} if timing else {}), **self.debug(0, *decoded[0])),
                headers=headers,
            )

        return await run_in_threadpool(respond)

    async def _whole_as_stream(self, request: Request) -> Response:
        """A streamed reply that may call tools: each choice is decoded whole (its calls are
        known only at its end), then sent as OpenAI's chunks: role, content, one chunk per call."""
        done = await self.decoder.decode_each(request, self.asked, self.sampling_for)
        if done is None:
            return Response(status_code=499)
        decoded, headers = done
        replies = [generation.result for generation, _ in decoded]

        def chunk(index: int, delta: dict, finish: str | None = None, **more) -> str:
            return dumps(self.envelope([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}], **self.chunk_usage, **more))

        async def sse() -> AsyncIterator[str]:
            for index, r in enumerate(replies):
                message, finish = self.message_of(r)
                yield chunk(index, {"role": "assistant", "content": None})
                if message.get("content"):
                    yield chunk(index, {"content": message["content"]})
                for i, call in enumerate(message.get("tool_calls", [])):
                    yield chunk(index, {"tool_calls": [{"index": i, **call}]})
                yield chunk(index, {}, finish, timings=timings(r), **self.debug(index, *decoded[index]))
            if self.include_usage:
                yield self.usage_chunk(replies)
            yield "[DONE]"

        return event_stream(sse(), headers)

    def choice(self, index: int, text: str | None, finish: str | None, events: list[TokenEvent] = (), first: bool = False) -> dict:
        """One streamed chunk's choice: a text delta, the role first (chat), or the finish."""
        lp = self.probs(list(events)) if events else None
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        if first:
            delta = {"role": "assistant", "content": None}
        else:
            delta = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def _streamed(self, request: Request) -> Response:
        first_generation, headers = self.decoder.start(request, self.asked[0], self.sampling_for(0))
        envelope, choice, usage_null = self.envelope, self.choice, self.chunk_usage

        async def sse() -> AsyncIterator[str]:
            results = []
            for index, tokens in enumerate(self.asked):
                generation = first_generation if index == 0 else self.decoder.start(request, tokens, self.sampling_for(index))[0]
                if self.chat:
                    yield dumps(envelope([choice(index, None, None, first=True)], **usage_null))
                events: list[TokenEvent] = []
                try:
                    async for event in run_generation(generation):
                        if isinstance(event, PromptProgress):  # as llama-server sends it: an empty delta
                            empty = choice(index, None, None, first=True) if self.chat else choice(index, "", None)
                            yield dumps(envelope([empty], **usage_null, prompt_progress=asdict(event)))
                            continue
                        events.append(event)
                        more = {"timings": timings(generation.result)} if self.per_token else {}
                        yield dumps(envelope([choice(index, event.text, None, [event] if event.token_id >= 0 else ())], **usage_null, **more))
                except EngineError as exc:
                    yield stream_error(exc)
                    return
                finally:
                    account(request, generation.result)
                r = generation.result
                results.append(r)
                yield dumps(envelope([choice(index, None, openai_finish(r))], **usage_null, timings=timings(r), **self.debug(index, generation, events)))
            if self.include_usage:
                yield self.usage_chunk(results)
            yield "[DONE]"

        return event_stream(sse(), headers)
