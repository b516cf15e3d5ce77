"""`engine serve -dp 2`: two engine cores behind one tokenizer process and API server.

128 streamed requests complete, both engines serve a share (the `engine` label of /metrics),
greedy text equals one engine's (the offline LLM), SIGTERM drains both engines; a killed engine
core fails its requests with 503 at once and stops the tree (exit 1); a headless host's engine
core joins the first host's over loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import Server, pid_gone, tiny_model, wait_until  # noqa: F401

MODEL = "tiny"
PROMPTS = [f"Request number {i} says" for i in range(8)]
MAX_TOKENS = 4


def _args(tiny_model, *extra: str) -> list[str]:
    return [
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
        "--served-model-name",
        MODEL,
        *extra,
    ]


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = Server(_args(tiny_model, "-dp", "2"))
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    srv.stop()  # the drain test stops it first


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_tokens: int = MAX_TOKENS,
    started: asyncio.Event | None = None,
) -> tuple[int, str, str | None]:
    """One streamed completion: (HTTP status, text, error message of an error event or body)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, "", (await resp.json())["error"]["message"]
        text = []
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"]["code"], "".join(text), event["error"]["message"]
            text.append(event["choices"][0]["text"])
            if started is not None:
                started.set()
        return 200, "".join(text), None


async def _stream_all(url: str, prompts: list[str], **kwargs) -> list[tuple[int, str, str | None]]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(_stream(session, url, p, **kwargs) for p in prompts))


