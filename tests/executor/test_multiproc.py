"""MultiprocExecutor: tensor parallelism over gloo equals one device; dead workers are reported and
workers never outlive the executor's process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from config.engine import EngineConfig
from engine_core.resolve import resolved_config
from executor.base import Executor
from executor.factory import create_executor
from executor.multiproc import MultiprocExecutor, WorkerError
from executor.uniproc import UniProcExecutor
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.driver import StepDriver
from tests.worker.runner_utils import make_runner

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
SEEDED = SamplingParams(temperature=1.0, seed=1234, ignore_eos=True, max_tokens=NEW_TOKENS)

# name -> (family, overrides of the tiny config: 4 query heads, 2 KV heads)
CASES = {
    "llama": ("llama", {"attention_bias": True}),  # o_proj's bias must be added once, not per rank
    "qwen2": ("qwen2", {}),  # q/k/v biases split with their heads
    # q/k norms; a tied embedding whose vocabulary TP=2 does not divide
    "qwen3": ("qwen3", {"tie_word_embeddings": True, "vocab_size": 511}),
}


def _tiny(path: Path, family: str, **overrides) -> Path:
    """A tiny checkpoint with random biases and norm weights (transformers makes them 0 and 1)."""
    make_tiny_model(path, family, **overrides)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(".bias") or name.endswith("norm.weight"):
            tensors[name] = t + 0.5 * torch.randn(t.shape, generator=gen)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _prompts(vocab: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(7)
    return {
        f"len{n}": torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 7, 16, 45)
    }


def _config(model_dir: Path, tp: int, backend: str = "mp") -> EngineConfig:
    return resolved_config(
        model=str(model_dir),
        device="cpu",
        kv_cache_memory="4MiB",
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
    )


@contextmanager
def _started(executor: Executor) -> Iterator[tuple[Executor, StepDriver]]:
    try:
        num_blocks = executor.initialize()
        yield executor, StepDriver(executor, num_blocks, executor.config.cache.block_size)
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_equals_one_device(tmp_path, name):
    family, overrides = CASES[name]
    model_dir = _tiny(tmp_path, family, **overrides)
    runner, driver = make_runner(model_dir, kv_cache_memory="4MiB")
    prompts = _prompts(runner.arch.vocab_size)
    greedy = driver.run(prompts, GREEDY, NEW_TOKENS, chunk=16)
    seeded = driver.run(prompts, SEEDED, NEW_TOKENS)
    with _started(MultiprocExecutor(_config(model_dir, 2), num_threads=1)) as (executor, tp_driver):
        # Each rank caches only its KV heads: the same memory holds twice the blocks.
        assert len(tp_driver.free) == 2 * runner.determine_num_blocks()
        assert tp_driver.run(prompts, GREEDY, NEW_TOKENS, chunk=16) == greedy
        # Sampling: every rank draws the same tokens, or the ranks' inputs diverge next step.
        assert tp_driver.run(prompts, SEEDED, NEW_TOKENS) == seeded


def test_multiproc_executor_with_one_rank_equals_in_process(llama_dir):
    prompts = _prompts(512)
    with _started(create_executor(_config(llama_dir, 1, "uni"))) as (executor, driver):
        assert isinstance(executor, UniProcExecutor)
        expected = driver.run(prompts, GREEDY, NEW_TOKENS, chunk=5)
        num_blocks = len(driver.free)
    with _started(create_executor(_config(llama_dir, 1, "mp"))) as (executor, driver):
        assert isinstance(executor, MultiprocExecutor)
        assert len(driver.free) == num_blocks
        assert driver.run(prompts, GREEDY, NEW_TOKENS, chunk=5) == expected


def test_killed_worker_is_named(llama_dir):
    with _started(MultiprocExecutor(_config(llama_dir, 2), num_threads=1)) as (executor, driver):
        driver.run({"a": [3, 4, 5]}, GREEDY, 2)
        os.kill(executor.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            driver.run({"b": [6, 7, 8]}, GREEDY, 2)
        assert time.monotonic() - start < 5


def test_worker_error_at_start_up_is_reported(tmp_path, llama_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((llama_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    executor = MultiprocExecutor(_config(broken, 1), num_threads=1)
    with pytest.raises(WorkerError, match=r"rank 0 failed:(.|\n)*cannot read safetensors file"):
        executor.initialize()
    assert not any(proc.is_alive() for proc in executor.procs)


def _hold_executor(model_dir: str, conn: Connection) -> None:
    executor = MultiprocExecutor(_config(Path(model_dir), 2), num_threads=1)
    executor.initialize()
    conn.send_bytes(
        msgspec.msgpack.encode(([proc.pid for proc in executor.procs], executor._ring.handle.name))
    )
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_workers_die_with_the_executor_process(llama_dir):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    holder = ctx.Process(target=_hold_executor, args=(str(llama_dir), child))
    holder.start()
    try:
        assert parent.poll(60), "the executor did not start"
        pids, ring_name = msgspec.msgpack.decode(parent.recv_bytes())
        for rank, pid in enumerate(pids):
            assert Path(f"/proc/{pid}/comm").read_text().strip() == f"engine-worker-{rank}"
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "workers outlived the executor's process"
        SharedMemory(ring_name).unlink()  # nobody is left to do it
    finally:
        if holder.is_alive():
            holder.kill()
