"""The OpenAI-compatible HTTP server: FastAPI app, SSE streaming, /metrics, /health."""

from __future__ import annotations

from mixserve.server.app import create_app

__all__ = ["create_app"]
