"""All-greedy steps take the argmax inside the output projection (model.greedy_tokens) where the
C kernels run: the same tokens as through the logits, and no logits computed."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import cpu_binding
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import count_logits_calls, make_runner

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")


def test_fused_greedy_equals_greedy_through_the_logits(tmp_path, monkeypatch) -> None:
    path = make_tiny_model(tmp_path / "tiny")
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(3, 500, n).tolist() for i, n in enumerate((5, 17, 40, 9))}
    outputs = {}
    calls = {}
    for fused in (True, False):
        runner, driver = make_runner(path, max_model_len=128, max_num_seqs=8)
        runner.fused_greedy = fused
        counter = count_logits_calls(runner, monkeypatch)
        outputs[fused] = driver.run(
            prompts, SamplingParams(temperature=0.0, ignore_eos=True), 12, chunk=16
        )
        calls[fused] = counter[0]
    assert outputs[True] == outputs[False]
    assert all(len(t) == 12 for t in outputs[True].values())
    assert calls[True] == 0 and calls[False] > 0  # the fused steps never built logits


def test_steps_that_need_logits_still_compute_them(tmp_path) -> None:
    path = make_tiny_model(tmp_path / "tiny")
    runner, driver = make_runner(path, max_model_len=128, max_num_seqs=8)
    out = driver.run({"a": [5, 6, 7, 8]}, SamplingParams(temperature=0.0, logprobs=2), 3)
    assert len(out["a"]) == 3 and all(driver.logprobs["a"])
