"""Draining on SIGTERM over HTTP (issue 15, item 2): new requests get 503 with Retry-After
while in-flight ones finish; at the --shutdown-timeout deadline the rest get an error event
and the launcher exits 1; every tier fits in the launcher's budget (it kills nobody)."""

from __future__ import annotations

import json
import os
import signal
import time

from ipc.process import StopOrder
from tests.serve.conftest import LONG_COMPLETION, Server, SseStream, http_request, wait_until


def _drain_with_request_in_flight(server: Server) -> tuple[SseStream, int]:
    """Stream a long completion, freeze the engine core once it streams (the request stays in
    flight), SIGTERM the launcher; the stream and the engine core's pid (resume it with
    SIGCONT)."""
    core = server.child("engine-core")
    stream = SseStream(server, "/v1/completions", LONG_COMPLETION)
    assert stream.next_event() not in (None, "[DONE]")
    os.kill(core, signal.SIGSTOP)
    server.proc.send_signal(signal.SIGTERM)
    return stream, core


def test_sigterm_refuses_new_requests_with_503_while_in_flight_ones_finish(tiny_args):
    server = Server([*tiny_args, "--shutdown-timeout", "60"])
    assert server.ready, server.stderr
    stream, core = _drain_with_request_in_flight(server)
    try:
        # Still accepting connections: a refused connection would tell a client nothing.
        assert wait_until(lambda: http_request(server, "GET", "/health")[0] == 503)
        status, headers, body = http_request(server, "POST", "/v1/completions", LONG_COMPLETION)
        assert status == 503, body
        assert int(headers["Retry-After"]) > 0
        assert json.loads(body)["error"]["message"] == "the server is shutting down"
    finally:
        os.kill(core, signal.SIGCONT)
    events = stream.rest()
    stream.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0, server.stderr
    assert "killing" not in server.stderr


def test_requests_outlasting_the_shutdown_timeout_get_an_error_event_and_exit_1(tiny_args):
    server = Server([*tiny_args, "--shutdown-timeout", "2"])
    assert server.ready, server.stderr
    start = time.monotonic()
    stream, core = _drain_with_request_in_flight(server)
    try:
        events = stream.rest()
        elapsed = time.monotonic() - start
    finally:
        os.kill(core, signal.SIGCONT)
        stream.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503
    assert error["message"] == (
        "the server is shutting down (SIGTERM) and the request did not "
        "finish within --shutdown-timeout 2.0 s"
    )
    assert 2 <= elapsed < 2 + 5  # the deadline, with a loaded box's margin
    assert server.proc.wait(timeout=60) == 1
    assert (
        "engine-api-0 cut requests still running at the --shutdown-timeout deadline"
        in server.stderr
    )
    assert "killing" not in server.stderr


def test_stop_order_round_trip_and_default(tmp_path):
    path = str(tmp_path / "stop.json")
    StopOrder("the server is stopping: engine-api-1 died", time.time() - 1).write(path)
    order = StopOrder.read(path, drain_timeout=30)
    assert order.reason == "the server is stopping: engine-api-1 died"
    assert order.remaining() == 0
    # A SIGTERM that did not come from the launcher: drain for the process's own timeout.
    default = StopOrder.read(str(tmp_path / "absent.json"), drain_timeout=30)
    assert default.reason == "the server is shutting down" and 29 < default.remaining() <= 30
