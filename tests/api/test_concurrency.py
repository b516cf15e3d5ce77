"""Many concurrent streams against `engine serve`, and streams closed mid-way: every request
finishes, and an aborted stream frees its sequence and KV cache (seen on /metrics)."""

from __future__ import annotations

import asyncio
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import API_KEY, MODEL
from tests.serve.conftest import wait_until

PROMPT = "The capital of France is"


def _metrics(server) -> dict[str, float]:
    """name{labels} -> value of every sample on /metrics (labels sorted; model_name and engine,
    one each here, dropped)."""
    with urllib.request.urlopen(server.api_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _idle(server) -> bool:
    m = _metrics(server)
    return m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


async def _stream_all(client: openai.AsyncOpenAI, max_tokens: int) -> tuple[str, str]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish


async def _stream_and_close(client: openai.AsyncOpenAI, chunks: int) -> int:
    """Read `chunks` chunks of a long stream, then close it (and its HTTP connection)."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=200,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    async for chunk in stream:
        assert chunk.choices[0].finish_reason is None  # closed long before its end
        seen += 1
        if seen == chunks:
            break
    await stream.close()
    return seen


def test_64_concurrent_streams_complete(server):
    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.api_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
        ) as client:
            return await asyncio.gather(*(_stream_all(client, 16) for _ in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(finish == "length" for _, finish in results)
    assert len({text for text, _ in results}) == 1  # greedy: every stream says the same
    assert wait_until(lambda: _idle(server), 10), _metrics(server)


def test_streams_closed_mid_way_free_their_slots(server):
    before = _metrics(server)

    async def main():
        # A client per closed stream, so closing one drops only its own connection.
        closers = [
            openai.AsyncOpenAI(
                base_url=server.api_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
            )
            for _ in range(8)
        ]
        async with openai.AsyncOpenAI(
            base_url=server.api_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
        ) as client:
            try:
                return await asyncio.gather(
                    *(_stream_and_close(c, 3) for c in closers),
                    *(_stream_all(client, 16) for _ in range(8)),
                )
            finally:
                for c in closers:
                    await c.close()

    results = asyncio.run(main())
    assert results[:8] == [3] * 8
    assert all(finish == "length" for _, finish in results[8:])
    # The aborted requests leave the scheduler and give back their KV blocks.
    assert wait_until(lambda: _idle(server), 5), _metrics(server)
    after = _metrics(server)
    finished = {
        k: after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith("vllm:request_success_total")
    }
    # The closed streams were aborted in the engine, not left to run their 200 tokens.
    assert finished == {
        "vllm:request_success_total{finished_reason=abort}": 8,
        "vllm:request_success_total{finished_reason=length}": 8,
    }, finished
    # ...and the server still answers a normal request.
    with openai.OpenAI(
        base_url=server.api_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
    ) as client:
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
