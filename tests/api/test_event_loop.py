"""Heavy work stays off the API server's event loop: while a 10 MB /tokenize body is tokenized,
/health answers at once (the tokenizer runs in a thread; it used to stall every request for
15-20 s). A behaviour check with a wide margin, not a benchmark."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.serve.conftest import Server, tiny_model  # noqa: F401 - tiny_model is a fixture

PROMPT = "The quick brown fox jumps over the lazy dog. " * (10 * 1024 * 1024 // 45)


@pytest.fixture(scope="module")
def big_body_server(tiny_model):  # noqa: F811
    srv = Server(["--model", str(tiny_model), "--device", "cpu", "--kv-cache-memory", "16MiB",
                  "--max-model-len", "256", "--served-model-name", "tiny",
                  "--max-request-body", str(32 * 1024 * 1024)])
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def test_health_answers_while_a_10_mb_body_is_tokenized(big_body_server):
    url = big_body_server.api_url
    result: dict = {}

    def heavy() -> None:
        started = time.monotonic()
        resp = requests.post(url + "/tokenize", json={"prompt": PROMPT}, timeout=300)
        result.update(status=resp.status_code, count=resp.json().get("count"),
                      seconds=time.monotonic() - started)

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
