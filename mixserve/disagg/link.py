"""The KV link: two processes (the prefill and the decode instance) over torch.distributed point-to-point.

Built directly (TCPStore + ProcessGroupGloo, as distributed/group.py does; no init_process_group, so
nothing global is left behind and one process may hold both ends, as the in-process tests do). The
prefill instance hosts the store at --kv-peer's HOST:PORT as rank 0; the decode instance connects as
rank 1. Two groups, one per direction ("down": prefill -> decode, "up": decode -> prefill), so a blocking
recv in one direction never waits behind a send in the other. Each side runs one receiver thread (it
blocks in recv on the incoming group) and one sender thread (it drains a queue onto the outgoing group),
so the engine's step thread never blocks on the network.

A message is a JSON header (its length as an int64 tensor, then its UTF-8 bytes as a uint8 tensor) and,
if the header says so, one tensor (shape and dtype in the header). JSON, not pickle: whoever reaches the
port must not be able to run code in the engine by sending a pickle.

Failure: a peer that dies closes its sockets, and gloo fails the pending recv at once ("Connection closed
by peer"); a peer that hangs (SIGSTOP, a stuck host) keeps its sockets open, so every sender also sends
a ping when it has had nothing to send for PING_S, and a receiver that hears nothing for SILENCE_S
(longer while a tensor comes in: MIN_BYTES_PER_S) declares the link dead. Either way `error` turns
non-None and stays so (a link is never reconnected: the engine that owns it dies, as a dead
tensor-parallel rank makes it, and a supervisor restarts the pair).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PING_S = 1.0  # a sender with nothing to send for this long sends a ping
SILENCE_S = 8.0  # a receiver that hears nothing (not even a ping) for this long: the peer is hung
# While a tensor comes in, the silence allowed grows by its size at this rate (pings queue behind it): a
# 4 GB payload (32k tokens of an 8B model) needs 32 s on 1 Gbit/s, and a healthy peer must not look hung.
MIN_BYTES_PER_S = 50e6
MAX_HEADER_BYTES = 64 << 20  # a JSON header (a prompt's ids) larger than this is not a peer of ours
RENDEZVOUS_TIMEOUT = timedelta(seconds=300)  # the other instance may still be loading its model
IDLE_TIMEOUT = timedelta(days=7)  # a receiver waits for the next message as long as it takes
PREFILL, DECODE = "prefill", "decode"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # KV dtypes

Handler = Callable[[dict[str, Any], torch.Tensor | None], None]


class PeerLostError(RuntimeError):
    """The other instance died, hung or closed the link. `permanent`: the server's step loop treats it as
    the engine's death (engine/supervision.py): in-flight requests fail, /health turns 503, it exits 1."""

    permanent = True


def one_line(exc: BaseException) -> str:
    """gloo's message without its source location and advice: 'Connection closed by peer [addr]:port'."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)
    return text.split(". This is typically")[0][:200]


def parse_peer(peer: str) -> tuple[str, int]:
    """'HOST:PORT' (an IPv6 host in brackets) -> (host, port); ValueError naming kv_peer otherwise."""
    host, sep, port = peer.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_peer: expected HOST:PORT, got {peer!r}")
    return host, int(port)


def local_address(host: str, port: int) -> str:
    """The address of this machine's interface that reaches host:port (the one gloo must listen on)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


