"""Run one request on the AsyncEngine: as a stream of server-sent events, or collected into one answer.

Either way a client that goes away aborts its request at once (its KV blocks are freed between steps).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mixserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from mixserve.server.errors import error_body, error_response
from mixserve.server.openai_format import DONE, Choice, Formatter, Usage, sse, token_logprobs


def _failure(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, RequestFailedError):
        return 400, f"The engine refused the request: {exc}"
    return 503, str(exc)


class EngineStreamResponse(StreamingResponse):
    """Server-sent events of one submitted request; however the response ends (finished, client gone,
    cancelled before its first byte), the request is closed, so an unfinished one is aborted."""

    def __init__(self, stream: RequestStream, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()


async def stream_events(stream: RequestStream, fmt: Formatter, num_prompt_tokens: int, *,
                        include_usage: bool, want_logprobs: bool, continuous_usage: bool = False,
                        num_choices: int = 1) -> AsyncIterator[str]:
    """SSE lines `data: {...}` ending `data: [DONE]`; an error mid-stream is an error event, then [DONE].
    `continuous_usage`: every chunk carries the usage so far (vLLM's `continuous_usage_stats`).

    When the client disconnects this generator is cancelled; EngineStreamResponse closes the stream.
    """
    usage = Usage(num_prompt_tokens)  # the prompt counts once, however many choices share it
    if fmt.chat:
        for index in range(num_choices):
            yield sse(fmt.role_chunk(usage if continuous_usage else None, index))
    try:
        async for update in stream:
            usage.completion_tokens += len(update.new_token_ids)
            lp = token_logprobs(update) if want_logprobs else None
            finish = update.finish_reason if update.finished else None
            # one chunk per step that made a token, even if its text is held back (an unfinished UTF-8
            # character, a possible stop string): clients time tokens by chunks
            if update.new_token_ids or update.new_text or finish is not None:
                yield fmt.delta_event(update.new_text, finish, lp, usage if continuous_usage else None,
                                      update.index)
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


async def _collect(stream: RequestStream, fmt: Formatter, num_prompt_tokens: int, *,
                   want_logprobs: bool, num_choices: int) -> dict[str, Any]:
    usage = Usage(num_prompt_tokens)  # the prompt counts once; completion tokens of every choice add up
    choices = [Choice(logprobs=[] if want_logprobs else None) for _ in range(num_choices)]
    async for update in stream:
        usage.completion_tokens += len(update.new_token_ids)
        choice = choices[update.index]
        choice.texts.append(update.new_text)
        if choice.logprobs is not None:
            choice.logprobs.extend(token_logprobs(update))
        if update.finished:
            choice.finish_reason = update.finish_reason
    return fmt.response(choices, usage)


async def collect(stream: RequestStream, request: Request, fmt: Formatter, num_prompt_tokens: int, *,
                  want_logprobs: bool, num_choices: int = 1) -> Response:
    """The whole answer as one JSON body, aborting the request if the client disconnects first."""
    work = asyncio.create_task(_collect(stream, fmt, num_prompt_tokens, want_logprobs=want_logprobs,
                                        num_choices=num_choices))
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
        stream.close()  # aborts the request unless it finished
    if work.cancelled():
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    exc = work.exception()
    if isinstance(exc, (EngineDeadError, RequestFailedError)):
        return error_response(*_failure(exc))
    if exc is not None:
        raise exc
    return JSONResponse(work.result())
