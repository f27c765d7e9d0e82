"""A fake HTTP/1.1 server on 127.0.0.1, inside the test's event loop, for the load client's tests.

A handler gets (method, path, JSON body or None) and returns a Reply: a status and the body's pieces,
sent with the framing asked for (chunked, Content-Length or to the connection's end), each piece flushed
on its own so the client sees them arrive apart. Pieces may come from an async iterator (a stream that
stops mid-way). On exit every connection still open is closed and its handler cancelled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class Reply:
    status: int = 200
    pieces: Iterable[bytes] | AsyncIterator[bytes] = ()
    framing: str = "chunked"  # "chunked" | "length" | "close"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream"})
    raw: bytes | None = None  # sent as is instead of an HTTP answer (a server that is not HTTP)


Handler = Callable[[str, str, object], Awaitable[Reply]]


def json_reply(status: int, obj: object) -> Reply:
    return Reply(status, [json.dumps(obj).encode()], "length", {"content-type": "application/json"})


def sse(events: list[dict], done: bool = True) -> list[bytes]:
    """Each event as its own `data:` piece, then `data: [DONE]`."""
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + ([b"data: [DONE]\n\n"] if done else [])


class FakeServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> FakeServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            fields = dict(f.split(":", 1) for f in head[1:] if ":" in f)
            length = int(next((v for k, v in fields.items() if k.strip().lower() == "content-length"), 0))
            body = json.loads(await reader.readexactly(length)) if length else None
            reply = await self.handler(method, path, body)
            await self._send(reply, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client left
        finally:
            writer.close()
            self._tasks.discard(task)

    @staticmethod
    async def _send(reply: Reply, writer: asyncio.StreamWriter) -> None:
        if reply.raw is not None:
            writer.write(reply.raw)
            await writer.drain()
            return
        pieces = reply.pieces
        if reply.framing == "length":
            pieces = [b"".join(pieces)]  # type: ignore[arg-type]
        head = [f"HTTP/1.1 {reply.status} X", *(f"{k}: {v}" for k, v in reply.headers.items())]
        if reply.framing == "chunked":
            head.append("Transfer-Encoding: chunked")
        elif reply.framing == "length":
            head.append(f"Content-Length: {len(pieces[0])}")  # type: ignore[index]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()

        async def each() -> AsyncIterator[bytes]:
            if hasattr(pieces, "__aiter__"):
                async for p in pieces:  # type: ignore[union-attr]
                    yield p
            else:
                for p in pieces:  # type: ignore[union-attr]
                    yield p

        async for piece in each():
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if reply.framing == "chunked" else piece)
            await writer.drain()
        if reply.framing == "chunked":
            writer.write(b"0\r\n\r\n")
            await writer.drain()
