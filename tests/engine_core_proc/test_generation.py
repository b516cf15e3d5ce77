"""A client against an engine core process: same tokens as in-process, several clients,
aborts, utility calls and refused requests."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine_core.client import (
    AsyncEngineCoreClient,
    EngineCoreClient,
    EngineRequestError,
    UtilityCallError,
)
from engine_core.inproc_client import InprocClient
from engine_core.resolve import resolved_config
from protocol.engine_core import PROTOCOL_VERSION, EngineCoreRequest, FinishReason
from protocol.frames import tolist
from protocol.sampling_params import SamplingParams
from tests.engine_core_proc.utils import PROMPTS, collect, greedy_request


def _run_all(client, prefix: str) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        client.add_request(greedy_request(f"{prefix}{i}", prompt))
    done = collect(client, {f"{prefix}{i}" for i in range(len(PROMPTS))})
    return {rid[len(prefix) :]: tokens for rid, (tokens, _) in done.items()}


def test_child_process_matches_in_process_engine(engine_args):
    local = InprocClient(resolved_config(**engine_args))
    expected = _run_all(local, "r")
    with EngineCoreClient(engine_args=engine_args) as client:
        assert client.ready.protocol_version == PROTOCOL_VERSION
        assert client.ready.vocab_size == 512 and client.ready.eos_token_ids == [2]
        assert client.ready.max_model_len == 256 and client.ready.num_blocks > 0
        assert _run_all(client, "r") == expected
        process = client.process
    assert process.exit_code() == 0, "shutdown() should stop the child it started"


def test_two_clients_get_only_their_own_outputs(address):
    with EngineCoreClient(address) as a, EngineCoreClient(address) as b:
        for i, prompt in enumerate(PROMPTS):
            a.add_request(greedy_request(f"a{i}", prompt, max_tokens=6 + i))
            b.add_request(greedy_request(f"b{i}", prompt, max_tokens=6 + i))
        got_a = collect(a, {f"a{i}" for i in range(len(PROMPTS))})
        got_b = collect(b, {f"b{i}" for i in range(len(PROMPTS))})
    for i in range(len(PROMPTS)):
        assert len(got_a[f"a{i}"][0]) == 6 + i
        assert got_a[f"a{i}"] == got_b[f"b{i}"]


def test_async_client(address):
    async def main():
        clients = [await AsyncEngineCoreClient.create(address) for _ in range(2)]
        try:
            for n, client in enumerate(clients):
                await client.add_request(greedy_request(f"async{n}", PROMPTS[0], max_tokens=5))
            results = []
            for n, client in enumerate(clients):
                tokens = []
                while True:
                    out = (await client.get_output()).outputs
                    assert {o.request_id for o in out} == {f"async{n}"}
                    tokens += out[0].new_token_ids
                    if out[0].finished:
                        break
                results.append(tokens)
            assert await clients[0].call_utility("ping") == "pong"
            return results
        finally:
            for client in clients:
                client.shutdown()

    first, second = asyncio.run(main())
    assert len(first) == 5 and first == second


def test_abort_ends_request_and_frees_it(address):
    with EngineCoreClient(address) as client, EngineCoreClient(address) as other:
        client.add_request(greedy_request("long", PROMPTS[1], max_tokens=200))
        assert client.get_output().outputs[0].request_id == "long"
        other.abort_requests(["long"])  # not its request: ignored
        assert not client.get_output().outputs[0].finished
        client.abort_requests(["long", "unknown-id"])
        tokens, reason = collect(client, {"long"})["long"]
        assert reason == FinishReason.ABORT and len(tokens) < 200
        assert client.call_utility("get_stats")["num_unfinished_requests"] == 0


def test_utility_calls(address):
    with EngineCoreClient(address) as client:
        assert client.call_utility("ping") == "pong"
        assert client.call_utility("reset_prefix_cache") is True
        before = client.call_utility("get_stats")
        client.add_request(greedy_request("u0", PROMPTS[0], max_tokens=3))
        collect(client, {"u0"})
        after = client.call_utility("get_stats")
        assert after["num_generation_tokens"] - before["num_generation_tokens"] == 3
        assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == len(PROMPTS[0])
        with pytest.raises(UtilityCallError, match="unknown utility method 'shutdown'"):
            client.call_utility("shutdown")
        with pytest.raises(UtilityCallError, match="TypeError"):
            client.call_utility("ping", 1, 2)


def test_refused_requests_get_errors_and_others_carry_on(address):
    # ok1 runs ~240 steps, so it is certainly still running when its duplicate arrives (with 8
    # steps it could finish first on a loaded machine, the duplicate was then accepted, and the
    # loop below waited forever for a third error).
    long_run = 250 - len(PROMPTS[0])
    with EngineCoreClient(address) as client:
        client.add_request(greedy_request("ok1", PROMPTS[0], max_tokens=long_run))
        client.add_request(greedy_request("too-long", [5] * 300))
        client.add_request(greedy_request("bad-token", [1, 2, 512]))
        client.add_request(greedy_request("ok1", PROMPTS[1]))  # id in use
        client.add_request(greedy_request("ok2", PROMPTS[2], max_tokens=8))
        errors, done, tokens = {}, {}, {"ok1": [], "ok2": []}
        while len(done) < 2 or len(errors) < 3:
            try:
                outputs = client.get_output(timeout=60).outputs
            except EngineRequestError as e:
                errors[e.request_id] = str(e)
                continue
            for out in outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = out.finish_reason
    assert "maximum context length is 256" in errors["too-long"]
    assert "outside the vocabulary" in errors["bad-token"]
    assert "already in use" in errors["ok1"]
    assert done == {"ok1": FinishReason.LENGTH, "ok2": FinishReason.LENGTH}
    assert (len(tokens["ok1"]), len(tokens["ok2"])) == (long_run, 8)


def _outputs(client, request: EngineCoreRequest) -> list:
    client.add_request(request)
    outputs = []
    while not outputs or not outputs[-1].finished:
        outputs += client.get_output().outputs
    return outputs


def _assert_same_logprobs(local, remote) -> None:
    assert isinstance(remote.token_ids, np.ndarray), "large logprobs should travel as frames"
    assert remote.token_ids.tolist() == tolist(local.token_ids)
    assert tolist(remote.ranks) == tolist(local.ranks)
    np.testing.assert_allclose(remote.logprobs, np.array(local.logprobs), rtol=0, atol=1e-6)


def test_long_prompt_and_whole_vocabulary_logprobs_over_frames(engine_args, monkeypatch):
    args = {**engine_args, "max_logprobs": -1}
    prompt = [(7 * i) % 500 + 3 for i in range(200)]  # 800 bytes as int32: an array frame
    params = SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=4, logprobs=-1, prompt_logprobs=-1
    )
    local = _outputs(InprocClient(resolved_config(**args)), EngineCoreRequest("lp", prompt, params))
    with EngineCoreClient(engine_args=args) as client:
        sent = []
        send = client._socket.send_multipart
        monkeypatch.setattr(
            client._socket,
            "send_multipart",
            lambda frames, **kw: (sent.append(len(frames)), send(frames, **kw))[1],
        )
        remote = _outputs(client, EngineCoreRequest("lp", prompt, params))
    assert sent == [3], "the prompt should travel as [type, payload, array frame]"
    assert [o.new_token_ids for o in remote] == [o.new_token_ids for o in local]
    first_local, first_remote = local[0], remote[0]
    assert first_remote.new_prompt_logprobs.token_ids.shape == (len(prompt) - 1, 513)
    _assert_same_logprobs(first_local.new_prompt_logprobs, first_remote.new_prompt_logprobs)
    for lo, re in zip(local, remote):
        _assert_same_logprobs(lo.new_logprobs, re.new_logprobs)
