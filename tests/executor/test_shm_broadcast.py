"""The shared-memory ring buffer: order, wrap-around, overflow, several readers, other processes."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection

import msgspec
import pytest

from executor.shm_broadcast import RingHandle, ShmRingReader, ShmRingWriter
from protocol.step import SchedulerOutput


def _message(i: int, size: int = 0) -> bytes:
    return f"{i}:".encode() + bytes([i % 251]) * size


@pytest.fixture
def ring():
    writers: list[ShmRingWriter] = []

    def make(**kwargs) -> ShmRingWriter:
        writers.append(ShmRingWriter(**kwargs))
        return writers[-1]

    yield make
    for writer in writers:
        writer.close()


def _read_all(handle: RingHandle, index: int, count: int, out: list[bytes]) -> None:
    reader = ShmRingReader(handle, index)
    out.extend(reader.read(timeout=10) for _ in range(count))
    reader.close()


def test_messages_arrive_in_order(ring):
    writer = ring(num_readers=1, num_slots=4, slot_bytes=256)
    reader = ShmRingReader(writer.handle, 0)
    for i in range(3):
        writer.write(_message(i))
    assert [reader.read() for _ in range(3)] == [_message(i) for i in range(3)]
    reader.close()


def test_many_messages_through_two_slots(ring):
    writer = ring(num_readers=1, num_slots=2, slot_bytes=256)
    got: list[bytes] = []
    thread = threading.Thread(target=_read_all, args=(writer.handle, 0, 500, got))
    thread.start()
    for i in range(500):
        writer.write(_message(i, i % 200), timeout=10)
    thread.join()
    assert got == [_message(i, i % 200) for i in range(500)]


def test_writer_waits_for_every_reader(ring):
    writer = ring(num_readers=2, num_slots=1, slot_bytes=64)
    readers = [ShmRingReader(writer.handle, i) for i in range(2)]
    writer.write(b"first")
    waits = []
    with pytest.raises(TimeoutError):
        writer.write(b"second", timeout=0.05, on_wait=lambda: waits.append(1))
    assert waits, "on_wait runs while the writer sleeps"
    assert readers[0].read() == b"first"
    with pytest.raises(TimeoutError):
        writer.write(b"second", timeout=0.05)
    assert readers[1].read() == b"first"
    writer.write(b"second", timeout=1)
    assert [r.read() for r in readers] == [b"second", b"second"]
    for r in readers:
        r.close()


def test_large_messages_go_through_overflow_blocks():
    writer = ShmRingWriter(num_readers=1, num_slots=2, slot_bytes=64)
    sizes = [0, 60, 61, 1000, 3 << 20, 10, 5000]
    got: list[bytes] = []
    thread = threading.Thread(target=_read_all, args=(writer.handle, 0, len(sizes), got))
    thread.start()
    for i, size in enumerate(sizes):
        writer.write(_message(i, size), timeout=10)
    thread.join()
    assert got == [_message(i, size) for i, size in enumerate(sizes)]
    # Only the overflow blocks of the last lap are still linked; close() unlinks them.
    assert 1 <= len(writer._overflow) <= 2
    names = [block.name for block in writer._overflow.values()]
    writer.close()
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in names)
    assert not os.path.exists(f"/dev/shm/{writer.handle.name}")


def test_several_readers_each_get_every_message(ring):
    writer = ring(num_readers=3, num_slots=3, slot_bytes=128)
    results: list[list[bytes]] = [[] for _ in range(3)]
    threads = [
        threading.Thread(target=_read_all, args=(writer.handle, i, 200, results[i]))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for i in range(200):
        writer.write(_message(i, 3 * (i % 70)), timeout=10)
    for t in threads:
        t.join()
    expected = [_message(i, 3 * (i % 70)) for i in range(200)]
    assert all(r == expected for r in results)


def test_typed_messages_decode_in_place(ring):
    writer = ring(num_readers=1, num_slots=2, slot_bytes=4096)
    reader = ShmRingReader(writer.handle, 0)
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    step = SchedulerOutput(
        num_scheduled_tokens={"a": 3, "b": 1}, total_num_scheduled_tokens=4, finished_req_ids=["c"]
    )
    writer.write(msgspec.msgpack.encode(step))
    assert reader.read(decoder.decode) == step
    reader.close()


def _process_reader(handle_bytes: bytes, count: int, conn: Connection) -> None:
    handle = msgspec.msgpack.decode(handle_bytes, type=RingHandle)
    got: list[bytes] = []
    _read_all(handle, 1, count, got)
    conn.send_bytes(msgspec.msgpack.encode([len(m) for m in got]))
    conn.send_bytes(b"".join(got))


def test_reader_in_another_process(ring):
    writer = ring(num_readers=2, num_slots=2, slot_bytes=128)
    messages = [_message(i, 50 * i) for i in range(20)]  # the later ones overflow
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_process_reader, args=(msgspec.msgpack.encode(writer.handle), len(messages), child)
    )
    proc.start()
    local: list[bytes] = []
    thread = threading.Thread(target=_read_all, args=(writer.handle, 0, len(messages), local))
    thread.start()
    for m in messages:
        writer.write(m, timeout=20)
    thread.join()
    assert parent.poll(20)
    lengths = msgspec.msgpack.decode(parent.recv_bytes())
    data = parent.recv_bytes()
    proc.join(10)
    assert proc.exitcode == 0
    assert lengths == [len(m) for m in messages] and data == b"".join(messages)
    assert local == messages


def test_blocked_reader_uses_almost_no_cpu(ring):
    writer = ring(num_readers=1)
    reader = ShmRingReader(writer.handle, 0)
    cpu, wall = time.process_time(), time.monotonic()
    with pytest.raises(TimeoutError):
        reader.read(timeout=1.0)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    reader.close()
    assert wall >= 1.0
    assert cpu < 0.05, f"a reader idle for {wall:.2f} s used {cpu * 1000:.1f} ms of CPU"


def _sleepy_reader(handle: RingHandle, doorbell, replies: Connection) -> None:
    reader = ShmRingReader(handle, 0, doorbell)
    cpu_before = time.process_time()
    data = reader.read(timeout=30)  # idle for a while first: asleep on the doorbell
    replies.send((time.monotonic(), data, time.process_time() - cpu_before))
    reader.close()


def test_a_reader_with_a_doorbell_sleeps_until_a_message_comes(ring):
    ctx = multiprocessing.get_context("spawn")
    writer = ring(num_readers=1, num_slots=2, slot_bytes=256, ctx=ctx)
    replies, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_sleepy_reader, args=(writer.handle, writer.doorbells[0], child_end))
    proc.start()
    try:
        time.sleep(3.0)  # the reader spins 1 ms, then sleeps on its doorbell
        sent = time.monotonic()
        writer.write(b"wake")
        arrived, data, cpu = replies.recv()
    finally:
        proc.join(10)
    assert data == b"wake"
    # Rung, not found by the once-a-second safety wake-up (which alone would average 0.5 s).
    assert arrived - sent < 0.1, f"woke {arrived - sent:.3f} s after the message"
    # Three idle seconds cost about three safety wake-ups; polling with backoff cost ~150.
    assert cpu < 0.1, f"the sleeping reader used {cpu:.3f} CPU seconds"
