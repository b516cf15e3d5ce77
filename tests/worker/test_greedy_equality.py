"""The default model through the model runner equals transformers' greedy generate, token for
token."""

from __future__ import annotations

import pytest
import torch

from protocol.sampling_params import SamplingParams
from tests.hf_reference import NEW_TOKENS, greedy, prompt_ids, prompt_logprobs
from tests.worker.runner_utils import make_runner


@pytest.fixture(scope="module")
def engine():
    runner, driver = make_runner(None, max_model_len=2048, kv_cache_memory="512MiB")
    return runner, driver


@pytest.fixture(scope="module")
def prompts():
    ids = prompt_ids()
    assert max(len(p) for p in ids.values()) > 300, "one prompt must be long"
    return ids


@pytest.fixture(scope="module")
def reference(prompts):
    return {r: greedy(tuple(ids)) for r, ids in prompts.items()}


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def _check(outputs, reference):
    mismatched = {r: (o, reference[r][0]) for r, o in outputs.items() if o != reference[r][0]}
    assert not mismatched, f"{len(mismatched)} prompts differ from transformers: {mismatched}"


def test_one_request_at_a_time(engine, prompts, reference):
    _, driver = engine
    outputs = {}
    for req_id, ids in prompts.items():
        outputs.update(driver.run({req_id: ids}, GREEDY, NEW_TOKENS))
    _check(outputs, reference)


def test_all_requests_in_one_batch(engine, prompts, reference):
    _check(engine[1].run(prompts, GREEDY, NEW_TOKENS), reference)


def test_prompts_split_into_chunks(engine, prompts, reference):
    _check(engine[1].run(prompts, GREEDY, NEW_TOKENS, chunk=13), reference)


def test_sampled_logprobs_and_top5_match_transformers(engine, prompts, reference):
    _, driver = engine
    subset = {r: prompts[r] for r in ("p0", "p3", "p7", "p14")}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS, logprobs=5)
    driver.run(subset, params, NEW_TOKENS)
    for req_id in subset:
        ref_tokens, ref_lp = reference[req_id]
        steps = driver.logprobs[req_id]
        assert len(steps) == NEW_TOKENS
        for pos, step in enumerate(steps):
            ids, lps, rank = step.token_ids[0], step.logprobs[0], step.ranks[0]
            assert ids[0] == ref_tokens[pos] and rank == 1
            assert abs(lps[0] - ref_lp[pos, ids[0]].item()) < 1e-3
            top_vals, top_ids = ref_lp[pos].topk(5)
            assert torch.allclose(torch.tensor(lps[1:]), top_vals, atol=1e-3)
            # Ids must agree except where two candidates are within the tolerance of each other.
            for got, want, val in zip(ids[1:], top_ids.tolist(), top_vals.tolist()):
                assert got == want or abs(ref_lp[pos, got].item() - val) < 1e-3


def test_prompt_logprobs_match_transformers(engine, prompts):
    _, driver = engine
    ids = prompts["p10"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    driver.run({"pl": ids}, params, 1, chunk=9)
    got = driver.prompt_logprobs["pl"]
    ref = prompt_logprobs(tuple(ids))
    assert len(got.token_ids) == len(ids) - 1
    for pos in range(len(ids) - 1):
        assert got.token_ids[pos][0] == ids[pos + 1]
        assert abs(got.logprobs[pos][0] - ref[pos, ids[pos + 1]].item()) < 1e-3
        assert torch.allclose(
            torch.tensor(got.logprobs[pos][1:]), ref[pos].topk(3).values, atol=1e-3
        )


def test_torch_path_without_the_c_kernels(prompts, reference):
    """Where no C compiler exists (or ENGINE_CPU_KERNELS=0) the runner uses torch ops for
    attention and the fused elementwise steps; that path must give the same tokens."""
    from tests.kernels.library_env import library_env

    with library_env(ENGINE_CPU_KERNELS="0"):
        runner, driver = make_runner(None, max_model_len=2048, kv_cache_memory="512MiB")
        assert runner.backend.name == "torch"
        _check(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=13), reference)
