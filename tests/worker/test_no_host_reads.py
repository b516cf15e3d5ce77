"""A step never reads the device from the host: proven on the CPU with guarded tensors.

Every tensor that would live on a GPU (the runner's persistent state and whatever the host copies
to the device) is wrapped so that a host read of it (item, tolist, numpy, bool, int, float,
index, cpu) raises. The tensors derived from them inherit the guard, so the whole step (input
preparation, forward, sampling, post-update, the queued copy of the results) runs guarded; only
AsyncOutput.get_output() reads, from the host copies the side stream would have made.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker import async_output, staging
from kernels.prepare_inputs import PreparedInputs
from protocol.sampling_params import SamplingParams
from protocol.step import CachedRequestData, NewRequestData, SchedulerOutput
from tests.kernels.library_env import library_env
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner

_HOST_READS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
    "cpu",
}


class HostRead(AssertionError):
    """A host read of a device tensor on the step path."""


class DeviceTensor(torch.Tensor):
    """A CPU tensor that behaves as if it lived on a GPU: the host may not read it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            raise HostRead(f"host read of a device tensor: Tensor.{name}")
        if name == "to" and any(
            isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
            for a in (*args[1:], *(kwargs or {}).values())
        ):
            raise HostRead("host read of a device tensor: Tensor.to('cpu')")
        return super().__torch_function__(func, types, args, kwargs or {})


def _guard(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceTensor)


def _guard_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _guard(t)


def test_the_guard_catches_host_reads():
    t = _guard(torch.arange(4))
    for read in (
        lambda: t[0].item(),
        t.tolist,
        t.numpy,
        lambda: bool(t[0]),
        lambda: int(t[1]),
        lambda: float(t[1]),
        lambda: [0, 1][t[1]],
        lambda: np.asarray(t),
        t.cpu,
        lambda: t.to("cpu"),
    ):
        with pytest.raises(HostRead):
            read()
    assert isinstance(t * 2 + torch.ones(4), DeviceTensor)  # derived tensors stay guarded


@pytest.fixture(params=["torch-ops", "c-kernels"])
def guarded(request, monkeypatch, tmp_path):
    """(guarded runner, plain runner) over the same tiny model, the model's layers in torch ops
    (every tensor of the forward inherits the guard) or in the C kernels (whose outputs are
    fresh tensors: the model's outputs are guarded again, as they would live on the device)."""
    path = make_tiny_model(tmp_path / "tiny")
    with library_env(ENGINE_CPU_KERNELS="0" if request.param == "torch-ops" else "1"):
        plain, _ = make_runner(path, max_model_len=256, max_num_seqs=8)
        runner, _ = make_runner(path, max_model_len=256, max_num_seqs=8)
        # The reference computes fresh logits each step; the guarded runner reuses its buffer.
        plain._logits_out = lambda rows: None
        yield _guarded(runner, monkeypatch, rewrap_model=request.param == "c-kernels"), plain


def _guarded(runner, monkeypatch, rewrap_model: bool):
    st, sp = runner.states, runner.sampling
    for owner, names in (
        (st, ("token_ids", "num_tokens", "num_computed", "block_table")),
        (sp, ("floats", "ints", "num_output")),
    ):
        for name in names:
            setattr(owner, name, _guard(getattr(owner, name)))
    for attn in runner.model.attention_layers():
        attn.kv_cache = _guard(attn.kv_cache)
    if rewrap_model:
        # The C kernels' outputs are fresh host tensors: guard them as the device's would be.
        gather = runner.inputs._gather
        monkeypatch.setattr(
            runner.inputs, "_gather", lambda *a: PreparedInputs(*(_guard(t) for t in gather(*a)))
        )
        greedy = runner.sampler.greedy
        monkeypatch.setattr(runner.sampler, "greedy", lambda logits: _guard(greedy(logits)))
        for name in ("forward", "compute_logits", "greedy_tokens"):
            real = getattr(runner.model, name)
            monkeypatch.setattr(
                runner.model, name, lambda *a, _real=real: _guard_or_none(_real(*a))
            )
    real_copy = staging.HostToDevice.copy
    monkeypatch.setattr(
        staging.HostToDevice, "copy", lambda self, *a: [_guard(t) for t in real_copy(self, *a)]
    )
    # The side stream's copy to pinned memory: plain host tensors, which get_output() reads.
    monkeypatch.setattr(
        async_output.DeviceToHost,
        "start",
        lambda self, ts: ([t.as_subclass(torch.Tensor).clone() for t in ts], None),
    )
    return runner


