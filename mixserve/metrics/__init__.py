"""Prometheus collectors fed by engine statistics: the only package that imports prometheus_client."""

from __future__ import annotations

from mixserve.metrics.prometheus import ServerMetrics

__all__ = ["ServerMetrics"]
