"""A stop signal at any moment of start-up or serving is a clean stop (issue 15, item 3), and
/health answers 200 only once the whole tree is ready."""

from __future__ import annotations

import http.client
import os
import signal
import socket
from pathlib import Path

import pytest

from tests.serve.conftest import Server, wait_until


@pytest.mark.parametrize("moment", ["engine-core", "engine-tok-0", "engine-api-0"])
def test_a_signal_during_start_up_is_a_clean_stop(tiny_args, moment):
    server = Server([*tiny_args, "--api-server-count", "2"], wait=False)
    assert wait_until(lambda: moment in server.children().values(), timeout=120), server.stderr
    server.proc.send_signal(signal.SIGTERM)
    assert not server.wait_ready()
    assert server.proc.wait(timeout=60) == 0, server.stderr
    assert "killing" not in server.stderr


def _health(port: int) -> int | None:
    """GET /health's status, or None while nobody answers (the port's backlog holds it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=0.5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def _ready_files(server: Server) -> list[bool]:
    """Whether each API server's ready file (from its command line) exists."""
    found = []
    for pid, name in server.children().items():
        if name.startswith("engine-api-"):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            found.append(os.path.exists(argv[argv.index(b"--ready-file") + 1]))
    return found


def test_sigterm_just_after_health_answers_200_is_a_clean_stop(tiny_args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Two API servers: the first answers while the launcher still waits for the second.
    server = Server([*tiny_args, "--api-server-count", "2", "--port", str(port)], wait=False)
    assert wait_until(
        lambda: _health(port) == 200 or server.proc.poll() is not None, timeout=120
    ), server.stderr
    ready = _ready_files(server)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.stderr
    assert ready == [True, True]  # 200 only once the whole tree was ready
    assert "killing" not in server.stderr
