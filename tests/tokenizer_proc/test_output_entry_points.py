"""Finish and stop rules through both entry points of the one output pipeline, on a tiny random
model: the offline LLM (in-process engine core) and `engine serve`'s tokenizer process (its
RequestDeltas, read as an API server reads them). Same prompt, same parameters: same text,
tokens, finish and stop reasons; and the server never streams text it later takes back."""

from __future__ import annotations

import pytest

from frontend.llm import LLM
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest
from tests.serve.conftest import Server, tiny_model  # noqa: F401 (fixture)
from tokenizer_proc.client import BlockingTokenizerClient

PROMPT = [1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
ENGINE_ARGS = ["--device", "cpu", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(
        str(tiny_model),
        engine_process=False,
        device="cpu",
        kv_cache_memory="16MiB",
        max_model_len=256,
    )


@pytest.fixture(scope="module")
def tokenizer_client(tiny_model):
    server = Server(["--model", str(tiny_model), *ENGINE_ARGS, "--api-server-count", "0"])
    assert server.ready, server.stderr
    client = BlockingTokenizerClient(server.tokenizer_addresses)
    yield client
    client.close()
    assert server.stop() == 0, server.stderr


def offline(llm, params: SamplingParams):
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]


def served(client, params: SamplingParams, request_id: str) -> dict[int, list]:
    deltas = client.generate(
        GenerateRequest(request_id, params, prompt_token_ids=PROMPT), timeout=120
    )
    by_index: dict[int, list] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta)
    return by_index


def assert_same(llm, client, params: SamplingParams, request_id: str):
    """The offline output and the server's deltas agree; returns the offline output."""
    out = offline(llm, params)
    streams = served(client, params, request_id)
    assert sorted(streams) == [c.index for c in out.outputs]
    for completion in out.outputs:
        deltas = streams[completion.index]
        assert "".join(d.text for d in deltas) == completion.text
        assert [t for d in deltas for t in d.token_ids] == completion.token_ids
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (
            completion.finish_reason,
            completion.stop_reason,
        )
    return out


def test_length_finish(llm, tokenizer_client):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = assert_same(llm, tokenizer_client, params, "length")
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_through_both(llm, tokenizer_client, include):
    base = offline(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    text = base.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    out = assert_same(llm, tokenizer_client, params, f"stop-{include}")
    completion = out.outputs[0]
    end = text.index(stop) + (len(stop) if include else 0)
    assert completion.text == text[:end]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < 24


def test_stop_token_id_through_both(llm, tokenizer_client):
    base = offline(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_id = base.outputs[0].token_ids[5]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]
    )
    out = assert_same(llm, tokenizer_client, params, "stop-id")
    completion = out.outputs[0]
    first = base.outputs[0].token_ids.index(stop_id)
    assert completion.token_ids == base.outputs[0].token_ids[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_n_sequences_and_logprobs_through_both(llm, tokenizer_client):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    out = assert_same(llm, tokenizer_client, params, "n2")
    assert [c.index for c in out.outputs] == [0, 1] and out.finished
    deltas = served(tokenizer_client, params, "n2-again")
    for completion in out.outputs:
        # The sampled token comes first at each position, on both sides.
        sampled = [p[0] for d in deltas[completion.index] for p in d.logprobs]
        assert [t.token_id for t in sampled] == completion.token_ids
        assert sum(t.logprob for t in sampled) == pytest.approx(
            completion.cumulative_logprob, abs=1e-4
        )
