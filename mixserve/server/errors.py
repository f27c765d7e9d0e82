"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, and their handlers."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# status -> OpenAI error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client: HTTP status, message, and the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for one status."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote client input, lone surrogates included."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# pydantic names the member of a union it tried ("str", "list[int]", "function-after[...]"): not a field
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|.*[\[\]-].*)$")


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "role")` -> "messages.0.role"; stops at a union member's name."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, str) and _UNION_MEMBER.match(p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return "The body is not valid JSON: " + str(first.get("ctx", {}).get("error", first.get("msg"))), None
    param = _param_of(tuple(first.get("loc", ())))
    msgs = []
    for err in errors[:5]:
        where = _param_of(tuple(err.get("loc", ()))) or "body"
        msgs.append(f"{where}: {err.get('msg')}")
    return "; ".join(msgs) or "Invalid request.", param


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI JSON; FastAPI's 422 becomes 400; nothing unexpected leaks a trace."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(400, f"The body is not valid JSON: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"Internal error: {type(exc).__name__}")
