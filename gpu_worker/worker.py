"""Worker: owns one device, its model runner and its share of the KV cache."""

from __future__ import annotations

import torch

from config.engine import EngineConfig
from gpu_worker.async_output import AsyncOutput, ReadyOutput
from gpu_worker.model_runner import ModelRunner
from gpu_worker.parallel.group import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    set_expert_parallel,
)
from protocol.step import ModelRunnerOutput, SchedulerOutput


class Worker:
    """One rank: its device, its tensor-parallel group, its model shard and its KV cache share."""

    def __init__(
        self, config: EngineConfig, rank: int = 0, distributed_init_method: str = ""
    ) -> None:
        self.config = config
        self.rank = rank
        if config.device_type == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        world_size = config.parallel.tensor_parallel_size
        if world_size > 1 and not distributed_init_method:
            raise ValueError("tensor_parallel_size > 1 needs a distributed_init_method")
        init_tensor_parallel(rank, world_size, distributed_init_method, self.device)
        # Before the model is built: its MoE layers read it to place their experts.
        set_expert_parallel(config.parallel.enable_expert_parallel)
        # Every rank seeds alike, so the ranks' samplers draw the same tokens from the same logits.
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        """Load weights onto the device."""
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        """KV blocks this rank can hold."""
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks (the same number on every rank), warm up, then capture
        the CUDA graphs."""
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.warm_up()
        self.runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output."""
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncOutput | ReadyOutput:
        """Launch one step; its get_output() waits for the results."""
        return self.runner.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        """Leave the tensor-parallel group."""
        destroy_tensor_parallel()
