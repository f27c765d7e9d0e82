"""mixserve/bench/lean_http.py: the three framings, lines split anywhere, and one-line failures."""

from __future__ import annotations

import asyncio

import pytest

from mixserve.bench.lean_http import ProtocolError, StreamedPost
from tests.bench.fake_http import FakeServer, Reply


def exchange(reply: Reply, read: str = "lines", timeout_s: float = 10.0):
    """POST {"a": 1} to a server answering `reply`: (status, the body as read, the body the server got)."""
    got = []

    async def handler(method: str, path: str, body) -> Reply:
        got.append((method, path, body))
        return reply

    async def go():
        async with FakeServer(handler) as srv:
            async with StreamedPost(srv.url + "/v1/x?q=1", {"a": 1}, timeout_s) as resp:
                out = [x async for x in resp.lines()] if read == "lines" else await resp.text()
                return resp.status, out

    status, out = asyncio.run(go())
    return status, out, got


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
def test_lines_split_across_pieces_come_back_whole_in_every_framing(framing: str) -> None:
    pieces = [b"data: one\r", b"\n\r\nda", b"ta: t", b"wo\n\n", b"last, unterminated"]
    status, lines, got = exchange(Reply(200, pieces, framing))
    assert status == 200 and got == [("POST", "/v1/x?q=1", {"a": 1})]
    assert lines == ["data: one", "", "data: two", "", "last, unterminated"]


def test_text_reads_an_error_answer_whole() -> None:
    status, text, _ = exchange(Reply(404, [b'{"error": ', b'"no such model"}'], "length"), read="text")
    assert status == 404 and text == '{"error": "no such model"}'


def test_chunk_extensions_and_trailers_are_skipped() -> None:
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5;ext=1\r\nab\ncd\r\n3\r\ne\nf\r\n0\r\nX-Trailer: 1\r\n\r\n")
    status, lines, _ = exchange(Reply(raw=raw))
    assert status == 200 and lines == ["ab", "cde", "f"]


def test_an_answer_that_is_not_http_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="status line"):
        exchange(Reply(raw=b"SSH-2.0-OpenSSH\r\n\r\n"))


def test_a_bad_chunk_size_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="chunk size"):
        exchange(Reply(raw=b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"))


def test_a_body_cut_short_is_an_eof_error() -> None:
    with pytest.raises(EOFError):
        exchange(Reply(raw=b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"), read="text")


def test_a_server_gone_silent_times_out() -> None:
    async def silence():
        yield b"data: 1\n"
        await asyncio.Event().wait()

    with pytest.raises(TimeoutError):
        exchange(Reply(200, silence()), timeout_s=0.2)


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http"):
        StreamedPost("ftp://h/x", {})
