"""The attention metadata of the step being run, read by every attention layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_current: Any = None


@contextmanager
def forward_context(attn_metadata: Any) -> Iterator[None]:
    """Make attn_metadata visible to attention layers for the duration of one forward pass."""
    global _current
    previous, _current = _current, attn_metadata
    try:
        yield
    finally:
        _current = previous


def get_attn_metadata() -> Any:
    """The metadata set by the enclosing forward_context()."""
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current
