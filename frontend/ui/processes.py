"""The process tree of `engine serve`, read from /proc: the launcher, its children (engine core,
tokenizer processes, API servers) and theirs (the engine core's workers)."""

from __future__ import annotations

import os
from typing import Any

_ROLES = (
    ("engine-api-", "API server"),
    ("engine-tok-", "tokenizer"),
    ("engine-core", "engine core"),
)
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk wait",
    "Z": "zombie",
    "T": "stopped",
    "t": "stopped",
    "X": "dead",
    "I": "idle",
}


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state letter, parent pid) of pid, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return comm, fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _role(comm: str, parent_role: str | None, cmdline: str) -> str:
    for prefix, role in _ROLES:
        if comm.startswith(prefix):
            return role
    if parent_role == "engine core":
        # multiprocessing's spawn runs workers; its resource tracker is a helper, not a rank.
        return "worker" if "spawn_main" in cmdline else "helper"
    return "process"


def process_tree(root: int | None = None) -> list[dict[str, Any]]:
    """The launcher (by default this process's parent) and its descendants two levels down:
    [{pid, parent, name, role, state, alive}] in tree order."""
    root = os.getppid() if root is None else root
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[str, str, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            stats[int(entry)] = st
            children.setdefault(st[2], []).append(int(entry))
    out: list[dict[str, Any]] = []

    def visit(pid: int, role: str, depth: int) -> None:
        comm, state, parent = stats[pid]
        out.append(
            {
                "pid": pid,
                "parent": parent,
                "name": comm,
                "role": role,
                "depth": depth,
                "state": _STATES.get(state, state),
                "alive": state not in ("Z", "X"),
            }
        )
        if depth < 2:
            for child in sorted(children.get(pid, ())):
                visit(child, _role(stats[child][0], role, _cmdline(child)), depth + 1)

    if root in stats:
        visit(root, "launcher", 0)
    return out
