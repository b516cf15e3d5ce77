"""The shared plumbing: spawning a child module, the parent-death watch (draining first, a lifeline,
the kernel's parent-death signal), the handshake's version check and the socket pair with and
without a shared secret."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import zmq

from ipc.handshake import READY, HandshakeServer, hello_frames, ready_or_refused
from ipc.process import PROJECT_ROOT, pid_alive, spawn_module
from ipc.sockets import RouterServer, connect_dealer

SECRET = "a shared secret"


def _wait_gone(pid: int, timeout: float) -> float:
    start = time.monotonic()
    while pid_alive(pid):
        assert time.monotonic() - start < timeout, f"pid {pid} still runs after {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.parametrize("own_session", [False, True])
def test_spawn_module_runs_this_copy_with_the_extra_environment(tmp_path, monkeypatch, own_session):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    out = tmp_path / "env.json"
    proc = spawn_module(
        "tests.ipc._print_env", [str(out)], extra_env={"X": "1"}, own_session=own_session
    )
    assert proc.wait(30) == 0
    assert json.loads(out.read_text()) == [
        f"{PROJECT_ROOT}{os.pathsep}/elsewhere",
        "1",
        own_session,
    ]


def test_spawn_module_ignores_packages_in_the_working_directory(tmp_path, monkeypatch):
    """A user's folder named like one of our packages, where they start the engine, is not what
    the child imports (`python -m` puts the working directory first on sys.path)."""
    shadow = tmp_path / "tests"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the user folder was imported')\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "env.json"
    proc = spawn_module("tests.ipc._print_env", [str(out)])
    assert proc.wait(30) == 0
    assert out.exists()


def _child(script: str, tmp_path, *args: str) -> subprocess.Popen:
    """A parent (`sh`) that starts a Python child running script and prints the child's pid."""
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.Popen(
        ["sh", "-c", f"{sys.executable} {path} $$ {' '.join(args)} & echo $!; sleep 60"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": PROJECT_ROOT},
    )


def test_a_child_exits_at_once_when_its_parent_goes(tmp_path):
    parent = _child(
        """
        import sys, time
        from ipc.process import watch_parent
        watch_parent(int(sys.argv[1]), interval_s=0.05)
        time.sleep(60)
    """,
        tmp_path,
    )
    pid = int(parent.stdout.readline())
    time.sleep(0.5)
    assert pid_alive(pid)
    parent.kill()
    parent.wait()
    assert _wait_gone(pid, 5.0) < 2.0


def test_on_exit_runs_first_then_the_grace_period_ends_it(tmp_path):
    marker = tmp_path / "drained"
    parent = _child(
        """
        import sys, time
        from ipc.process import watch_parent
        watch_parent(int(sys.argv[1]), interval_s=0.05, grace_s=1.0,
                     on_exit=lambda why: open(sys.argv[2], "w").write(why))
        time.sleep(60)  # never stops on its own: the grace period must end it
    """,
        tmp_path,
        str(marker),
    )
    pid = int(parent.stdout.readline())
    time.sleep(0.5)
    parent.kill()
    parent.wait()
    took = _wait_gone(pid, 10.0)
    assert 0.9 < took < 5.0
    assert marker.read_text() == f"parent process {parent.pid} exited"


def _sleep_with_lifeline(parent_pid: int, lifeline, kill_with_parent: bool) -> None:
    from ipc.process import watch_parent

    watch_parent(parent_pid, lifeline=lifeline, kill_with_parent=kill_with_parent)
    time.sleep(60)


def test_the_lifeline_ends_a_child_when_the_parent_closes_it():
    ctx = multiprocessing.get_context("spawn")
    child_end, parent_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_sleep_with_lifeline, args=(os.getpid(), child_end, False), daemon=True
    )
    proc.start()
    child_end.close()
    time.sleep(1.0)
    assert proc.is_alive()
    parent_end.close()  # as if the parent died: EOF
    proc.join(5.0)
    assert proc.exitcode == 1


