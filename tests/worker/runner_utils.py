"""Building a CPU model runner for tests, and checking what it computes against transformers."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from engine_core.resolve import resolved_config
from gpu_worker.model_runner import ModelRunner
from tests.worker.driver import StepDriver


def make_runner(
    model: str | Path | None, attention_backend=None, **engine_args
) -> tuple[ModelRunner, StepDriver]:
    """A loaded runner with its KV cache, and a driver over all its blocks; attention_backend
    replaces the one the device would pick."""
    engine_args.setdefault("device", "cpu")
    engine_args.setdefault("kv_cache_memory", "64MiB")
    config = resolved_config(model=None if model is None else str(model), **engine_args)
    runner = ModelRunner(config, torch.device(config.device_type))
    if attention_backend is not None:
        runner.backend = attention_backend
    runner.load_model()
    num_blocks = runner.determine_num_blocks()
    runner.initialize_kv_cache(num_blocks)
    return runner, StepDriver(runner, num_blocks, config.cache.block_size)


def assert_first_logprobs_close(
    got: StepDriver, ref: StepDriver, prompts: dict[str, list[int]], **tolerance: float
) -> None:
    """Each prompt's first-token logprobs from got within bf16's tolerance of ref's (one step of
    both drivers, greedy, top 3)."""
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=3)
    ref.run(prompts, params, 1)
    got.run(prompts, params, 1)
    tolerance = {"atol": 0.05, "rtol": 0.02, **tolerance}
    for req in prompts:
        expected, actual = ref.logprobs[req][0], got.logprobs[req][0]
        torch.testing.assert_close(
            torch.tensor(actual.logprobs), torch.tensor(expected.logprobs), **tolerance
        )


def count_logits_calls(runner: ModelRunner, monkeypatch) -> list[int]:
    """A one-element counter of the runner's model.compute_logits calls from now on."""
    assert runner.model is not None
    real = runner.model.compute_logits
    calls = [0]

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(runner.model, "compute_logits", counting)
    return calls


def random_prompts(vocab: int, lengths: Iterable[int], seed: int = 7) -> dict[str, list[int]]:
    """One prompt of random token ids (3 .. vocab - 1) per length, named len<n>."""
    gen = torch.Generator().manual_seed(seed)
    return {f"len{n}": torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths}


def hf_causal_lm(model_dir: str | Path, **kwargs):
    """transformers' model of the checkpoint in fp32, in eval mode, generating past EOS (as the
    engine does with ignore_eos); kwargs go to from_pretrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(
    model, prompts: dict[str, list[int]], new_tokens: int
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """transformers' greedy tokens after each prompt, and the prompt's logits [len, vocab] in
    fp32 (the last row is the first generated token's)."""
    tokens, logits = {}, {}
    with torch.inference_mode():
        for req_id, ids in prompts.items():
            seq = model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            tokens[req_id] = seq[0, len(ids) :].tolist()
            logits[req_id] = model(torch.tensor([ids])).logits[0].float()
    return tokens, logits


def assert_same_tokens(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> None:
    """Every request's tokens equal the reference's (the message lists those that differ)."""
    mismatched = {r: (o, reference[r]) for r, o in outputs.items() if o != reference[r]}
    assert not mismatched, f"{len(mismatched)} prompts differ from transformers: {mismatched}"


def capture_logits(runner: ModelRunner, monkeypatch) -> list[torch.Tensor]:
    """Record a copy of every logits tensor the runner's model computes from now on."""
    assert runner.model is not None
    captured: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def capture(hidden, out=None):
        logits = compute_logits(hidden, out)
        captured.append(logits.clone())
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", capture)
    # The logits are what is compared: greedy steps must not skip them (model.greedy_tokens).
    monkeypatch.setattr(runner, "fused_greedy", False)
    return captured


def assert_last_logits_close(
    runner: ModelRunner,
    driver: StepDriver,
    prompts: dict[str, list[int]],
    reference: dict[str, torch.Tensor],
    atol: float,
    monkeypatch,
) -> None:
    """One prefill step of all prompts: each prompt's last-position logits within atol of the
    reference's (max absolute difference)."""
    from protocol.sampling_params import SamplingParams

    captured = capture_logits(runner, monkeypatch)
    driver.run(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1), 1)
    assert len(captured) == 1 and captured[0].shape == (len(prompts), runner.arch.vocab_size)
    for row, req_id in enumerate(prompts):
        diff = (captured[0][row] - reference[req_id]).abs().max().item()
        assert diff < atol, f"{req_id}: last-position logits differ by {diff}"


def run_multiproc(
    model: str | Path,
    prompts: dict[str, list[int]],
    params,
    max_new: int,
    *,
    chunk: int | None = None,
    tensor_parallel_size: int = 2,
    rope_long: bool = False,
    **engine_args,
) -> tuple[dict[str, list[int]], int]:
    """The prompts' tokens through the multiprocess executor on the CPU (gloo, one thread a
    rank) at tensor_parallel_size ranks, and the KV cache's block count it found; engine_args
    as resolved_config's (e.g. enable_expert_parallel)."""
    from executor.multiproc import MultiprocExecutor

    engine_args.setdefault("device", "cpu")
    engine_args.setdefault("kv_cache_memory", "4MiB")
    config = resolved_config(
        model=str(model), tensor_parallel_size=tensor_parallel_size, **engine_args
    )
    executor = MultiprocExecutor(config, num_threads=1)
    try:
        num_blocks = executor.initialize()
        driver = StepDriver(executor, num_blocks, config.cache.block_size)
        return driver.run(prompts, params, max_new, chunk=chunk, rope_long=rope_long), num_blocks
    finally:
        executor.shutdown()