def _steps(
    prompts: dict[str, list[int]],
    params: dict[str, SamplingParams],
    chunk: int,
    num_decodes: int,
    bitmasks: dict[str, bytes] | None = None,
):
    """SchedulerOutputs for prompts in chunks of `chunk`, then num_decodes decode steps; blocks
    of 16 tokens, handed out as the requests grow. A request in bitmasks is constrained to
    the same grammar bitmask row whenever it samples."""
    blocks = {r: [] for r in prompts}
    computed = dict.fromkeys(prompts, 0)
    next_block = iter(range(10_000))
    new = set(prompts)
    total = {r: len(p) for r, p in prompts.items()}
    for _ in range(max(-(-len(p) // chunk) for p in prompts.values()) + num_decodes):
        sched, news, cached = {}, [], CachedRequestData()
        for r, prompt in prompts.items():
            n = min(chunk, total[r] - computed[r]) if computed[r] < len(prompt) else 1
            grown = [next(next_block) for _ in range(-(-(computed[r] + n) // 16) - len(blocks[r]))]
            blocks[r] += grown
            if r in new:
                news.append(NewRequestData(r, prompt, params[r], list(blocks[r]), 0))
                new.discard(r)
            else:
                cached.req_ids.append(r)
                cached.new_block_ids.append(grown)
                cached.num_computed_tokens.append(computed[r])
            sched[r] = n
            computed[r] += n
            if computed[r] >= len(prompt):
                total[r] = max(total[r], computed[r] + 1)
        constrained = [r for r in bitmasks or {} if computed[r] >= len(prompts[r])]
        yield SchedulerOutput(
            scheduled_new_reqs=news,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
            structured_output_request_ids=constrained,
            grammar_bitmask=b"".join(bitmasks[r] for r in constrained),
        )


def test_steps_make_no_host_read_and_match_the_plain_runner(guarded):
    runner, plain = guarded
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(3, 500, n).tolist() for i, n in enumerate((37, 5, 20, 64))}
    params = {
        "r0": SamplingParams(
            temperature=0.0,
            logprobs=3,
            prompt_logprobs=2,
            repetition_penalty=1.3,
            presence_penalty=0.5,
        ),
        "r1": SamplingParams(
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            seed=7,
            min_tokens=4,
            stop_token_ids=[9],
            logit_bias={11: 3.0},
        ),
        "r2": SamplingParams(temperature=1.0, min_p=0.05, seed=3, frequency_penalty=0.4),
        "r3": SamplingParams(temperature=0.0),
    }
    # r2 may only sample tokens 40..47 (bits 8..15 of word 1 of its bitmask row).
    row = np.zeros(-(-runner.arch.vocab_size // 32), dtype="<i4")
    row[1] = 0xFF00
    guarded_out, plain_out = [], []
    launched = None
    for sched in _steps(prompts, params, chunk=16, num_decodes=6, bitmasks={"r2": row.tobytes()}):
        # Async scheduling's order: step N+1 is launched before step N's output is read.
        step = runner.execute_model_async(sched)
        if launched is not None:
            guarded_out.append(launched.get_output())
        launched = step
        plain_out.append(plain.execute_model(sched))
    guarded_out.append(launched.get_output())
    assert runner._logits_buffer is not None
    assert [o.sampled_token_ids for o in guarded_out] == [o.sampled_token_ids for o in plain_out]
    assert [o.logprobs for o in guarded_out] == [o.logprobs for o in plain_out]
    assert [o.prompt_logprobs for o in guarded_out] == [o.prompt_logprobs for o in plain_out]
    assert any(o.prompt_logprobs for o in guarded_out)
    r2 = [
        t
        for o in guarded_out
        for r, ts in zip(o.req_ids, o.sampled_token_ids)
        if r == "r2"
        for t in ts
    ]
    assert len(r2) > 3 and all(40 <= t < 48 for t in r2)
    # Each request samples from the step that completes its prompt to the last step.
    expected = sum(len(guarded_out) - -(-len(p) // 16) + 1 for p in prompts.values())
    assert sum(bool(t) for o in guarded_out for t in o.sampled_token_ids) == expected


def test_a_host_read_in_the_step_is_caught(guarded, monkeypatch):
    runner, _ = guarded
    real = runner._sample

    def reads_back(batch, hidden, sched):
        sampled, logprobs = real(batch, hidden, sched)
        sampled.tolist()  # what the old runner did
        return sampled, logprobs

    monkeypatch.setattr(runner, "_sample", reads_back)
    sched = next(_steps({"a": [5, 6, 7]}, {"a": SamplingParams(temperature=0.0)}, 16, 0))
    with pytest.raises(HostRead, match="tolist"):
        runner.execute_model_async(sched)
