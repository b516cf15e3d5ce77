"""`engine serve` start-up, draining shutdown and failure handling, with a tiny model."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest
from tests.serve.conftest import Server, pid_gone, wait_until
from tokenizer_proc.client import BlockingTokenizerClient, TokenizerRequestError

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _started(args: list[str]) -> tuple[Server, BlockingTokenizerClient, dict[int, str]]:
    server = Server(args)
    assert server.ready, server.stderr
    children = server.children()
    assert sorted(children.values()) == ["engine-api-0", "engine-core", "engine-tok-0"]
    return server, BlockingTokenizerClient(server.tokenizer_addresses), children


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_args):
    server, client, children = _started([*tiny_args, "--shutdown-timeout", "20"])
    core = next(pid for pid, name in children.items() if name == "engine-core")
    try:
        client.send(GenerateRequest("drain", LONG, prompt="Hello"))
        deltas = [next(client.deltas("drain"))]
        os.kill(core, signal.SIGSTOP)  # hold the request in flight until the drain has begun
        server.proc.send_signal(signal.SIGTERM)
        # An over-long probe is refused with 400 while serving, 503 once new requests are refused.
        probe = GenerateRequest("probe", LONG, prompt_token_ids=[5] * 300)
        assert wait_until(lambda: _status(client, probe) == 503)
        os.kill(core, signal.SIGCONT)
        deltas += client.deltas("drain")
        assert sum(len(d.token_ids) for d in deltas) == 200
        assert deltas[-1].finish_reason == "length"
    finally:
        client.close()
    assert server.proc.wait(timeout=30) == 0, server.stderr
    assert all(pid_gone(pid) for pid in children)


def _status(client: BlockingTokenizerClient, request: GenerateRequest) -> int:
    try:
        client.generate(request, timeout=10)
    except TokenizerRequestError as e:
        return e.status
    return 200


def test_children_die_with_a_killed_launcher(tiny_args):
    server, client, children = _started(tiny_args)
    client.close()
    server.proc.kill()
    server.proc.wait()
    assert wait_until(lambda: all(pid_gone(pid) for pid in children), timeout=5), (
        "children outlived the launcher"
    )
    for address in (server.core_address, *server.tokenizer_addresses):  # nobody else removes them
        shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)


def test_engine_core_death_fails_requests_and_the_launcher(tiny_args):
    server, client, children = _started(tiny_args)
    core = next(pid for pid, name in children.items() if name == "engine-core")
    try:
        client.send(GenerateRequest("doomed", LONG, prompt="Hello"))
        next(client.deltas("doomed"))
        os.kill(core, signal.SIGSTOP)  # freeze it mid-request, so the request is in flight
        os.kill(core, signal.SIGKILL)
        with pytest.raises(TokenizerRequestError, match="engine core") as err:
            list(client.deltas("doomed", timeout=10))
        assert err.value.status == 503
    finally:
        client.close()
    assert server.proc.wait(timeout=30) == 1
    assert "engine-core" in server.stderr and "exited unexpectedly" in server.stderr
    assert wait_until(lambda: all(pid_gone(pid) for pid in children), timeout=5)


def test_a_child_failing_at_start_up_stops_the_rest(tiny_model, tmp_path):
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(
        tiny_model, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*")
    )
    server = Server(
        [
            "--model",
            str(no_tokenizer),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
        ]
    )
    assert not server.ready
    assert server.proc.wait(timeout=30) == 1
    assert "engine-tok-0" in server.stderr and "during start-up" in server.stderr