async def _streaming(
    session: aiohttp.ClientSession, url: str, n: int, max_tokens: int
) -> list[asyncio.Task]:
    """n long streams, returned once every one has produced text."""
    events = [asyncio.Event() for _ in range(n)]
    tasks = [
        asyncio.create_task(_stream(session, url, PROMPTS[i], max_tokens, e))
        for i, e in enumerate(events)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    return tasks


def _kill_mid_stream(url: str, victim: int) -> tuple[list[tuple[int, str, str | None]], float]:
    """SIGKILL victim while 4 long streams run: their results, and seconds from kill to end."""

    async def run() -> tuple[list[tuple[int, str, str | None]], float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            tasks = await _streaming(session, url, 4, 200)
            os.kill(victim, signal.SIGSTOP)  # frozen mid-request: its requests are in flight
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - killed

    return asyncio.run(run())


def _samples(server: Server) -> dict[tuple[str, str], float]:
    """(sample name, engine label) -> value, summed over the other labels."""
    with urllib.request.urlopen(server.api_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "engine" in s.labels:
                key = (s.name, s.labels["engine"])
                out[key] = out.get(key, 0.0) + s.value
    return out


_ONE_ENGINE = """
import json, sys
from protocol.sampling_params import SamplingParams
from frontend.llm import LLM
llm = LLM(sys.argv[1], device="cpu", max_model_len=256, kv_cache_memory="16MiB")
greedy = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0.0, ignore_eos=True)
print(json.dumps([out.outputs[0].text for out in llm.generate(json.loads(sys.argv[3]), greedy)]))
"""


def _one_engine_greedy(tiny_model) -> list[str]:
    """PROMPTS' greedy texts from one engine (the offline LLM), in a process of its own: the
    metrics it records would otherwise stay in this one."""
    out = subprocess.run(
        [sys.executable, "-c", _ONE_ENGINE, str(tiny_model), str(MAX_TOKENS), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def assert_streams_share_both_engines(
    server: Server, tiny_model, prompts: list[str]
) -> dict[tuple[str, str], float]:
    """Stream prompts (of PROMPTS) at once: each completes with one engine's greedy text, and
    both engines (the `engine` label) served some. Returns _samples(server)."""
    results = asyncio.run(_stream_all(server.api_url, prompts))
    assert all(status == 200 for status, _, _ in results), results

    expected = dict(zip(PROMPTS, _one_engine_greedy(tiny_model)))
    assert [text for _, text, _ in results] == [expected[p] for p in prompts]

    s = _samples(server)
    served = [s.get(("vllm:request_success_total", e), 0) for e in ("0", "1")]
    assert sum(served) == len(prompts) and min(served) > 0, served
    return s


def test_128_streams_share_both_engines_and_match_one_engine(server, tiny_model):
    s = assert_streams_share_both_engines(
        server, tiny_model, [PROMPTS[i % len(PROMPTS)] for i in range(128)]
    )
    tokens = [s.get(("vllm:generation_tokens_total", e), 0) for e in ("0", "1")]
    assert sum(tokens) == 128 * MAX_TOKENS and min(tokens) > 0, tokens
    # Each engine's requests produced that engine's tokens: the totals agree per engine.
    assert [s.get(("vllm:request_generation_tokens_sum", e), 0) for e in ("0", "1")] == tokens


def test_sigterm_drains_both_engines(server):
    async def run() -> list[tuple[int, str, str | None]]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = await _streaming(session, server.api_url, 6, 150)
            # The gauges follow the engines' step reports: poll until both show their share.
            deadline = time.monotonic() + 15
            while not all(
                (running := _samples(server)).get(("vllm:num_requests_running", e), 0) > 0
                for e in "01"
            ):
                assert time.monotonic() < deadline, running
                await asyncio.sleep(0.2)
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * 6, results
    assert server.proc.wait(timeout=60) == 0, server.stderr


def test_a_killed_engine_core_fails_its_requests_and_stops_the_tree(tiny_model):
    srv = Server(_args(tiny_model, "-dp", "2"))
    assert srv.ready, srv.stderr
    children = srv.children()
    victim = next(pid for pid, name in children.items() if name == "engine-core-1")
    try:
        results, took = _kill_mid_stream(srv.api_url, victim)
    finally:
        if srv.proc.poll() is None and not pid_gone(victim):
            os.kill(victim, signal.SIGKILL)
    failed = [r for r in results if r[0] != 200]
    assert failed and all(status == 503 for status, _, _ in failed), results
    # The tokenizer process names the dead rank ("engine core rank 1: ..."), unless the
    # launcher saw the exit first and stopped the tree ("engine-core-1 (pid ...) exited").
    assert all(
        "engine core" in message or "engine-core-1" in message for _, _, message in failed
    ), failed
    assert took < 10, took
    assert srv.proc.wait(timeout=30) == 1
    assert "engine-core-1" in srv.stderr and "exited unexpectedly" in srv.stderr
    assert wait_until(lambda: all(pid_gone(pid) for pid in children), timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_hosts(tiny_model) -> tuple[Server, Server]:
    """A first host with rank 0 and a headless host with rank 1, over loopback."""
    dp = [
        "-dp",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(_free_port()),
    ]
    first: list[Server] = []
    starter = threading.Thread(target=lambda: first.append(Server(_args(tiny_model, *dp))))
    starter.start()  # it waits for the headless rank before it is ready
    headless = Server(_args(tiny_model, *dp, "--headless", "--data-parallel-start-rank", "1"))
    starter.join(timeout=120)
    assert headless.ready, headless.stderr
    assert first and first[0].ready and first[0].api_url, first and first[0].stderr
    return first[0], headless


def test_a_headless_host_joins_the_first_host(tiny_model):
    srv, headless = _two_hosts(tiny_model)
    try:
        assert list(headless.children().values()) == ["engine-core-1"]
        results = asyncio.run(_stream_all(srv.api_url, PROMPTS * 2))
        assert all(status == 200 for status, _, _ in results), results
        # The first host's tokenizer process labels each request with its engine.
        s = _samples(srv)
        served = [s.get(("vllm:request_success_total", e), 0) for e in ("0", "1")]
        assert sum(served) == 16 and min(served) > 0, served
    finally:
        assert srv.stop() == 0, srv.stderr
        # The first host tells the headless one to stop.
        assert headless.proc.wait(timeout=30) == 0, headless.stderr


def test_a_headless_engine_core_death_fails_requests_and_both_hosts(tiny_model):
    srv, headless = _two_hosts(tiny_model)
    victim = next(iter(headless.children()))
    try:
        results, took = _kill_mid_stream(srv.api_url, victim)
    except BaseException:
        srv.stop()
        headless.stop()
        raise
    # The first host has no pid to watch: the closed connection tells its tokenizer process.
    failed = [r for r in results if r[0] != 200]
    assert failed and all(status == 503 for status, _, _ in failed), results
    assert took < 10, took
    assert headless.proc.wait(timeout=30) == 1, headless.stderr
    assert srv.proc.wait(timeout=30) == 1, srv.stderr
    assert "headless ranks 1" in srv.stderr, srv.stderr
