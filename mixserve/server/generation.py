"""Run one request on the AsyncEngine: as a stream of server-sent events, or collected into one answer.

Either way a client that goes away aborts its request at once (its KV blocks are freed between steps).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mixserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from mixserve.server.errors import error_body, error_response
from mixserve.server.openai_format import DONE, Formatter, TokenLogprob, Usage, sse, token_logprobs


def _failure(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, RequestFailedError):
        return 400, f"The engine refused the request: {exc}"
    return 503, str(exc)


async def stream_events(engine: AsyncEngine, fmt: Formatter, ids: list[int], params: Any, *, arrival: float,
                        include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
    """SSE lines `data: {...}` ending `data: [DONE]`; an error mid-stream is an error event, then [DONE]."""
    usage = Usage(len(ids))
    if fmt.chat:
        yield sse(fmt.role_chunk())
    try:
        # aclosing: when the client disconnects this generator is cancelled, and closing the engine's
        # generator right away aborts the request
        async with contextlib.aclosing(engine.generate(fmt.id, ids, params, arrival)) as updates:
            async for update in updates:
                usage.completion_tokens += len(update.new_token_ids)
                lp = token_logprobs(update) if want_logprobs else None
                finish = update.finish_reason if update.finished else None
                # one chunk per step that made a token, even if its text is held back (an unfinished UTF-8
                # character, a possible stop string): clients time tokens by chunks
                if update.new_token_ids or update.new_text or finish is not None:
                    yield sse(fmt.delta_chunk(update.new_text, finish, lp))
    except (EngineDeadError, RequestFailedError) as exc:
        status, message = _failure(exc)
        yield sse(error_body(status, message))
    if include_usage:
        yield sse(fmt.usage_chunk(usage))
    yield DONE


async def _wait_for_disconnect(request: Request) -> None:
    # the body is read already: the next ASGI message is http.disconnect, when the client leaves
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(engine: AsyncEngine, fmt: Formatter, ids: list[int], params: Any, *, arrival: float,
                   want_logprobs: bool) -> dict[str, Any]:
    usage = Usage(len(ids))
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    finish = None
    async with contextlib.aclosing(engine.generate(fmt.id, ids, params, arrival)) as updates:
        async for update in updates:
            usage.completion_tokens += len(update.new_token_ids)
            texts.append(update.new_text)
            if want_logprobs:
                logprobs.extend(token_logprobs(update))
            if update.finished:
                finish = update.finish_reason
    return fmt.response("".join(texts), finish, usage, logprobs if want_logprobs else None)


async def collect(engine: AsyncEngine, request: Request, fmt: Formatter, ids: list[int], params: Any, *,
                  arrival: float, want_logprobs: bool) -> Response:
    """The whole answer as one JSON body, aborting the request if the client disconnects first."""
    work = asyncio.create_task(_collect(engine, fmt, ids, params, arrival=arrival,
                                        want_logprobs=want_logprobs))
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # cancelling `work` closes the engine's generator, which aborts the request
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    exc = work.exception()
    if isinstance(exc, (EngineDeadError, RequestFailedError)):
        return error_response(*_failure(exc))
    if exc is not None:
        raise exc
    return JSONResponse(work.result())
