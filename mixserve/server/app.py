"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine, plus /health and /metrics."""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from mixserve.engine.async_engine import AsyncEngine
from mixserve.metrics import ServerMetrics
from mixserve.server.errors import APIError, error_response, install_error_handlers
from mixserve.server.generation import collect, stream_events
from mixserve.server.openai_format import Formatter
from mixserve.server.preprocess import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_prompt,
    completion_prompt,
    context_limit,
    sampling_params,
    validate,
)
from mixserve.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                         (429, "Too many requests waiting"), (503, "The engine is not running"))
}

# documents the scheme in /openapi.json; the key itself is checked by require_key (absent: no error here)
_BEARER = Depends(HTTPBearer(auto_error=False))


class ServerState:
    """What the routes share: the engine, its metrics, the served model's name and the [server] limits."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str, api_key: str,
                 max_waiting: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.api_key = api_key
        self.max_waiting = max_waiting

    @property
    def llm(self) -> Any:
        return self.engine.llm

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            message = f"The model {model!r} does not exist; this server serves {self.model_name!r}."
            raise APIError(404, message, param="model", code="model_not_found")

    def admit(self) -> None:
        """Refuse before queueing: a dead engine (503) or too many requests waiting already (429)."""
        if not self.engine.healthy or not self.engine.accepting:
            raise APIError(503, "The engine is not running.")
        if self.engine.num_waiting() >= self.max_waiting:
            raise APIError(429, f"More than {self.max_waiting} requests are waiting; retry later.")


def create_app(engine: Any, server_cfg: Any = None, model_name: str | None = None, *,
               shutdown_timeout: float = 30.0) -> FastAPI:
    """The app over `engine` (an AsyncEngine, or an LLMEngine it wraps); `server_cfg` is a ServerConfig."""
    if not isinstance(engine, AsyncEngine):
        engine = AsyncEngine(engine, ServerMetrics())
    if engine.metrics is None:
        engine.metrics = ServerMetrics()
    if model_name is None:
        model_name = getattr(getattr(engine.llm, "runner", None), "model_name", None) or "mixserve"
    state = ServerState(engine, engine.metrics, model_name, getattr(server_cfg, "api_key", "") or "",
                        getattr(server_cfg, "max_waiting", 1024))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop(shutdown_timeout)

    app = FastAPI(title="mixserve", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible server over a chunked-prefill engine.")
    app.state.mixserve = state
    install_error_handlers(app)

    async def require_key(credentials: HTTPAuthorizationCredentials | None = _BEARER) -> None:
        if not state.api_key:
            return
        given = credentials.credentials if credentials is not None else ""
        # constant time, so the key cannot be guessed a byte at a time from response times
        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            raise APIError(401, "Missing or wrong API key (send 'Authorization: Bearer KEY').",
                           code="invalid_api_key")

    guarded = [Depends(require_key)]

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 when ready; 503 once the step loop has died, or while the server shuts down."""
        if not engine.healthy:
            return error_response(503, "The engine step loop died.")
        if not engine.accepting:
            return error_response(503, "The server is shutting down.")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format."""
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", dependencies=guarded, responses=ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "mixserve",
            "max_model_len": context_limit(state.llm),
        }]}

    @app.post("/v1/completions", dependencies=guarded, responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        state.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported.", param="echo")
        ids = completion_prompt(state.llm, body)
        params = sampling_params(state.llm, body, len(ids), max_tokens=body.max_tokens,
                                 default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                                 num_logprobs=body.logprobs)
        validate(state.llm, ids, params, "prompt")
        return await _generate(state, request, body, ids, params, chat=False,
                               want_logprobs=body.logprobs is not None, arrival=arrival)

    @app.post("/v1/chat/completions", dependencies=guarded, responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        state.check_model(body.model)
        ids = chat_prompt(state.llm, body)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(state.llm, body, len(ids), max_tokens=max_tokens, default_max_tokens=None,
                                 num_logprobs=num_logprobs)
        validate(state.llm, ids, params, "messages")
        return await _generate(state, request, body, ids, params, chat=True,
                               want_logprobs=body.logprobs, arrival=arrival)

    return app


async def _generate(state: ServerState, request: Request, body: Any, ids: list[int], params: Any, *,
                    chat: bool, want_logprobs: bool, arrival: float) -> Response:
    state.admit()
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    fmt = Formatter(request_id, state.model_name, chat, state.llm.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = stream_events(state.engine, fmt, ids, params, arrival=arrival, include_usage=include_usage,
                               want_logprobs=want_logprobs)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await collect(state.engine, request, fmt, ids, params, arrival=arrival,
                         want_logprobs=want_logprobs)
