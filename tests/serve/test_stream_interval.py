"""`engine serve --stream-interval 5`: streamed completions arrive in chunks of five tokens (the
first token alone, the end at once), with the same text and usage as the whole answer."""

from __future__ import annotations

import json

from tests.serve.conftest import Server, SseStream, http_request

BODY = {"prompt": "Hello", "max_tokens": 23, "ignore_eos": True, "temperature": 0.0}


def test_streamed_chunks_gather_the_interval(tiny_args):
    server = Server([*tiny_args, "--stream-interval", "5"])
    try:
        assert server.ready, server.stderr
        status, _, whole = http_request(server, "POST", "/v1/completions", BODY)
        assert status == 200
        whole = json.loads(whole)
        stream = SseStream(
            server,
            "/v1/completions",
            {**BODY, "logprobs": 1, "stream_options": {"include_usage": True}},
        )
        events = stream.rest()
        stream.close()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        with_text = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in with_text]
        # 23 tokens: the first, four chunks of five, then the last two with the finish.
        assert sizes == [1, 5, 5, 5, 5, 2], sizes
        assert (
            "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            == (whole["choices"][0]["text"])
        )
        assert chunks[-1]["usage"]["completion_tokens"] == 23
        # A stop string met inside a held chunk: the same text as the whole answer cut there.
        text = whole["choices"][0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 4]
        cut = text[: text.index(stop)]
        stream = SseStream(server, "/v1/completions", {**BODY, "stop": [stop]})
        events = [json.loads(e) for e in stream.rest()[:-1]]
        stream.close()
        assert "".join(c["choices"][0]["text"] for c in events if c["choices"]) == cut
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        assert server.stop() == 0
