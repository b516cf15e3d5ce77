"""The engine core process survives bad input, reports fatal errors, dies with its parent and
sleeps when idle."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest
import zmq

from engine_core.client import AsyncEngineCoreClient, EngineCoreClient, EngineDeadError
from engine_core.core_proc import EngineCoreProc
from engine_core.engine_core import EngineCore
from engine_core.resolve import resolved_config
from protocol.engine_core import (
    PROTOCOL_VERSION,
    ClientHello,
    OutputType,
    RequestType,
    UtilityOutput,
    UtilityRequest,
    output_decoders,
)
from protocol.frames import ARRAY_EXT_CODE
from tests.engine_core_proc.utils import PROMPTS, collect, greedy_request

_encode = msgspec.msgpack.encode


def _raw_socket(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _replies(sock: zmq.Socket, count: int | None = None) -> list[tuple[OutputType, object]]:
    """count messages, or (count=None) all up to the answer of a ping sent now, which comes last:
    the busy loop answers it after the I/O thread has answered every earlier frame."""
    if count is None:
        sock.send_multipart([bytes([RequestType.UTILITY]), _encode(UtilityRequest(-1, "ping"))])
    decoders, got = output_decoders(), []
    while len(got) != count:
        assert sock.poll(10_000), "the engine core stopped answering"
        kind, payload, *buffers = sock.recv_multipart()
        msg = decoders[kind[0]].decode(payload, buffers)
        if count is None and isinstance(msg, UtilityOutput) and msg.call_id == -1:
            return got
        got.append((OutputType(kind[0]), msg))
    return got


def _array_add(request_id: str, header: list, code: int = ARRAY_EXT_CODE) -> list[bytes]:
    """An ADD whose prompt is an array Ext with this header, over one 400-byte buffer frame."""
    prompt = msgspec.msgpack.Ext(code, _encode(header))
    return [bytes([RequestType.ADD]), _encode([request_id, prompt, {}]), bytes(400)]


def _fuzz_frames() -> list[list[bytes]]:
    rng = random.Random(0)
    valid_add = _encode(greedy_request("fz-valid", [1, 2, 3]))
    frames = [
        [bytes([t]), rng.randbytes(rng.randrange(0, 64))] for t in range(4) for _ in range(25)
    ]
    frames += [[bytes([RequestType.ADD]), valid_add[:n]] for n in range(len(valid_add))]
    frames += [
        [bytes([RequestType.ADD]), _encode(["fz-types", "not a list", {}])],
        [bytes([RequestType.ADD]), _encode(["fz-params", [1], {"temperature": -1.0}])],
        [bytes([RequestType.ADD]), _encode([123, [1], {}])],
        [bytes([RequestType.ABORT]), _encode([1, 2])],
        [bytes([RequestType.UTILITY]), _encode([7, 5])],
        [bytes([RequestType.UTILITY]), _encode([8, "ping", [[[[[]]]]] * 3])],
        [bytes([RequestType.UTILITY]), b"\x91" * 100_000 + b"\x00"],
        [bytes([RequestType.HELLO]), _encode(["x"])],
        [bytes([9]), valid_add],
        [bytes([255]), b""],
        [b"", valid_add],
        [b"\x01\x01", valid_add],
        [bytes([RequestType.ADD])],
        [b""],
        [bytes([RequestType.ADD]), _encode(["fz-ext-data", msgspec.msgpack.Ext(1, b"\xc1"), {}])],
        _array_add("fz-ext-code", ["int32", [100], 0], code=7),
        _array_add("fz-ext-header", ["int32", [100]]),
        _array_add("fz-ext-index", ["int32", [100], 1]),
        _array_add("fz-ext-dtype", ["float64", [50], 0]),
        _array_add("fz-ext-float", ["float32", [100], 0]),
        _array_add("fz-ext-shape", ["int32", [99], 0]),
        _array_add("fz-ext-negative", ["int32", [-100], 0]),
        _array_add("fz-ext-rank", ["int32", [10, 10], 0]),
    ]
    return frames


def test_fuzzed_frames_never_stop_the_engine_core(address):
    sock = _raw_socket(address)
    for frames in _fuzz_frames():
        sock.send_multipart(frames)
    replies = _replies(sock)
    errors = {m.request_id: m.message for k, m in replies if k == OutputType.ERROR}
    anonymous = [m.message for k, m in replies if k == OutputType.ERROR and not m.request_id]
    utility = {m.call_id: m.error for k, m in replies if k == OutputType.UTILITY}
    # A payload that decodes as msgpack names its request or call; a truncated one cannot.
    assert "Expected `array`, got `str`" in errors["fz-types"]
    assert "temperature must be non-negative" in errors["fz-params"]
    assert "Expected `str`, got `int`" in utility[7]
    assert any("ADD payload: Input data was truncated" in m for m in anonymous)
    assert any("expected frames [type byte" in m for m in anonymous)
    assert "malformed array extension" in errors["fz-ext-data"]
    assert "unknown msgpack extension type 7" in errors["fz-ext-code"]
    assert "malformed array extension" in errors["fz-ext-header"]
    assert "array buffer frame 1 does not exist" in errors["fz-ext-index"]
    assert "dtype 'float64' is not allowed" in errors["fz-ext-dtype"]
    assert "expected a 1-dimensional integer array" in errors["fz-ext-float"]
    assert "needs 396 bytes; its buffer frame has 400" in errors["fz-ext-shape"]
    assert "negative dimension" in errors["fz-ext-negative"]
    assert "expected a 1-dimensional integer array" in errors["fz-ext-rank"]
    sock.close()
    with EngineCoreClient(address) as client:
        client.add_request(greedy_request("after-fuzz", PROMPTS[0], max_tokens=4))
        tokens, _ = collect(client, {"after-fuzz"})["after-fuzz"]
        assert len(tokens) == 4


def test_handshake_checks_the_protocol_version(address):
    sock = _raw_socket(address)
    sock.send_multipart([bytes([RequestType.HELLO]), _encode(ClientHello(PROTOCOL_VERSION + 1))])
    sock.send_multipart([bytes([RequestType.HELLO]), _encode(ClientHello(PROTOCOL_VERSION, "t"))])
    (k1, refused), (k2, ready) = _replies(sock, 2)
    assert k1 == OutputType.ERROR and "protocol version mismatch" in refused.message
    assert k2 == OutputType.READY and ready.protocol_version == PROTOCOL_VERSION
    sock.close()


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_idle_engine_core_uses_no_cpu(headless):
    proc, address = headless
    with EngineCoreClient(address) as client:
        client.add_request(greedy_request("before-idle", PROMPTS[0], max_tokens=2))
        collect(client, {"before-idle"})
    time.sleep(0.2)
    before = _cpu_ticks(proc.pid)
    time.sleep(1.0)
    assert _cpu_ticks(proc.pid) - before <= 2, "an idle engine core should block, not poll"


def test_fatal_error_tells_clients_the_engine_is_dead(engine_args, socket_dir):
    engine = EngineCore(resolved_config(**engine_args))

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    proc = EngineCoreProc(engine, f"ipc://{socket_dir}/fatal.sock")
    exit_code = []
    thread = threading.Thread(target=lambda: exit_code.append(proc.run()))
    thread.start()
    with EngineCoreClient(proc.address) as client:
        client.add_request(greedy_request("doomed", PROMPTS[0]))
        with pytest.raises(EngineDeadError, match="RuntimeError: device lost"):
            client.get_output()
        with pytest.raises(EngineDeadError):
            client.add_request(greedy_request("after", PROMPTS[0]))
    thread.join(timeout=10)
    assert exit_code == [1]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_engine_core_exits_when_its_parent_dies(engine_args):
    parent_code = textwrap.dedent("""
        import json, sys, time
        from engine_core.client import EngineCoreClient
        client = EngineCoreClient(engine_args=json.loads(sys.argv[1]))
        print(client.process.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, json.dumps(engine_args)],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    with open(f"/proc/{child}/comm") as f:
        assert f.read().strip() == "engine-core"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(child):
        os.kill(child, 9)
        pytest.fail("the engine core outlived its parent")


