"""Utility calls: named engine core methods a client may call between steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from engine_core.engine_core import EngineCore


def engine_utilities(engine: EngineCore) -> dict[str, Callable[..., Any]]:
    """The utility methods by name; each returns a msgpack-encodable result."""

    def get_stats() -> dict[str, Any]:
        return {
            **dataclasses.asdict(engine.totals),
            "num_unfinished_requests": engine.scheduler.get_num_unfinished_requests(),
            "num_blocks": engine.num_blocks,
        }

    return {
        "ping": lambda: "pong",
        "reset_prefix_cache": engine.reset_prefix_cache,
        "get_stats": get_stats,
    }
