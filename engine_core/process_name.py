"""Naming a process as ps and top show it."""

from __future__ import annotations


def set_process_name(name: str) -> None:
    """Write name (at most 15 bytes are kept) to /proc/self/comm; a no-op where that is absent."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass
