"""`engine serve` with the default model and two tokenizer processes: text equal to LLM's,
pinning, stop strings, refused requests, process names and the asyncio client."""

from __future__ import annotations

import asyncio
import contextlib
import zlib

import msgspec
import pytest
import zmq

from engine_core.client import EngineCoreClient
from frontend.llm import LLM
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import (
    TOKENIZER_PROTOCOL_VERSION,
    ApiOutputType,
    ApiRequestType,
    GenerateRequest,
    TokenizerHello,
    api_output_decoders,
)
from tests.serve.conftest import Server, wait_until
from tokenizer_proc.client import (
    BlockingTokenizerClient,
    TokenizerClient,
    TokenizerRequestError,
    pin_worker,
)

ENGINE_ARGS = dict(device="cpu", kv_cache_memory="64MiB", max_model_len=512)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def server():
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    srv = Server([*flags, "--tokenizer-workers", "2"])
    assert srv.ready, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


@pytest.fixture(scope="module")
def client(server):
    c = BlockingTokenizerClient(server.tokenizer_addresses)
    yield c
    c.close()


@pytest.fixture(scope="module")
def core(server):
    with EngineCoreClient(server.core_address) as c:
        yield c


def _text(deltas) -> str:
    return "".join(d.text for d in deltas)


def _engine_idle(core: EngineCoreClient) -> bool:
    return core.call_utility("get_stats", timeout=10)["num_unfinished_requests"] == 0


def test_greedy_text_matches_llm(client):
    llm = LLM(engine_process=False, **ENGINE_ARGS)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for i, prompt in enumerate(PROMPTS):
        deltas = client.generate(GenerateRequest(f"greedy-{i}", GREEDY, prompt=prompt))
        assert _text(deltas) == expected[i]
        assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
        assert deltas[0].num_prompt_tokens == len(llm.tokenizer(prompt).input_ids)


def test_requests_are_pinned_by_hash(client, server):
    assert pin_worker("abc", 7) == zlib.crc32(b"abc") % 7
    ids = [f"pin-{i}" for i in range(8)]
    assert {pin_worker(r, 2) for r in ids} == {0, 1}, "both workers should get requests"
    for r in ids:
        client.send(GenerateRequest(r, GREEDY, prompt_token_ids=[1, 2, 3]))
    texts = {_text(client.deltas(r)) for r in ids}
    assert len(texts) == 1, "the same greedy prompt gives the same text on either worker"
    # An abort goes to the request's pinned worker; another client's abort never touches it.
    other = BlockingTokenizerClient(server.tokenizer_addresses[::-1])
    try:
        other.send(GenerateRequest("pin-x", SamplingParams(max_tokens=4), prompt="a"))
        client.abort("pin-x")
        assert list(other.deltas("pin-x"))[-1].finish_reason == "length"
    finally:
        other.close()


def test_stop_string_ends_text_and_aborts(client, core):
    full = _text(
        client.generate(
            GenerateRequest(
                "full",
                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                prompt=PROMPTS[2],
            )
        )
    )
    words = full.split()
    stop = words[len(words) // 2]
    deltas = client.generate(
        GenerateRequest(
            "stopped",
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
            prompt=PROMPTS[2],
        )
    )
    assert _text(deltas) == full[: full.index(stop)]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert sum(len(d.token_ids) for d in deltas) < 24
    assert wait_until(lambda: _engine_idle(core)), "the stopped request should be aborted"


def test_refused_requests_name_the_problem(client, server):
    client.send(GenerateRequest("ok", GREEDY, prompt=PROMPTS[0]))
    bad = {
        "long": (
            GenerateRequest("long", GREEDY, prompt_token_ids=[5] * 600),
            "maximum context length is 512 tokens, but the prompt has 600 tokens",
        ),
        "vocab": (GenerateRequest("vocab", GREEDY, prompt_token_ids=[10**6]), "vocabulary"),
        "both": (GenerateRequest("both", GREEDY, prompt="a", prompt_token_ids=[1]), "exactly one"),
    }
    for request, _ in bad.values():
        client.send(request)
    for request_id, (_, needle) in bad.items():
        with pytest.raises(TokenizerRequestError) as err:
            list(client.deltas(request_id))
        assert err.value.status == 400 and needle in str(err.value)
    assert list(client.deltas("ok"))[-1].finished, "other requests carry on"


def test_malformed_frames_get_errors(server):
    addr = server.tokenizer_addresses[pin_worker("neg", 2)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    decoders = api_output_decoders()
    bad_params = msgspec.msgpack.encode(["neg", {"temperature": -1.0}, "hi"])
    for frames in (
        [b"\x07", b""],
        [bytes([ApiRequestType.GENERATE]), bad_params],
        [
            bytes([ApiRequestType.HELLO]),
            msgspec.msgpack.encode(TokenizerHello(TOKENIZER_PROTOCOL_VERSION + 1)),
        ],
    ):
        sock.send_multipart(frames)
        assert sock.poll(10_000)
        kind, payload = sock.recv_multipart()
        assert kind[0] == ApiOutputType.ERROR
        error = decoders[kind[0]].decode(payload)
        assert error.status == 400
    assert error.request_id == "" and "version" in error.message
    sock.close()


def test_process_names(server):
    assert sorted(server.children().values()) == [
        "engine-api-0",
        "engine-core",
        "engine-tok-0",
        "engine-tok-1",
    ]


def test_async_client_streams_and_aborts(server, core):
    async def main() -> None:
        client = await TokenizerClient.create(server.tokenizer_addresses)
        try:
            assert [r.worker_index for r in client.ready] == [0, 1]
            params = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
            deltas = [
                d
                async for d in client.generate(
                    GenerateRequest("async-n", params, messages=[{"role": "user", "content": "Hi"}])
                )
            ]
            for index in (0, 1):
                mine = [d for d in deltas if d.index == index]
                assert sum(len(d.token_ids) for d in mine) == 4 and mine[-1].finished
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            async with contextlib.aclosing(
                client.generate(GenerateRequest("async-abort", long, prompt="a"))
            ) as stream:
                async for _ in stream:
                    break  # closing the stream early aborts the request
        finally:
            client.shutdown()

    asyncio.run(main())
    assert wait_until(lambda: _engine_idle(core)), "the abandoned request should be aborted"
