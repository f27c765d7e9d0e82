"""The checks every request passes before any work is done on it: Host, body size, API key, body time.

A pure ASGI middleware, so each check runs on the headers alone: a 200 MB body with a Content-Length
over `max_body_bytes` gets its 413 before a byte of it is read, a request without the key its 401
before its body is parsed, and a body sent without Content-Length (chunked) is cut at the limit.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException

from mixserve.server.errors import error_body

GUARDED_PREFIX = "/v1/"  # the API routes; /health, /metrics and the docs stay open


@dataclass(frozen=True)
class GuardConfig:
    max_body_bytes: int = 2 * 1024 * 1024  # TGI's payload limit
    api_key: str = ""
    loopback_only: bool = False  # bound to loopback: refuse other Host names (DNS rebinding)
    body_timeout_s: float = 30.0  # a body not sent in full by then is a 408


def is_loopback_host(host: str) -> bool:
    """True for a loopback address or name (an empty bind host means every interface: False)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """`example.com:8000` -> `example.com`; `[::1]:8000` -> `[::1]`."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """ASGI middleware: Host, Content-Length and key checks first; then the body read under limits."""

    def __init__(self, app: Any, config: GuardConfig) -> None:
        self.app = app
        self.cfg = config

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _send_error(send, *refusal)
            return
        await self.app(scope, self._bounded(receive), send)

    def _refusal(self, scope: dict, headers: dict[str, str]) -> tuple[int, str, dict[str, str]] | None:
        cfg = self.cfg
        if cfg.loopback_only and not is_loopback_host(_host_name(headers.get("host", ""))):
            return 403, (f"Host {headers.get('host', '')!r} is not a loopback name; this server listens "
                         "on loopback only"), {}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > cfg.max_body_bytes:
            return 413, f"The body ({int(length)} bytes) is over the limit of {cfg.max_body_bytes} bytes.", {}
        if cfg.api_key and scope["path"].startswith(GUARDED_PREFIX):
            auth = headers.get("authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            # constant time, so the key cannot be guessed a byte at a time from response times
            if not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
                return 401, "Missing or wrong API key (send 'Authorization: Bearer KEY').", {
                    "www-authenticate": "Bearer"}
        return None

    def _bounded(self, receive: Any) -> Any:
        """`receive` that counts body bytes (413 past the limit) and times the body out (408)."""
        limit, timeout = self.cfg.max_body_bytes, self.cfg.body_timeout_s
        state = {"read": 0, "more": True, "deadline": time.monotonic() + timeout}

        async def bounded_receive() -> dict:
            if not state["more"]:
                return await receive()  # the body is in: what follows is the disconnect, never timed
            left = state["deadline"] - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except TimeoutError:
                raise HTTPException(408, f"The body was not sent in full within {timeout:g} s.") from None
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                state["more"] = bool(message.get("more_body", False))
                if state["read"] > limit:
                    raise HTTPException(413, f"The body is over the limit of {limit} bytes.")
            else:
                state["more"] = False
            return message

        return bounded_receive


async def _send_error(send: Any, status: int, message: str, headers: dict[str, str]) -> None:
    code = {401: "invalid_api_key", 403: "host_not_allowed"}.get(status)
    body = json.dumps(error_body(status, message, None, code), ensure_ascii=True).encode("ascii")
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close"), *((k.encode(), v.encode()) for k, v in headers.items())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
