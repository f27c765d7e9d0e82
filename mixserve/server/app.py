"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine, plus /health and /metrics."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPBearer

from mixserve.config import ServerConfig
from mixserve.engine.async_engine import AsyncEngine, EngineBusyError, EngineDeadError, RequestStream
from mixserve.engine.sampling_params import SamplingParams
from mixserve.engine.served_model import ServedModel
from mixserve.metrics import ServerMetrics
from mixserve.server.errors import APIError, error_response, install_error_handlers
from mixserve.server.generation import EngineStreamResponse, collect, stream_events
from mixserve.server.guard import GuardConfig, RequestGuard, is_loopback_host
from mixserve.server.openai_format import Formatter
from mixserve.server.preprocess import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_prompt,
    completion_prompt,
    refuse_unsupported,
    sampling_params,
    validate,
)
from mixserve.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, SamplingFields

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                         (403, "Host not allowed"), (408, "Body not sent in time"), (413, "Body too large"),
                         (429, "Too many requests waiting"), (503, "The engine is not running"))
}
# a generation answers JSON, or server-sent events when the request says "stream": true. Before OpenAPI 3.2
# (FastAPI writes 3.1) an event stream's `schema` describes one event, as schemathesis checks it (ST108)
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] last"},
                            "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}}}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {**ERROR_RESPONSES, 200: {
    "description": "The answer; with stream = true, server-sent events ending `data: [DONE]`",
    "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}}}}
RETRY_AFTER_S = 1  # the 429's Retry-After: a step or two frees a place in the queue

# documents the scheme in /openapi.json; the key itself is checked by RequestGuard, before the body is read
_BEARER = Depends(HTTPBearer(auto_error=False))


@dataclass
class ServerState:
    """What the routes share: the engine, its metrics, the served model's names and the [server] limits."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_names: list[str]  # the first is the one answers name when a request names none
    max_waiting: int

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def model(self) -> ServedModel:
        return self.engine.model

    def check_model(self, model: str | None) -> str:
        """The name to answer with: the request's own alias (as vLLM), or the first name."""
        if model is None:
            return self.model_name
        if model not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise APIError(404, f"The model {model!r} does not exist; this server serves {served}.",
                           param="model", code="model_not_found")
        return model

    def refuse_early(self) -> None:
        """Before tokenizing: a request that would be refused anyway is refused now, without the work.
        (Only a shortcut: `submit` is the atomic check.)"""
        if not self.engine.healthy or not self.engine.accepting:
            raise APIError(503, "The engine is not running.")
        if self.engine.num_waiting() >= self.max_waiting:
            raise _busy(f"{self.engine.num_waiting()} requests are waiting already")

    def submit(self, request_id: str, ids: list[int], params: SamplingParams,
               arrival: float) -> RequestStream:
        """Queue the request, or refuse it: a dead or stopping engine (503), a full queue (429)."""
        try:
            return self.engine.submit(request_id, ids, params, arrival, max_waiting=self.max_waiting)
        except EngineBusyError as exc:
            raise _busy(str(exc)) from None
        except EngineDeadError as exc:
            raise APIError(503, f"The engine is not running: {exc}") from None


def _busy(why: str) -> APIError:
    return APIError(429, f"Too many requests are waiting ({why}); retry later.",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def create_app(engine: AsyncEngine, server_cfg: ServerConfig | None = None, *,
               shutdown_timeout: float = 30.0) -> FastAPI:
    """The app over `engine`; `server_cfg` the [server] table (None: its defaults). The server reads the
    model through `engine.model` and queues through `engine.submit`, never touching the LLMEngine.

    Bound to a loopback host (the default 127.0.0.1), the app answers only Host names of loopback: a web
    page cannot reach it through DNS rebinding (vLLM and TGI do not check this).
    """
    cfg = server_cfg if server_cfg is not None else ServerConfig()
    if engine.metrics is None:
        engine.metrics = ServerMetrics()
    names = list(cfg.served_model_name) or [engine.model.name]  # --served-model-name: aliases, as vLLM
    state = ServerState(engine, engine.metrics, names, cfg.max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop(shutdown_timeout)

    app = FastAPI(title="mixserve", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible server over a chunked-prefill engine.")
    app.state.mixserve = state
    install_error_handlers(app)
    app.add_middleware(RequestGuard, config=GuardConfig(
        max_body_bytes=cfg.max_body_bytes, api_key=cfg.api_key, loopback_only=is_loopback_host(cfg.host),
        body_timeout_s=cfg.body_timeout_s))
    guarded = [_BEARER] if cfg.api_key else []  # the schema documents the key only where one is asked

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 when ready; 503 once the engine has died, or while the server shuts down. HEAD works too."""
        if not engine.healthy:
            return error_response(503, f"The engine is dead: {engine.error!r}")
        if not engine.accepting:
            return error_response(503, "The server is shutting down.")
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        """Prometheus text format."""
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", dependencies=guarded, responses=ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "mixserve",
            "max_model_len": state.model.context_limit,
        } for name in state.model_names]}

    @app.post("/v1/completions", dependencies=guarded, responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        name = state.check_model(body.model)
        refuse_unsupported(body)
        state.refuse_early()
        if body.echo:
            raise APIError(400, "echo is not supported.", param="echo")
        ids = await completion_prompt(state.model, body)
        params = sampling_params(state.model, body, len(ids), max_tokens=body.max_tokens,
                                 default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                                 num_logprobs=body.logprobs)
        await validate(state.model, ids, params, "prompt")
        return await _generate(state, request, body, ids, params, name, chat=False,
                               want_logprobs=body.logprobs is not None, arrival=arrival)

    @app.post("/v1/chat/completions", dependencies=guarded, responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        name = state.check_model(body.model)
        refuse_unsupported(body)
        state.refuse_early()
        ids = await chat_prompt(state.model, body)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(state.model, body, len(ids), max_tokens=max_tokens, default_max_tokens=None,
                                 num_logprobs=num_logprobs)
        await validate(state.model, ids, params, "messages")
        return await _generate(state, request, body, ids, params, name, chat=True,
                               want_logprobs=body.logprobs, arrival=arrival)

    return app


async def _generate(state: ServerState, request: Request, body: SamplingFields, ids: list[int],
                    params: SamplingParams, name: str, *, chat: bool, want_logprobs: bool,
                    arrival: float) -> Response:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    fmt = Formatter(request_id, name, chat, state.model.tokenizer)
    stream = state.submit(request_id, ids, params, arrival)  # from here on, whoever ends must close it
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and body.stream_options.continuous_usage_stats  # as vLLM: needs both
        events = stream_events(stream, fmt, len(ids), include_usage=include_usage,
                               want_logprobs=want_logprobs, continuous_usage=continuous, num_choices=params.n)
        return EngineStreamResponse(stream, events)
    return await collect(stream, request, fmt, len(ids), want_logprobs=want_logprobs, num_choices=params.n)