class KVLink:
    """One end of the link. `connect` rendezvouses and exchanges `hello`s; `start` runs the threads."""

    def __init__(self, role: str, store: Any, up: Any, down: Any) -> None:
        self.role = role
        self.peer_role = DECODE if role == PREFILL else PREFILL
        self._store = store  # kept: the groups were built over it
        self._out, self._in = (down, up) if role == PREFILL else (up, down)
        self._peer_rank = 1 if role == PREFILL else 0
        self._queue: queue.Queue[tuple[dict[str, Any], torch.Tensor | None] | None] = queue.Queue()
        self._error: str | None = None
        self._closing = False
        self.last_heard = time.monotonic()
        self._transfer_s = 0.0  # extra silence allowed while a tensor is coming in
        self.peer_hello: dict[str, Any] = {}
        # The largest tensor this end accepts (0: none; the decode side sets its KV cache's size): the
        # header names the shape, and whoever reaches the port must not make us allocate without bound.
        self.max_tensor_bytes = 0

    @classmethod
    def connect(cls, role: str, host: str, port: int, hello: dict[str, Any],
                timeout: timedelta = RENDEZVOUS_TIMEOUT) -> KVLink:
        """Rendezvous with the other instance at host:port (the prefill one hosts the store there) and
        exchange `hello`s; ConnectionError (naming the address) if the other never comes."""
        if role not in (PREFILL, DECODE):
            raise ValueError(f"role: expected {PREFILL!r} or {DECODE!r}, got {role!r}")
        rank = 0 if role == PREFILL else 1
        try:
            store = dist.TCPStore(host, port, 2, rank == 0, timeout, wait_for_workers=False)
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, port))]
            opts._timeout = IDLE_TIMEOUT
            up = dist.ProcessGroupGloo(dist.PrefixStore("kv-up/", store), rank, 2, opts)
            down = dist.ProcessGroupGloo(dist.PrefixStore("kv-down/", store), rank, 2, opts)
        except (RuntimeError, OSError) as exc:  # DistStoreError (a timeout) is a RuntimeError
            raise ConnectionError(f"kv_peer {host}:{port}: no {'decode' if rank == 0 else 'prefill'} "
                                  f"instance within {timeout.total_seconds():.0f} s ({exc})") from None
        link = cls(role, store, up, down)
        mine = {"kind": "hello", **hello}
        if role == PREFILL:  # one order on both sides: a send may wait for the peer's matching recv
            link._send(mine, None)
            header, _ = link._recv()
        else:
            header, _ = link._recv()
            link._send(mine, None)
        link.peer_hello = {k: v for k, v in header.items() if k != "kind"}
        return link

    # ---- the two threads ------------------------------------------------------------------------

    def start(self, on_message: Handler) -> None:
        """Deliver every message but pings to `on_message` (on the receiver thread; it must not block)."""
        self.last_heard = time.monotonic()
        threading.Thread(target=self._receive_loop, args=(on_message,), daemon=True,
                         name=f"mixserve-kv-recv-{self.role}").start()
        threading.Thread(target=self._send_loop, daemon=True, name=f"mixserve-kv-send-{self.role}").start()

    def post(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        """Queue a message for the sender thread (never blocks); dropped once the link is dead."""
        if self._error is None:
            self._queue.put((header, tensor))

    @property
    def error(self) -> str | None:
        """Why the link is dead (the peer died, hung or left), or None while it works."""
        silent = time.monotonic() - self.last_heard
        if self._error is None and silent > SILENCE_S + self._transfer_s:
            self._fail(f"no word from the {self.peer_role} instance for {silent:.1f} s (hung?)")
        return self._error

    def close(self) -> None:
        """Tell the peer we leave (best effort) and stop the sender; the receiver ends with the peer."""
        if self._closing:
            return
        self._closing = True
        if self._error is None:
            self._queue.put(({"kind": "bye"}, None))
        self._queue.put(None)

    def _fail(self, why: str) -> None:
        if self._error is None:
            self._error = why
            if not self._closing:
                logger.error("the KV link to the %s instance is dead: %s", self.peer_role, why)
            self._queue.put(None)  # the sender stops

    def _receive_loop(self, on_message: Handler) -> None:
        while self._error is None:
            try:
                header, tensor = self._recv()
            except Exception as exc:  # the peer's sockets closed (it died), or our own group broke
                self._fail(f"the {self.peer_role} instance is gone ({one_line(exc)})")
                return
            self.last_heard = time.monotonic()
            kind = header.get("kind")
            if kind == "ping":
                continue
            if kind == "bye":
                self._fail(f"the {self.peer_role} instance closed the link")
                return
            try:
                on_message(header, tensor)
            except Exception:  # a bad message must not kill the link
                logger.exception("handling a %r message from the %s instance", kind, self.peer_role)

    def _send_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=PING_S)
            except queue.Empty:
                item = ({"kind": "ping"}, None)
            if item is None or self._error is not None:
                return
            try:
                self._send(*item)
            except Exception as exc:
                self._fail(f"the {self.peer_role} instance is gone (sending: {one_line(exc)})")
                return

    # ---- one message ---------------------------------------------------------------------------

    def _send(self, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            tensor = tensor.detach().to("cpu").contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            header = {**header, "shape": list(tensor.shape), "dtype": dtype}
        data = json.dumps(header).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._out.send([size], self._peer_rank, 0).wait()
        self._out.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], self._peer_rank, 0).wait()
        if tensor is not None:
            self._out.send([tensor], self._peer_rank, 0).wait()

    def _recv(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        size = torch.empty(1, dtype=torch.int64)
        self._in.recv([size], self._peer_rank, 0).wait()
        if not 0 < int(size.item()) <= MAX_HEADER_BYTES:
            raise ValueError(f"a message header of {int(size.item())} bytes (at most {MAX_HEADER_BYTES})")
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self._in.recv([buf], self._peer_rank, 0).wait()
        header = json.loads(buf.numpy().tobytes().decode())
        tensor = None
        if "shape" in header:
            shape, dtype = [int(n) for n in header["shape"]], DTYPES[header["dtype"]]
            nbytes = math.prod(shape) * dtype.itemsize
            if min(shape, default=1) < 0 or nbytes > self.max_tensor_bytes:
                raise ValueError(f"a {nbytes}-byte tensor {shape} (at most {self.max_tensor_bytes} here)")
            tensor = torch.empty(shape, dtype=dtype)
            self.last_heard, self._transfer_s = time.monotonic(), tensor.nbytes / MIN_BYTES_PER_S
            try:
                self._in.recv([tensor], self._peer_rank, 0).wait()
            finally:  # heard first, grace gone second: `error` on another thread never sees the transfer's
                self.last_heard = time.monotonic()  # whole length as silence
                self._transfer_s = 0.0
        return header, tensor
