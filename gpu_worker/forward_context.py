"""The attention backend and metadata of the step being run, read by every attention layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic

from gpu_worker.attention.backend import AttentionBackend, Metadata


@dataclass(slots=True)
class StepAttention(Generic[Metadata]):
    """What forward_context() carries: the step's backend and the metadata it built."""

    backend: AttentionBackend[Metadata]
    metadata: Metadata


_current: StepAttention[Any] | None = None


@contextmanager
def forward_context(step: StepAttention[Any]) -> Iterator[None]:
    """Make step visible to attention layers for the duration of one forward pass."""
    global _current
    previous, _current = _current, step
    try:
        yield
    finally:
        _current = previous


def get_attn_metadata() -> StepAttention[Any]:
    """The step set by the enclosing forward_context()."""
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current
