"""A streamed /v1/completions request read the way `curl -N` reads it: raw bytes off one socket,
events timed as they arrive, only the last (usage) event parsed.

The benchmark clients in bench/serve.py and the OpenAI SDK decode every event's JSON (about
0.2 ms of CPU per token on a 2-core machine): on the machine under test that is CPU the server's
own processes then lack. scripts/serving_overhead.py measures the server with this client too,
so that what the server costs a stream is told apart from what the measuring client costs.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The benchmarks' streamed request: greedy, EOS ignored, usage in a last event."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def _dechunk(buf: bytes) -> tuple[bytes, bytes]:
    """The payload of the complete HTTP/1.1 chunks at the start of buf, and what is left."""
    payload = []
    while (eol := buf.find(b"\r\n")) >= 0:
        size = int(buf[:eol].split(b";", 1)[0], 16)
        if len(buf) < eol + 2 + size + 2:
            break
        payload.append(buf[eol + 2 : eol + 2 + size])
        buf = buf[eol + 2 + size + 2 :]
    return b"".join(payload), buf


async def stream_raw(host: str, port: int, body: dict[str, Any]) -> dict[str, float | int]:
    """POST body (stream: true, stream_options.include_usage: true) to /v1/completions; returns
    TTFT, decode tok/s (tokens after the first over the first to the last text event, as
    scripts/llama_server_bench.py counts), tokens and text events."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    start = time.perf_counter()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (host.encode(), port, len(payload), payload)
    )
    await writer.drain()
    times: list[float] = []  # one per data event, [DONE] included
    tail = b""  # the last bytes of the event stream (HTTP framing removed)
    buf, head, chunked = b"", None, False
    try:
        while chunk := await reader.read(65536):
            now = time.perf_counter()
            buf += chunk
            if head is None:
                if b"\r\n\r\n" not in buf:
                    continue
                head, buf = buf.split(b"\r\n\r\n", 1)
                status = head.split(b"\r\n", 1)[0]
                if b" 200 " not in status + b" ":
                    rest = buf + await reader.read(4096)
                    raise RuntimeError(f"{status.decode()}: {rest[:200]!r}")
                chunked = b"transfer-encoding: chunked" in head.lower()
            data, buf = _dechunk(buf) if chunked else (buf, b"")
            # With the last 5 bytes before it: an event marker split between two reads.
            times += [now] * (tail[-5:] + data).count(b"data: ")
            tail = (tail + data)[-4096:]
    finally:
        writer.close()
    if not times:
        raise RuntimeError(f"no events streamed: {tail[:200]!r}")
    # The last two events are the usage event and [DONE]: the rest carried text.
    events = tail.split(b"data: ")
    usage = json.loads(events[-2].split(b"\n\n", 1)[0])["usage"]
    text_times = times[:-2]
    tokens = usage["completion_tokens"]
    decode_s = text_times[-1] - text_times[0] if len(text_times) > 1 else 0.0
    return {
        "ttft_ms": round((text_times[0] - start) * 1e3, 2),
        "decode_tok_s": round((tokens - 1) / decode_s, 2) if decode_s else 0.0,
        "tokens": tokens,
        "text_chunks": len(text_times),
    }
