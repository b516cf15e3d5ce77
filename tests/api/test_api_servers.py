"""`engine serve --api-server-count 2`: two API server processes share one port."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.serve.conftest import Server, pid_gone, wait_until

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tiny_model):
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
            "--api-server-count",
            "2",
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def test_two_api_servers_share_the_port(server, tiny_model):
    import openai

    children = server.children()
    assert sorted(children.values()) == [
        "engine-api-0",
        "engine-api-1",
        "engine-core",
        "engine-tok-0",
    ]
    model = (
        openai.OpenAI(base_url=server.api_url + "/v1", api_key="none", max_retries=0)
        .models.list()
        .data[0]
        .id
    )
    assert model == str(tiny_model)  # the served name defaults to --model

    def complete(_):
        # A fresh client (connection) per request, so the kernel spreads them.
        with openai.OpenAI(base_url=server.api_url + "/v1", api_key="none", max_retries=0) as c:
            return (
                c.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0.0)
                .choices[0]
                .text
            )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(complete, range(12)))
    assert len(set(texts)) == 1
    api_pids = [pid for pid, name in children.items() if name.startswith("engine-api")]
    assert server.stop() == 0, server.stderr
    assert wait_until(lambda: all(pid_gone(pid) for pid in api_pids), 5)
