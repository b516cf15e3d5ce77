"""The /metrics view across processes, and the multiprocess directory's lifecycle."""

from __future__ import annotations

import os
import shutil
import tempfile

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"


def setup_multiprocess_dir(path: str | None = None) -> str:
    """Create an empty metrics directory (a fresh tempdir unless path is given), export it in
    PROMETHEUS_MULTIPROC_DIR for child processes, and return it."""
    if path is None:
        path = tempfile.mkdtemp(prefix="engine-metrics-")
    else:
        # Files left by an earlier run would be summed into this run's counters.
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    os.environ[ENV_VAR] = path
    return path


def remove_multiprocess_dir(path: str) -> None:
    """Delete a metrics directory at shutdown."""
    shutil.rmtree(path, ignore_errors=True)


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """Drop an exited child's 'live' gauge values (call when the launcher reaps it)."""
    multiprocess.mark_process_dead(pid, path or os.environ.get(ENV_VAR))


def metrics_registry(path: str | None = None) -> CollectorRegistry:
    """The registry /metrics renders: every process's metrics in multiprocess mode."""
    path = path or os.environ.get(ENV_VAR)
    if not path:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    return registry


def render_metrics(path: str | None = None) -> tuple[bytes, str]:
    """(body, content type) of every process's metrics for GET /metrics."""
    return generate_latest(metrics_registry(path)), CONTENT_TYPE_LATEST