def test_async_client_hears_its_child_engine_core_die_at_once(engine_args):
    """The asyncio client watches the engine core it started on its pidfd (no timer): a
    SIGKILL fails the client's waiting reader with the exit code."""

    async def main() -> tuple[float, str]:
        client = await AsyncEngineCoreClient.create(engine_args=engine_args, startup_timeout=120)
        try:
            reader = asyncio.create_task(client.get_output())
            await asyncio.sleep(0.2)
            start = time.monotonic()
            os.kill(client.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError) as failed:
                await asyncio.wait_for(reader, 10)
            return time.monotonic() - start, str(failed.value)
        finally:
            client.shutdown()

    elapsed, message = asyncio.run(main())
    assert "exited with code -9" in message
    assert elapsed < 2.0


def test_start_up_failure_is_reported(engine_args, tmp_path):
    # The configuration resolves (config.json, the tokenizer and a weights file are there);
    # reading the weights, which are not safetensors, fails in the child.
    model = tmp_path / "bad-weights"
    shutil.copytree(
        engine_args["model"], model, ignore=shutil.ignore_patterns("*.safetensors", "*.bin")
    )
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    args = {**engine_args, "model": str(model)}
    with pytest.raises(EngineDeadError, match="exited with code 1 during start-up"):
        EngineCoreClient(engine_args=args, startup_timeout=60)


def test_a_missing_model_is_refused_before_a_child_starts(engine_args, tmp_path):
    args = {**engine_args, "model": str(tmp_path / "no-such-model")}
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        EngineCoreClient(engine_args=args, startup_timeout=60)


def test_stop_signal_on_a_thread_that_does_not_block_it_stops_cleanly(engine_args, socket_dir):
    # The thread starts before the engine core blocks its stop signals, as one a library starts
    # at import time does; without a handler, SIGTERM there would kill the process with -15.
    code = textwrap.dedent("""
        import sys, threading, time
        from engine_core.core_proc import main
        early = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
        early.start()
        print(early.native_id, flush=True)
        sys.exit(main(sys.argv[1:]))
    """)
    address = f"ipc://{socket_dir}/early-thread.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--listen", address, "--engine-args", json.dumps(engine_args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    thread_id = int(proc.stdout.readline())
    with EngineCoreClient(address, startup_timeout=120) as client:
        assert client.call_utility("ping") == "pong"
    os.kill(thread_id, signal.SIGTERM)  # the kernel delivers it to that thread when it can
    _, log = proc.communicate(timeout=30)
    assert proc.returncode == 0, log
    assert "got SIGTERM; stopping" in log
