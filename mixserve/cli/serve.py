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
    group.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long in-flight requests may still run before they are aborted")
    group.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the engine and app, serve until a signal, and exit 0 after a graceful stop."""
    try:
        overrides = overrides_from_args(args)
        overrides["server"] = {
            "host": args.host, "port": _int_flag("--port", args.port), "api_key": args.api_key,
            "max_waiting": _int_flag("--max-waiting", args.max_waiting),
        }
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"mixserve serve: {exc}", file=sys.stderr)
        return 2

    # mixserve's own lines (the engine's periodic stats line at info) at the level uvicorn gets
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # torch-side imports after the config is known good: a bad flag fails fast
    from mixserve.engine.async_engine import AsyncEngine
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.metrics import ServerMetrics
    from mixserve.server import create_app

    try:
        llm = LLMEngine.from_config(cfg.engine)
    except (OSError, ValueError) as exc:  # a missing or unreadable model, a bad setting for this model
        print(f"mixserve serve: cannot load the model: {exc}", file=sys.stderr)
        return 1
    engine = AsyncEngine(llm, ServerMetrics())
    app = create_app(engine, cfg.server, shutdown_timeout=args.shutdown_timeout)
    name = app.state.mixserve.model_name
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    _Server(config, name).run()
    return 0


def _int_flag(flag: str, raw: str | None) -> int | None:
    # parsed here rather than by argparse so a bad value is one ConfigError line, as for the engine flags
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{flag}: must be an integer, got {raw!r}") from None


class _Server(uvicorn.Server):
    """uvicorn's Server, printing one line once it listens and exiting cleanly after SIGTERM."""

    def __init__(self, config: Any, model_name: str) -> None:
        super().__init__(config)
        self.model_name = model_name

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
