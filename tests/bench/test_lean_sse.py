"""scripts/lean_sse.py reads a stream as curl does: every event counted, however the bytes split."""

from __future__ import annotations

import asyncio
import json

import pytest

from scripts.lean_sse import completion_body, stream_raw


def _events(tokens: int) -> list[bytes]:
    chunks = [
        b"data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}).encode() + b"\n\n"
        for i in range(tokens)
    ]
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}
    return [*chunks, b"data: " + json.dumps(usage).encode() + b"\n\n", b"data: [DONE]\n\n"]


def _against(serve, body: dict) -> dict:
    """stream_raw(body) against a one-connection server running serve(reader, writer)."""

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await stream_raw("127.0.0.1", port, body)

    return asyncio.run(main())


@pytest.mark.parametrize("split", [1, 4, 1000])
def test_every_event_is_counted_however_the_bytes_split(split):
    """The server writes the stream in pieces of `split` bytes (chunked encoding), pausing
    between pieces, so an event marker may straddle two reads."""
    received: list[dict] = []

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        received.append(json.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = b"".join(_events(5))
        for i in range(0, len(body), split):
            piece = body[i : i + split]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    result = _against(serve, completion_body("m", [1, 2, 3], 5))
    assert received == [completion_body("m", [1, 2, 3], 5)]
    assert result["tokens"] == 5 and result["text_chunks"] == 5
    assert result["ttft_ms"] >= 0 and result["decode_tok_s"] >= 0


def test_a_refused_request_raises():
    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nnope!")
        await writer.drain()
        writer.close()

    with pytest.raises(RuntimeError, match="400 Bad Request"):
        _against(serve, completion_body("m", [1], 1))
