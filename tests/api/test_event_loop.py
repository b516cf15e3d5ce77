"""Heavy work stays off the event loops: while a 10 MB /tokenize body is tokenized, /health
answers at once, and while a 10 MB prompt is tokenized in the tokenizer process, the streams
it forwards go on (both tokenize in a thread; they used to stall for 10-20 s). Behaviour checks
with a wide margin, not benchmarks."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.serve.conftest import Server, tiny_model  # noqa: F401 - tiny_model is a fixture

PROMPT = "The quick brown fox jumps over the lazy dog. " * (10 * 1024 * 1024 // 45)


@pytest.fixture(scope="module")
def big_body_server(tiny_model):
    srv = Server(
        [
            "--model",
            str(tiny_model),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
            "--served-model-name",
            "tiny",
            "--max-request-body",
            str(32 * 1024 * 1024),
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def test_health_answers_while_a_10_mb_body_is_tokenized(big_body_server):
    url = big_body_server.api_url
    result: dict = {}

    def heavy() -> None:
        started = time.monotonic()
        resp = requests.post(url + "/tokenize", json={"prompt": PROMPT}, timeout=300)
        result.update(
            status=resp.status_code,
            count=resp.json().get("count"),
            seconds=time.monotonic() - started,
        )

    worker = threading.Thread(target=heavy)
    worker.start()
    latencies = []
    with requests.Session() as health:
        while worker.is_alive():
            started = time.monotonic()
            assert health.get(url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    worker.join()
    assert result["status"] == 200 and result["count"] > 2_000_000, result
    assert len(latencies) >= 3, (result, latencies)  # it took long enough to be measured
    assert max(latencies) < 1.0, (result, sorted(latencies)[-5:])


def test_a_stream_keeps_flowing_while_a_10_mb_prompt_is_tokenized(big_body_server):
    """The tokenizer process tokenizes a prompt in a thread: the streams it forwards go on."""
    url = big_body_server.api_url
    result: dict = {}

    def heavy() -> None:
        resp = requests.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
            timeout=300,
        )
        result.update(status=resp.status_code, done=time.monotonic())

    stream = requests.post(
        url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 250,
            "ignore_eos": True,
            "n": 4,
            "stream": True,
        },
        stream=True,
        timeout=300,
    )
    worker = threading.Thread(target=heavy)
    arrivals = []
    for line in stream.iter_lines():
        if line.startswith(b"data: "):
            arrivals.append(time.monotonic())
            if len(arrivals) == 1:
                worker.start()
                sent = time.monotonic()
    worker.join()
    assert result["status"] == 400, result  # longer than the context
    # The 10 MB prompt reached the tokenizer process (~0.3 s) while the stream still ran, and
    # took longer to tokenize than the rest of the stream: the two overlapped.
    late = [t for t in arrivals if t > sent + 0.3]
    gaps = [b - a for a, b in zip(late, late[1:])]
    assert gaps and max(gaps) < 1.0, sorted(gaps)[-5:]
    assert len(late) > 50 and result["done"] > arrivals[-1], (len(late), result, arrivals[-1])
