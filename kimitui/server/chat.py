"""The one chat path every chat-shaped request goes through (OpenAI's chat completions,
Anthropic's Messages, OpenAI's Responses): the request checked and rendered into prompt tokens
and sampling (prepare_chat), then decoded whole (chat_whole) or as events (chat_events), its
tool calls read out of the reply where tools were offered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from kimitui.engine.generation import Generation, GenerationResult, PromptProgress, Sampling, TokenEvent
from kimitui.engine.interface import ServingEngine
from kimitui.engine.state import EngineError
from kimitui.server import tools as tool_calls
from kimitui.server.decoding import Decoder, account, run_generation
from kimitui.server.intake import Intake
from kimitui.server.params import ApiError, Fields, chat_messages, check_prefill, check_request_size, choices_of
from kimitui.server.shapes import openai_finish, stop_type


@dataclass
class ChatCall:
    """A chat request ready to decode (ChatPath.prepare_chat)."""

    tokens: list[int]
    sampling: Sampling
    calling: str | None  # the template's tool-call format, when the reply may call tools
    n: int  # choices


@dataclass
class ChatEvent:
    """What ChatPath.chat_events yields: "progress", "text" (a delta), "end" or "error"."""

    kind: str
    text: str = ""
    progress: PromptProgress | None = None
    result: GenerationResult | None = None
    calls: list[dict] = field(default_factory=list)  # at the end: the tool calls, OpenAI's shape
    finish: str = ""  # at the end: OpenAI's finish_reason
    stop_word: str = ""  # at the end: the stop string that ended it, if one did


def read_reply(r: GenerationResult, calling: str | None) -> tuple[str, list[dict], str]:
    """A chat reply's text, its tool calls (OpenAI's shape) and OpenAI's finish_reason."""
    if calling:
        content, calls = tool_calls.read_calls(r.text, calling)
        if calls:
            return content, calls, "length" if r.finish_reason == "length" else "tool_calls"
        return content, [], openai_finish(r)
    return r.text, [], openai_finish(r)


def tool_format(engine: ServingEngine) -> str:
    """The tool-call format of the chat template in use; a 400 where it has none."""
    form = tool_calls.tool_format(engine.template_text)
    if form is None:
        raise ApiError(
            f"tools: the chat template of {engine.model_path.name} has no Kimi K2 or K3 tool-call section, the "
            "formats kimitui reads (give one with --chat-template-file)"
        )
    return form


def offered_tools(engine: ServingEngine, fields: Fields) -> tuple[list[dict], Any, bool]:
    """The request's tools, its tool_choice, and whether a reply may call one (checked
    against the template's tool-call format)."""
    tools = tool_calls.tools_of(fields.body.get("tools"))
    choice = tool_calls.tool_choice_of(fields.body.get("tool_choice"), tools)
    calling = bool(tools) and choice != "none"
    if calling:
        tool_format(engine)
    return tools, choice, calling


@dataclass(eq=False)
class ChatPath:
    """A chat request's prompt made and its one reply decoded, for each API's routes to write in
    their own shape."""

    engine: ServingEngine
    intake: Intake
    decoder: Decoder

    async def prompt_length(self, fields: Fields) -> int:
        """The tokens of the prompt a chat request gives the model, tools included."""
        messages = chat_messages(fields.body.get("messages"))
        check_prefill(fields, messages)
        tools, _, calling = offered_tools(self.engine, fields)
        tokens, _ = await self.intake.chat_prompt(messages, tools if calling else None)
        return len(tokens)

    async def prepare_chat(self, request: Request, fields: Fields) -> ChatCall:
        """A chat request's prompt tokens and sampling, checked: what /v1/chat/completions takes,
        and what the Anthropic and Responses requests are turned into."""
        sampling = await self.intake.checked_sampling(request, fields, openai=True)
        n = choices_of(fields)
        check_request_size(self.intake.limits, n, sampling)
        messages = chat_messages(fields.body.get("messages"))
        check_prefill(fields, messages)
        tools, choice, calling = offered_tools(self.engine, fields)
        form = tool_format(self.engine) if calling else None
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
        tokens, template_stops = await self.intake.chat_tokens(messages, sampling.max_tokens, tools if calling else None)
        sampling.stop = tuple(dict.fromkeys(sampling.stop + template_stops))
        return ChatCall(tokens, sampling, form, n)

    async def chat_whole(self, request: Request, call: ChatCall) -> tuple[str, ChatEvent] | None:
        """One chat reply decoded whole: its text (tool calls read out) and its end event; None
        when the client left first."""
        done = await self.decoder.decode_each(request, [call.tokens], lambda _: call.sampling)
        if done is None:
            return None
        (generation, events), = done[0]
        request.state.headers = done[1]
        content, calls, finish = read_reply(generation.result, call.calling)
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
        generation, request.state.headers = self.decoder.start(request, call.tokens, call.sampling)

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
                account(request, generation.result)
            yield self._chat_end(generation, events, [], openai_finish(generation.result))

        return streamed()

    def _chat_end(self, generation: Generation, events: list[TokenEvent], calls: list[dict], finish: str) -> ChatEvent:
        ids = [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]
        _, word = stop_type(self.engine, generation.result, generation.sampling.stop, ids)
        return ChatEvent("end", result=generation.result, calls=calls, finish=finish, stop_word=word)