def test_kill_with_parent_exits_at_once_when_the_parent_is_already_gone():
    ctx = multiprocessing.get_context("spawn")
    child_end, parent_end = ctx.Pipe(duplex=False)
    # Another pid than our own as the parent: the child finds its parent is not that one.
    proc = ctx.Process(target=_sleep_with_lifeline, args=(1, child_end, True), daemon=True)
    proc.start()
    proc.join(10.0)
    assert proc.exitcode == 1
    parent_end.close()


class _Hello(msgspec.Struct, array_like=True):
    protocol_version: int
    client_name: str = ""


class _Refusal(msgspec.Struct, array_like=True):
    request_id: str
    message: str


def test_the_handshake_answers_ready_or_refuses_naming_both_versions():
    server = HandshakeServer(7, "the test server", 9, lambda m: _Refusal("", m))
    assert server.answer(_Hello(7, "c"), "ready!") == (READY, "ready!")
    kind, refusal = server.answer(_Hello(6, "c"), "ready!")
    assert kind == 9 and refusal.message == (
        "protocol version mismatch: the test server speaks version 7, the client 6"
    )
    assert ready_or_refused(READY, "ready!", "x") == "ready!"
    with pytest.raises(ConnectionError, match="^the test server refused: protocol version"):
        ready_or_refused(kind, refusal, "the test server refused")
    assert hello_frames(_Hello(7, "c")) == [b"\x00", msgspec.msgpack.encode(_Hello(7, "c"))]


@pytest.mark.parametrize("secret", [None, SECRET])
def test_router_and_dealer_talk_with_or_without_a_secret(secret):
    ctx = zmq.Context()
    server = RouterServer(
        ctx,
        "tcp://127.0.0.1:*",
        secret,
        linger_ms=0,
        log=logging.getLogger("test"),
        name="the test server",
        exposes="talk",
        peers="its clients",
    )
    assert server.address.startswith("tcp://127.0.0.1:")
    sock, watch = connect_dealer(ctx, server.address, secret, peer="the test server")
    sock.send_multipart([b"\x00", b"hi"])
    assert server.socket.poll(5000)
    identity, *frames = server.socket.recv_multipart()
    assert frames == [b"\x00", b"hi"]
    server.socket.send_multipart([identity, b"\x00", b"ready"])
    assert sock.poll(5000) and sock.recv_multipart() == [b"\x00", b"ready"]
    assert watch is not None and watch.failure() is None
    watch.close()
    sock.close(linger=0)
    server.socket.close(linger=0)
    server.stop_auth()
    ctx.term()


def test_a_dealer_without_the_secret_is_told_why():
    ctx = zmq.Context()
    server = RouterServer(
        ctx,
        "tcp://127.0.0.1:*",
        SECRET,
        linger_ms=0,
        log=logging.getLogger("test"),
        name="the test server",
        exposes="talk",
        peers="its clients",
    )
    sock, watch = connect_dealer(ctx, server.address, None, peer="the test server")
    deadline = time.monotonic() + 5
    reason = None
    while reason is None and time.monotonic() < deadline:
        reason = watch.failure()
        time.sleep(0.05)
    assert reason is not None and "ENGINE_CORE_KEY" in reason
    watch.close()
    sock.close(linger=0)
    server.socket.close(linger=0)
    server.stop_auth()
    ctx.term()


def test_an_exposed_server_without_a_secret_warns(caplog):
    ctx = zmq.Context()
    server = RouterServer(
        ctx,
        "tcp://0.0.0.0:*",
        None,
        linger_ms=0,
        log=logging.getLogger("test"),
        name="the test server",
        exposes="do things",
        peers="its clients set the same",
    )
    assert any(
        "the test server listens on tcp://0.0.0.0:" in r.getMessage()
        and "without authentication: anyone who reaches it can do things. Set "
        "ENGINE_CORE_KEY to a secret (its clients set the same)"
        in r.getMessage()
        for r in caplog.records
    )
    server.socket.close(linger=0)
    ctx.term()
