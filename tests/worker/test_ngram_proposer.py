"""NgramProposer through the Proposer contract: drafts for the requests of a step, read from the
runner's RequestStates, equal to a plain Python reference of vLLM's prompt lookup."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from config.speculative import parse_speculative_config
from gpu_worker.request_state import RequestStates
from gpu_worker.spec_decode.ngram import NgramProposer
from gpu_worker.spec_decode.proposer import ProposeInputs, make_proposer
from gpu_worker.staging import HostToDevice
from tests.kernels.test_ngram import reference

MAX_MODEL_LEN = 64


def _states(rows: list[list[int]]) -> tuple[RequestStates, list[int]]:
    device = torch.device("cpu")
    states = RequestStates(len(rows) + 2, MAX_MODEL_LEN, 16, device, HostToDevice(device))
    states.add("filler", [3] * 40, 40, [0, 1, 2], 40)  # a slot the step does not propose for
    slots = [states.add(f"r{i}", row, len(row), [], 0) for i, row in enumerate(rows)]
    states.apply_staged_writes()
    return states, slots


def _inputs(states: RequestStates, slots: list[int], max_drafts: list[int]) -> ProposeInputs:
    slots_np = np.array(slots, dtype=np.int64)
    return ProposeInputs(
        slots_np=slots_np,
        slots=torch.from_numpy(slots_np.copy()),
        num_tokens_np=states.num_tokens_np[slots_np].copy(),
        max_drafts_np=np.array(max_drafts, dtype=np.int64),
        states=states,
    )


def _proposer(spec: dict) -> NgramProposer:
    config = SimpleNamespace(
        speculative=parse_speculative_config(spec), max_model_len=MAX_MODEL_LEN
    )
    proposer = make_proposer(config, torch.device("cpu"))  # type: ignore[arg-type]
    assert isinstance(proposer, NgramProposer)
    return proposer


def _expected(rows, max_drafts, lo, hi, k):
    out = []
    for row, limit in zip(rows, max_drafts):
        limit = min(limit, k, MAX_MODEL_LEN - len(row))
        drafts = reference(row, lo, hi, limit)
        out.append(drafts + [-1] * (k - len(drafts)))
    return out


@pytest.mark.parametrize("num_reqs", [1, 7])
def test_drafts_equal_the_reference(num_reqs: int) -> None:
    rng = random.Random(num_reqs)
    rows = [[rng.randrange(5) for _ in range(rng.randint(1, 50))] for _ in range(num_reqs)]
    max_drafts = [rng.choice([0, 2, 4, 9]) for _ in rows]
    proposer = _proposer({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (proposer.min_n, proposer.max_n) == (3, 3)  # vLLM: the missing bound copies the other
    states, slots = _states(rows)
    drafts = proposer.propose(_inputs(states, slots, max_drafts))
    assert drafts.dtype == torch.int64 and drafts.shape == (num_reqs, 4)
    assert drafts.tolist() == _expected(rows, max_drafts, 3, 3, 4)


def test_drafts_stop_at_max_model_len() -> None:
    """A request two tokens short of max_model_len gets two drafts, whatever max_drafts says."""
    row = ([1, 2, 3, 4, 5, 6, 7] * 9)[: MAX_MODEL_LEN - 2]  # a match followed by many tokens
    proposer = _proposer({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1})
    states, slots = _states([row, [9, 8, 9]])
    drafts = proposer.propose(_inputs(states, slots, [5, 5]))
    assert drafts.tolist() == _expected([row, [9, 8, 9]], [5, 5], 1, 5, 5)
    assert (drafts[0] >= 0).sum() == 2 and drafts[1].tolist() == [8, 9, -1, -1, -1]


def test_no_requests_and_no_state() -> None:
    proposer = _proposer({"method": "ngram", "num_speculative_tokens": 3})
    proposer.load()
    proposer.initialize_kv_cache(10)
    proposer.add_request(0, 0)
    assert proposer.kv_block_bytes() == 0
    states, _ = _states([[1, 2]])
    assert proposer.propose(_inputs(states, [], [])).shape == (0, 3)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_each_kernel_through_the_proposer(impl: str) -> None:
    """The CUDA path's launcher (Triton, here under the interpreter on CPU tensors) and the
    torch ops, called as propose() calls them, give the reference's drafts."""
    from kernels.ngram import ngram_propose_torch
    from kernels.triton.ngram import ngram_propose_triton

    rng = random.Random(3)
    rows = [[rng.randrange(6) for _ in range(rng.randint(1, 60))] for _ in range(9)]
    max_drafts = [rng.choice([0, 1, 3, 6]) for _ in rows]
    proposer = _proposer({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    proposer._propose = ngram_propose_triton if impl == "triton" else ngram_propose_torch
    states, slots = _states(rows)
    drafts = proposer.propose(_inputs(states, slots, max_drafts))
    assert drafts.tolist() == _expected(rows, max_drafts, 2, 2, 3)


def test_llm_greedy_equal_with_and_without_ngram(tmp_path, monkeypatch) -> None:
    """A tiny random model through LLM(...): greedy tokens with n-gram drafts equal those without,
    and drafts were proposed and verified (fewer forward steps than tokens)."""
    import shutil

    from config.default_model import resolve_model_path
    from frontend.llm import LLM
    from gpu_worker.model_runner import ModelRunner
    from protocol.sampling_params import SamplingParams
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path(None) / name, path / name)
    rng = random.Random(0)
    span = [rng.randrange(3, 500) for _ in range(12)]
    prompts = [
        [1, *span, *span[:5]],
        [1, *(rng.randrange(3, 500) for _ in range(30))],
        [1, *span, 77, *span, 78, *span[:3]],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    steps: list[int] = []
    proposed: list[int] = []
    execute = ModelRunner.execute_model_async
    propose = NgramProposer.propose

    def count_steps(self, sched):
        steps.append(sched.total_num_scheduled_tokens)
        return execute(self, sched)

    def count_drafts(self, inputs):
        drafts = propose(self, inputs)
        proposed.append(int((drafts >= 0).sum()))
        return drafts

    monkeypatch.setattr(ModelRunner, "execute_model_async", count_steps)
    monkeypatch.setattr(NgramProposer, "propose", count_drafts)
    outputs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}):
        llm = LLM(
            str(path),
            device="cpu",
            max_model_len=128,
            kv_cache_memory="8MiB",
            block_size=8,
            engine_process=False,
            speculative_config=spec,
        )
        steps.clear()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[spec is None] = [r.outputs[0].token_ids for r in results]
        num_steps = len(steps)
    assert outputs[False] == outputs[True]
    assert all(len(o) == 40 for o in outputs[True])
    assert sum(proposed) > 0
    assert num_steps < 40, f"{num_steps} steps for 40 tokens: no draft was accepted"
