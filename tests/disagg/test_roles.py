"""The keys of a disaggregated pair: what `serve` refuses before loading anything, and the layout check."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from mixserve.config import EngineConfig, RuntimeConfig, ServerConfig, load_config
from mixserve.disagg import link as link_module
from mixserve.disagg.kv_blocks import check_peer, num_full_blocks
from mixserve.disagg.link import DECODE, SILENCE_S, KVLink, one_line, parse_peer
from mixserve.disagg.roles import check_role


def config(engine: EngineConfig | None = None, **server: object) -> RuntimeConfig:
    return RuntimeConfig(engine or EngineConfig(), ServerConfig(**server))


@pytest.mark.parametrize(("cfg", "message"), [
    (config(role="decode"), "needs kv_peer"),
    (config(kv_peer="127.0.0.1:9000"), "only with role prefill or decode"),
    (config(role="prefill", kv_peer="nohost"), "kv_peer: expected HOST:PORT"),
    (config(EngineConfig(tensor_parallel_size=2), role="decode", kv_peer="127.0.0.1:1"), "tensor_parallel"),
    (config(EngineConfig(enable_prefix_caching=False), role="prefill", kv_peer="h:2"), "prefix_caching"),
])
def test_a_pair_that_cannot_work_is_refused_naming_the_key(cfg: RuntimeConfig, message: str):
    with pytest.raises(ValueError, match=message):
        check_role(cfg)


def test_both_needs_nothing_and_the_keys_load_from_flags():
    check_role(config())
    cfg = load_config(None, {"server": {"role": "decode", "kv_peer": "[::1]:9000", "kv_peer_min_tokens": 64}})
    assert (cfg.server.role, parse_peer(cfg.server.kv_peer), cfg.server.kv_peer_min_tokens) == (
        "decode", ("::1", 9000), 64)


def test_serve_exits_2_on_a_role_without_a_peer():
    r = subprocess.run([sys.executable, "-m", "mixserve", "serve", "--role", "prefill"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "needs kv_peer" in r.stderr


def test_two_ends_must_share_model_and_layout():
    mine = {"model": "m", "vocab_size": 10, "block_size": 16, "num_layers": 2, "num_kv_heads": 1,
            "head_dim": 8, "dtype": "float32"}
    check_peer(mine, dict(mine))
    with pytest.raises(ValueError, match="block_size 16 here, 32 there; dtype"):
        check_peer(mine, {**mine, "block_size": 32, "dtype": "bfloat16"})


def test_what_is_handed_over_and_how_a_gloo_error_reads():
    assert [num_full_blocks(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]  # never the last token's
    exc = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5. This is "
                       "typically caused by a remote worker crashing.")
    assert one_line(exc) == "Connection closed by peer [127.0.0.1]:5"


class _Incoming:
    """A link's incoming group: hands out one header, then blocks in its tensor until `release` is set."""

    def __init__(self, header: dict) -> None:
        data = json.dumps(header).encode()
        self.parts = [torch.tensor([len(data)]), torch.frombuffer(bytearray(data), dtype=torch.uint8)]
        self.receiving, self.release = threading.Event(), threading.Event()

    def recv(self, tensors: list, rank: int, tag: int) -> SimpleNamespace:
        def fill() -> None:
            if self.parts:
                tensors[0].copy_(self.parts.pop(0))
            else:
                self.receiving.set()
                self.release.wait()

        return SimpleNamespace(wait=fill)


def test_a_tensor_still_coming_in_is_not_silence(monkeypatch):
    # a healthy peer sending a big payload pings nothing meanwhile: the silence allowed grows with its size
    monkeypatch.setattr(link_module, "MIN_BYTES_PER_S", 1.0)  # 64 bytes: 64 s more
    incoming = _Incoming({"kind": "kv", "shape": [16], "dtype": "float32"})
    link = KVLink(DECODE, None, None, incoming)  # the decode end receives on "down"
    link.max_tensor_bytes = 64
    receiver = threading.Thread(target=link._recv)
    receiver.start()
    assert incoming.receiving.wait(30)
    link.last_heard -= SILENCE_S + 1  # as if 9 s of the transfer had passed
    assert link.error is None
    incoming.release.set()
    receiver.join(30)
    link.last_heard -= SILENCE_S + 1  # once it is in, silence is silence again
    assert link.error is not None and "hung" in link.error


def test_a_header_naming_a_tensor_over_the_cap_allocates_nothing():
    # whoever reaches the port names the shape: over what this end accepts, the message is refused unread
    incoming = _Incoming({"kind": "kv", "shape": [1 << 40], "dtype": "float32"})
    link = KVLink(DECODE, None, None, incoming)
    link.max_tensor_bytes = 1 << 20
    with pytest.raises(ValueError, match="4398046511104-byte tensor"):
        link._recv()
    assert not incoming.receiving.is_set()  # the tensor's recv was never posted
