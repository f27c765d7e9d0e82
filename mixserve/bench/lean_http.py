"""A lean HTTP/1.1 client for the load client's streamed POSTs, on asyncio streams.

Why not httpx, which the bench still uses for its few plain GETs: the bench shares the server's cores, and
every microsecond it spends reading tokens is taken from the server's steps (their OpenMP barrier waits for
the thread that lost its core); httpx costs several times this client's CPU per streamed event
(docs/decisions/sharing-cores-with-the-server.md). It does what a completion stream needs and no more: http
and https, a JSON body, a response framed by Content-Length, chunked transfer encoding or the connection's
end, and one connection per request (`Connection: close`: nothing to pool, and a server sees a client leave at
once).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from types import TracebackType
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 * 1024


class ProtocolError(ValueError):
    """The server's answer is not HTTP/1.x as this client reads it."""


class StreamedPost:
    """POST a JSON body and read the answer as it comes: `async with StreamedPost(url, body) as resp`, then
    `resp.status`, and `resp.lines()` (text lines as they arrive) or `await resp.text()`.

    `timeout_s` bounds the connection's setup and each wait for more of the answer (not the whole answer:
    a stream may run for minutes); a timeout raises TimeoutError, a refused or broken connection OSError or
    EOFError, an answer that is not HTTP ProtocolError.
    """

    def __init__(self, url: str, body: dict, timeout_s: float = 600.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host, self.tls = parts.hostname, parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.netloc = parts.netloc
        self.payload = json.dumps(body).encode()
        self.timeout_s = timeout_s
        self.status = 0
        self.headers: dict[str, str] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> StreamedPost:
        async with asyncio.timeout(min(self.timeout_s, CONNECT_TIMEOUT_S)):
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, ssl=ssl.create_default_context() if self.tls else None,
                limit=MAX_HEAD_BYTES)
        head = (f"POST {self.target} HTTP/1.1\r\nHost: {self.netloc}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(self.payload)}\r\n"
                "Connection: close\r\n\r\n")
        self._writer.write(head.encode("latin-1") + self.payload)
        async with asyncio.timeout(self.timeout_s):
            await self._writer.drain()
            raw = await self._reader.readuntil(b"\r\n\r\n")
        status_line, *fields = raw.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        self.status = int(rest[:3])
        for field in fields:
            name, sep, value = field.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._writer is not None:
            self._writer.close()  # no wait_closed: the peer's goodbye is not worth a cancelled run's time

    async def _read(self, coro_fn, *args) -> bytes:
        async with asyncio.timeout(self.timeout_s):
            return await coro_fn(*args)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as the framing delivers it."""
        reader = self._reader
        assert reader is not None, "use StreamedPost in `async with`"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await self._read(reader.readuntil, b"\r\n")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:  # the last chunk; trailers (if any) end at an empty line
                    while await self._read(reader.readuntil, b"\r\n") != b"\r\n":
                        pass
                    return
                piece = await self._read(reader.readexactly, size + 2)
                yield piece[:-2]
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                piece = await self._read(reader.read, min(left, 65536))
                if not piece:
                    raise EOFError(f"the connection ended {left} bytes before the body's end")
                left -= len(piece)
                yield piece
        else:  # the body runs to the connection's end
            while piece := await self._read(reader.read, 65536):
                yield piece

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line ends (a last unterminated one too)."""
        buf = b""
        async for piece in self.pieces():
            buf += piece
            if b"\n" not in piece:
                continue
            *done, buf = buf.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if buf:
            yield buf.rstrip(b"\r").decode("utf-8", errors="replace")

    async def text(self) -> str:
        return b"".join([p async for p in self.pieces()]).decode("utf-8", errors="replace")
