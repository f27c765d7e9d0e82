"""`mixserve serve`: load the model and serve the OpenAI-compatible API until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from mixserve.config import ConfigError, add_engine_flags, load_config, overrides_from_args


def register(subparsers: Any) -> None:
    """Add the `serve` subcommand."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health "
                                          "and /metrics. Flags override --config (runtime.toml).")
    add_engine_flags(p)  # --config, --model, --prefill-chunk, --max-batch-tokens, --num-blocks, ...
    group = p.add_argument_group("server (override the [server] table of --config)")
    group.add_argument("--host", default=None, help="[server].host")
    group.add_argument("--port", default=None, metavar="INT", help="[server].port (0 = any free port)")
    group.add_argument("--api-key", default=None, help="[server].api_key: clients send 'Bearer KEY'")
    group.add_argument("--max-waiting", default=None, metavar="INT", help="[server].max_waiting")
    group.add_argument("--max-body-bytes", default=None, metavar="INT", help="[server].max_body_bytes")
    group.add_argument("--body-timeout", default=None, metavar="SECONDS", help="[server].body_timeout_s")
    group.add_argument("--step-timeout", default=None, metavar="SECONDS", help="[server].step_timeout_s")
    group.add_argument("--max-engine-restarts", default=None, metavar="INT",
                       help="[server].max_engine_restarts")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="[server].served_model_name: the names clients may use (the first is reported)")
    group.add_argument("--role", default=None, choices=["both", "prefill", "decode"],
                       help="[server].role: disaggregated prefill (decode = the front clients talk to)")
    group.add_argument("--kv-peer", default=None, metavar="HOST:PORT",
                       help="[server].kv_peer: where the prefill instance hosts the KV link")
    group.add_argument("--kv-peer-timeout", default=None, metavar="SECONDS",
                       help="[server].kv_peer_timeout_s: KV not back by then is prefilled on the decode side")
    group.add_argument("--kv-peer-min-tokens", default=None, metavar="INT",
                       help="[server].kv_peer_min_tokens: shorter prompts are prefilled on the decode side")
    group.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long in-flight requests may still run before they are aborted")
    group.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the engine and app, serve until a signal, and exit 0 after a graceful stop."""
    try:
        overrides = overrides_from_args(args)
        overrides["server"] = {
            "host": args.host, "port": _number_flag("--port", args.port), "api_key": args.api_key,
            "max_waiting": _number_flag("--max-waiting", args.max_waiting),
            "max_body_bytes": _number_flag("--max-body-bytes", args.max_body_bytes),
            "body_timeout_s": _number_flag("--body-timeout", args.body_timeout, float),
            "step_timeout_s": _number_flag("--step-timeout", args.step_timeout, float),
            "max_engine_restarts": _number_flag("--max-engine-restarts", args.max_engine_restarts),
            "served_model_name": args.served_model_name, "role": args.role, "kv_peer": args.kv_peer,
            "kv_peer_timeout_s": _number_flag("--kv-peer-timeout", args.kv_peer_timeout, float),
            "kv_peer_min_tokens": _number_flag("--kv-peer-min-tokens", args.kv_peer_min_tokens),
        }
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"mixserve serve: {exc}", file=sys.stderr)
        return 2

    # mixserve's own lines (the engine's periodic stats line at info) at the level uvicorn gets
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # torch-side imports after the config is known good: a bad flag fails fast
    from mixserve.disagg import roles
    from mixserve.engine.async_engine import AsyncEngine
    from mixserve.engine.supervision import Failpoint
    from mixserve.metrics import ServerMetrics
    from mixserve.server import create_app

    try:
        failpoint = Failpoint.from_env()  # tests only: MIXSERVE_FAULT_STEP (engine/supervision.py)
    except ValueError as exc:
        print(f"mixserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        roles.check_role(cfg)
    except ValueError as exc:
        print(f"mixserve serve: {exc}", file=sys.stderr)
        return 2
    try:  # role both: LLMEngine.from_config; prefill or decode: the same, then the KV link (disagg/)
        role = roles.build(cfg)
    except ConnectionError as exc:  # the other instance of a disaggregated pair never came
        print(f"mixserve serve: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # a missing or unreadable model, a bad setting for this model
        print(f"mixserve serve: cannot load the model: {exc}", file=sys.stderr)
        return 1
    engine = AsyncEngine(role.engine, ServerMetrics(), role.idle_timeout_s,
                         step_timeout_s=cfg.server.step_timeout_s,
                         max_engine_restarts=cfg.server.max_engine_restarts, failpoint=failpoint)
    app = create_app(engine, cfg.server, shutdown_timeout=args.shutdown_timeout)
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=args.log_level,
                            timeout_graceful_shutdown=FLUSH_S, access_log=False)
    server = _Server(config, app.state.mixserve.model_name, engine, args.shutdown_timeout)
    server.run()
    engine.llm.close()  # after the step loop stopped: writes [engine] cost_model (mixserve simulate)
    if not engine.healthy:
        print(f"mixserve serve: exiting, the engine is dead: {engine.error!r}", file=sys.stderr)
        return 1
    return 0


def _number_flag(flag: str, raw: str | None, kind: type = int) -> Any:
    # parsed here rather than by argparse so a bad value is one ConfigError line, as for the engine flags
    if raw is None:
        return None
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{flag}: must be {what}, got {raw!r}") from None


FLUSH_S = 5.0  # after the engine has ended every response, how long uvicorn waits for them to be sent


class _Server(uvicorn.Server):
    """uvicorn's Server: one line once it listens; on SIGTERM the engine ends every response first (each
    stream gets its error event and [DONE], each other request a 503 in the OpenAI shape) and only then
    are connections closed; a dead engine stops the server, and `run` returns 1."""

    def __init__(self, config: Any, model_name: str, engine: Any, grace_s: float) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.engine = engine
        self.grace_s = grace_s
        engine.on_dead = self._engine_died

    def _engine_died(self, exc: BaseException) -> None:
        self.should_exit = True  # read by uvicorn's main loop, from any thread

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while the engine drains
        await self.engine.stop(self.grace_s)
        await super().shutdown(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]  # the real port, also for --port 0
        shown = f"[{host}]" if ":" in host else host
        print(f"mixserve: serving {self.model_name} at http://{shown}:{port}", flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after its graceful shutdown, so the process would die of SIGTERM;
        # a server asked to stop that stopped cleanly exits 0 instead
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
