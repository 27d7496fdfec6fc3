"""Errors as JSON: llama-server's (OpenAI's) shape, or Anthropic's on its routes, for every
way a request fails (ApiError, Starlette's 404 and 405, a bug)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kimitui.server.params import ApiError

# Anthropic's error types, by HTTP status (its SDK raises the matching exception class).
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(status: int, kind: str, message: str, headers: dict | None = None, path: str = "", **extra) -> JSONResponse:
    """An error as JSON: llama-server's (OpenAI's) shape, or Anthropic's on its routes."""
    if is_anthropic(path):
        return JSONResponse(anthropic_error_body(status, message), status, headers=headers)
    return JSONResponse({"error": {"code": status, "type": kind, "message": message, **extra}}, status, headers=headers)


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


EXCEPTION_HANDLERS = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
