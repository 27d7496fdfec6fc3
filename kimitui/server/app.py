"""The HTTP API: llama-server's, OpenAI's and Anthropic's routes over one shared engine.

Each set of routes is handed only what it uses: the engine (engine/interface.py's
ServingEngine), the request intake, the decoder that gives each reply its turn, and the one chat
path every chat-shaped request goes through (chat.py). The engine's TurnQueue serves requests
first come first served, API and TUI alike, so the app never decodes two replies at once and
never needs a lock of its own.
"""

from __future__ import annotations

from typing import Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from kimitui.config import Settings
from kimitui.engine.interface import ServingEngine
from kimitui.server.anthropic import AnthropicRoutes
from kimitui.server.chat import ChatPath
from kimitui.server.decoding import QUEUE_HEADER, Decoder
from kimitui.server.errors import EXCEPTION_HANDLERS
from kimitui.server.guard import LOOPBACK_ORIGINS, Guard, OriginCheck
from kimitui.server.intake import Intake, limits_of
from kimitui.server.native_routes import CompletionRoute, SlotRoutes, StatusRoutes, TextRoutes
from kimitui.server.openai_routes import OpenAIRoutes
from kimitui.server.responses import ResponsesRoutes


def _routes(engine: ServingEngine, settings: Settings) -> list[Route]:
    """Every route, each set of them built over what it uses."""
    limits = limits_of(settings)
    intake, decoder = Intake(engine, limits), Decoder(engine)
    chat = ChatPath(engine, intake, decoder)
    aliases = sorted({a.strip() for a in settings["server.alias"].split(",") if a.strip()})
    # The first alias in alphabetical order, as llama-server names a model with several.
    model_id = aliases[0] if aliases else engine.model_path.name
    completion = CompletionRoute(engine, intake, decoder, model_id)
    text = TextRoutes(engine)
    status = StatusRoutes(engine, limits)
    slots = SlotRoutes(engine, settings["server.slots_endpoint"], settings["server.slot_save_path"])
    openai = OpenAIRoutes(
        engine, intake, decoder, chat, model_id=model_id, aliases=aliases, tags=list(settings["server.tags"]),
        verbose=settings["server.verbose"],
    )
    anthropic = AnthropicRoutes(engine, chat, model_id)
    responses = ResponsesRoutes(engine, chat, model_id)
    post, get = ["POST"], ["GET"]
    return [
        Route("/health", status.health, methods=get),
        Route("/completion", completion.completion, methods=post),
        Route("/tokenize", text.tokenize, methods=post),
        Route("/detokenize", text.detokenize, methods=post),
        Route("/apply-template", text.apply_template, methods=post),
        Route("/props", status.props, methods=get),
        Route("/slots", slots.slots, methods=get),
        Route("/slots/{id_slot}", slots.slot_action, methods=post),
        Route("/metrics", status.metrics, methods=get),
        Route("/v1/models", openai.models, methods=get),
        Route("/v1/completions", openai.completions, methods=post),
        Route("/v1/chat/completions", openai.chat_completions, methods=post),
        Route("/v1/chat/completions/input_tokens", openai.chat_input_tokens, methods=post),
        Route("/chat/completions/input_tokens", openai.chat_input_tokens, methods=post),
        # llama-server's aliases, for clients configured with a base URL without /v1.
        Route("/models", openai.models, methods=get),
        Route("/completions", completion.completion, methods=post),  # llama-server's own, as there
        Route("/chat/completions", openai.chat_completions, methods=post),
        Route("/v1/health", status.health, methods=get),
        Route("/v1/messages", anthropic.messages, methods=post),
        Route("/v1/responses", responses.respond, methods=post),
        Route("/responses", responses.respond, methods=post),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=post),
    ]


def create_app(
    engine: ServingEngine,
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
    key = settings["server.api_key"] if api_key is None else api_key
    origins = frozenset(settings["server.cors_origins"])
    return Starlette(
        routes=_routes(engine, settings),
        middleware=[
            Middleware(
                OriginCheck, bind_host=settings["server.host"] if bind_host is None else bind_host, allowed_hosts=frozenset(h.lower() for h in settings["server.allowed_hosts"]),
                cors_origins=origins, on_request=on_request,
            ),
            # Preflights of allowed origins end here, before the key check (browsers send none).
            Middleware(
                CORSMiddleware, allow_origins=sorted(origins - {"localhost"}),
                allow_origin_regex=LOOPBACK_ORIGINS if "localhost" in origins else None, allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version", "Anthropic-Beta",
                               "Anthropic-Dangerous-Direct-Browser-Access"], expose_headers=[QUEUE_HEADER], max_age=600,
            ),
            Middleware(Guard, api_key=key or None, max_body=settings["server.max_body"]),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
    )
