"""`mixserve serve --role prefill|decode|both --kv-peer HOST:PORT`: the engine each role serves.

Where the keys live (decided): `[server] role`, `kv_peer`, `kv_peer_timeout_s`, not `[engine]`: they say
how an instance serves (which side of a pair it is, whom it talks to), and every `[engine]` key is also an
`LLM(...)` keyword, where a role means nothing (offline there is no front to disaggregate).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mixserve.config import RuntimeConfig
from mixserve.disagg.kv_blocks import check_peer, describe
from mixserve.disagg.link import DECODE, PREFILL, KVLink, parse_peer
from mixserve.engine.llm_engine import LLMEngine

ROLES = ("both", PREFILL, DECODE)
IDLE_POLL_S = 0.01  # a disaggregated step loop re-checks for arrivals this often while idle
DEFAULT_IDLE_S = 1.0  # AsyncEngine's own idle timeout (woken by every submit and abort)


@dataclass(frozen=True)
class Role:
    """The engine to serve and how often its idle step loop must look for work nobody woke it for."""

    engine: LLMEngine
    idle_timeout_s: float


def check_role(cfg: RuntimeConfig) -> None:
    """ValueError naming the key for a pair that cannot work (before the model is loaded)."""
    role, peer = cfg.server.role, cfg.server.kv_peer
    if role not in ROLES:
        raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    if role == "both":
        if peer:  # most likely a forgotten --role: serving alone would silently ignore the peer
            raise ValueError(f"kv_peer {peer}: set only with role prefill or decode (role is both)")
        return
    if not peer:
        raise ValueError(f"role {role}: needs kv_peer HOST:PORT (where the prefill instance listens)")
    parse_peer(peer)
    if cfg.engine.tensor_parallel_size != 1:
        raise ValueError(f"role {role}: tensor_parallel_size must be 1 (each rank holds only its heads' KV)")
    if not cfg.engine.enable_prefix_caching:
        raise ValueError(f"role {role}: needs enable_prefix_caching (the hand-over goes through it)")


def build(cfg: RuntimeConfig) -> Role:
    """Load the model and, for prefill or decode, connect to the other instance (blocks until it comes);
    ConnectionError if it never comes or serves another model or KV layout."""
    from mixserve.disagg.decode_side import DecodeEngine
    from mixserve.disagg.prefill_side import PrefillEngine

    check_role(cfg)
    role = cfg.server.role
    if role == "both":
        return Role(LLMEngine.from_config(cfg.engine), DEFAULT_IDLE_S)
    engine = (PrefillEngine if role == PREFILL else DecodeEngine).from_config(cfg.engine)
    host, port = parse_peer(cfg.server.kv_peer)
    what = "waiting for the decode instance at" if role == PREFILL else "connecting to the prefill one at"
    print(f"mixserve: {role} instance, {what} {cfg.server.kv_peer}", file=sys.stderr, flush=True)
    mine = describe(engine.runner)
    link = KVLink.connect(role, host, port, mine)
    try:
        check_peer(mine, link.peer_hello)
    except ValueError as exc:  # serve: a ConnectionError is printed as it is
        link.close()
        raise ConnectionError(str(exc)) from None
    if isinstance(engine, DecodeEngine):
        engine.attach(link, cfg.server.kv_peer_timeout_s, cfg.server.kv_peer_min_tokens)
    else:
        engine.attach(link)
    return Role(engine, IDLE_POLL_S)
