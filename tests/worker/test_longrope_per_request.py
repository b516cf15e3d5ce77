"""LongRoPE's factor set chosen per request by the engine core, as transformers' Phi-3 does: a
request turns with the short factors while its tokens stay within original_max_position_embeddings,
with the long ones from the start when its prompt exceeds it, and one that crosses it during
decode is recomputed from scratch with the long factors (transformers' generate() drops its
cache and re-encodes, PR 33129). The Phi-4-mini-shaped model of test_phi3.py (initializer_range
0.3: the factors decide the tokens), through the whole engine (scheduler and runner) at the
default max_model_len (128, past the original 32), compared with transformers' generate()."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.block_hash import make_block_hasher
from engine_core.inproc_client import InprocClient
from engine_core.request import Request
from engine_core.resolve import resolved_config
from protocol.engine_core import EngineCoreRequest
from protocol.sampling_params import SamplingParams
from protocol.step import SchedulerOutput
from tests.engine_core_proc.utils import collect
from tests.worker.runner_utils import hf_causal_lm, hf_greedy, random_prompts
from tests.worker.test_phi3 import CASES, ORIGINAL, _make_phi3

NEW_TOKENS = 16
# short: 10 + 16 tokens stay within 32; long: a 40-token prompt; crossing: 24 + 16 crosses 32
# at its 9th generated token's step (transformers re-encodes there).
LENGTHS = {"short": 10, "long": 40, "crossing": 24}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, list[int]], dict[str, list[int]]]:
    model_dir = _make_phi3(tmp_path_factory.mktemp("phi4"), **CASES["phi4-mini-longrope"])
    prompts = {
        name: ids
        for name, ids in zip(LENGTHS, random_prompts(512, LENGTHS.values(), seed=11).values())
    }
    reference, _ = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    return model_dir, prompts, reference


def _generate(model_dir: Path, prompts: dict[str, list[int]], **engine_args):
    """The engine's greedy tokens for the prompts, submitted together, and every
    SchedulerOutput it sent the workers."""
    client = InprocClient(
        resolved_config(model=str(model_dir), device="cpu", kv_cache_memory="4MiB", **engine_args)
    )
    sent: list[SchedulerOutput] = []
    executor = client.engine_core.executor
    execute, submit = executor.execute_model, executor.submit

    def recording_execute(out: SchedulerOutput):
        sent.append(out)
        return execute(out)

    def recording_submit(out: SchedulerOutput):
        sent.append(out)
        return submit(out)

    executor.execute_model = recording_execute  # type: ignore[method-assign]
    executor.submit = recording_submit  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
    try:
        assert client.engine_core.scheduler.long_rope_at == ORIGINAL
        for name, ids in prompts.items():
            client.add_request(EngineCoreRequest(name, ids, params))
        done = collect(client, set(prompts))
    finally:
        client.shutdown()
    return {name: tokens for name, (tokens, _) in done.items()}, sent


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"async_scheduling": True},
        {"max_num_batched_tokens": 16, "enable_prefix_caching": True},  # prompt chunks
    ],
    ids=["sync", "async", "chunked"],
)
def test_short_long_and_crossing_requests_equal_transformers(model, engine_args):
    """One batch: the short request equals transformers' (short factors), the long prompt's
    (long factors), and the crossing one's (re-encoded with the long factors once its tokens
    pass 32): the engine core resent it from scratch, flagged long, at that step."""
    model_dir, prompts, reference = model
    got, sent = _generate(model_dir, prompts, **engine_args)
    mismatched = {r: (got[r], reference[r]) for r in prompts if got[r] != reference[r]}
    assert not mismatched, f"differ from transformers: {mismatched}"
    starts = {
        name: [(new.rope_long, new.num_computed_tokens, len(new.output_token_ids)) for new in news]
        for name in prompts
        if (news := [n for out in sent for n in out.scheduled_new_reqs if n.req_id == name])
    }
    assert starts["short"] == [(False, 0, 0)]
    assert starts["long"] == [(True, 0, 0)]
    # Started short; resent long with its 9 outputs (the step that would compute position 32,
    # the 33rd token, switches), recomputed from position 0.
    assert starts["crossing"] == [(False, 0, 0), (True, 0, ORIGINAL + 1 - LENGTHS["crossing"])]


def test_the_factors_decide_the_tokens(model):
    """The comparison above can fail: transformers without the re-encode (its cache kept,
    the long factors only for the new tokens, what a missing switch would compute) gives
    other tokens for the crossing prompt."""
    model_dir, prompts, reference = model
    ids = prompts["crossing"]
    hf = hf_causal_lm(model_dir)
    hf.prepare_inputs_for_generation = super(type(hf), hf).prepare_inputs_for_generation
    kept, _ = hf_greedy(hf, {"crossing": ids}, NEW_TOKENS)
    assert kept["crossing"] != reference["crossing"]


def test_block_hashes_of_short_and_long_requests_differ():
    """The long flag joins the first block's extra keys: a long request never reuses a short
    request's blocks (nor the reverse), with or without a cache salt."""
    hasher = make_block_hasher(4)
    tokens = list(range(3, 15))

    def request(salt: str | None = None) -> Request:
        return Request("r", tokens, SamplingParams(), None, cache_salt=salt, block_hasher=hasher)

    short, long = request(), request()
    long.set_rope_long()
    assert len(short.block_hashes) == len(long.block_hashes) == 3
    assert not set(short.block_hashes) & set(long.block_hashes)
    assert request().block_hashes == short.block_hashes  # short requests still share
    salted = request("tenant")
    salted.set_rope_long()
    assert not set(salted.block_hashes) & set(long.block_hashes)
