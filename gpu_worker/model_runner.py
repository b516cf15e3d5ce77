"""ModelRunner: runs one scheduled step of the model over the paged KV cache and samples."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.config import EngineConfig
from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.attention.select import attention_backend
from gpu_worker.forward_context import forward_context
from gpu_worker.input_batch import InputBatch, PreparedStep, RequestState
from gpu_worker.kv_cache import allocate_kv_caches, kv_cache_num_blocks
from gpu_worker.layers.attention import StepAttention
from gpu_worker.loader.model_loader import load_model, torch_dtype
from gpu_worker.protocol import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from gpu_worker.sampler import LogprobsTensors, Sampler, compute_logprobs_tensors
from gpu_worker.sampling_metadata import build_sampling_metadata


class ModelRunner:
    """Owns the model, the KV cache and the persistent request state of one device."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        assert config.arch is not None, "EngineConfig.resolve() not called"
        self.config = config
        self.arch = config.arch
        self.device = device
        self.dtype = torch_dtype(config.torch_dtype_name)
        self.block_size = config.cache.block_size
        self.backend = attention_backend(device, self.dtype, self.arch.head_dim,
                                         self.block_size)
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, config.max_model_len,
                                      self.block_size)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.eos_token_id = self.arch.eos_token_ids[0] if self.arch.eos_token_ids else None

    def load_model(self) -> None:
        """Build the model and load its weights onto the device."""
        self.model = load_model(self.config.model_path, self.arch, self.dtype, self.device,
                                self.config.load.load_format, self.config.model.seed)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit in the memory the configuration allows."""
        return kv_cache_num_blocks(self.config, self.dtype, self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and bind each layer's slice to its attention module."""
        assert self.model is not None, "load_model() first"
        self.kv_caches = allocate_kv_caches(self.arch, num_blocks, self.block_size, self.dtype,
                                            self.device, self.backend.kv_cache_shape,
                                            self.config.parallel.tensor_parallel_size)
        for attn, cache in zip(self.model.attention_layers(), self.kv_caches, strict=True):
            attn.kv_cache = cache

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update request state, compute the scheduled tokens, sample."""
        self._update_states(sched)
        if not sched.num_scheduled_tokens:
            return ModelRunnerOutput()
        req_ids = list(sched.num_scheduled_tokens)
        rows = np.fromiter((self.requests[r].row for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_scheduled = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64,
                                    count=len(req_ids))
        step = self.input_batch.prepare(req_ids, rows, num_scheduled)
        hidden = self._forward(step)
        output = self._sample(step, hidden)
        self._prompt_logprobs(step, hidden, output)
        self.input_batch.num_computed[rows] = step.batch.seq_lens
        return output

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.input_batch.remove(state.row)
        for new in sched.scheduled_new_reqs:
            if new.req_id in self.requests:  # resumed after preemption: start over
                self.input_batch.remove(self.requests.pop(new.req_id).row)
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            row = self.input_batch.add(new.prompt_token_ids + new.output_token_ids, new.block_ids,
                                       new.num_computed_tokens)
            self.requests[new.req_id] = RequestState(
                new.req_id, row, new.prompt_token_ids, params, list(new.output_token_ids), generator,
                prompt_logprobs=None if new.output_token_ids else [])
        cached = sched.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                               cached.num_computed_tokens, strict=True):
            row = self.requests[req_id].row
            if block_ids:
                self.input_batch.append_blocks(row, block_ids)
            self.input_batch.num_computed[row] = computed

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        assert self.model is not None, "load_model() first"
        device_batch = DeviceBatch.from_step(step.batch, self.device)
        metadata = self.backend.build(step.batch, device_batch, self.device)
        input_ids = torch.from_numpy(step.input_ids).to(self.device, non_blocking=True)
        positions = torch.from_numpy(step.positions).to(self.device, non_blocking=True)
        with forward_context(StepAttention(self.backend, metadata)):
            return self.model(input_ids, positions)

    def _sample(self, step: PreparedStep, hidden: torch.Tensor) -> ModelRunnerOutput:
        sampling = np.flatnonzero(step.samples)
        sampled_lists: list[list[int]] = [[] for _ in step.req_ids]
        logprob_lists: list[LogprobsLists | None] = [None] * len(step.req_ids)
        if len(sampling):
            states = [self.requests[step.req_ids[i]] for i in sampling]
            last_token = torch.from_numpy(step.batch.query_start_loc[1:][sampling] - 1).to(self.device)
            logits = self.model.compute_logits(hidden[last_token])
            meta = build_sampling_metadata(states, self.device, self.arch.vocab_size,
                                           self.eos_token_id)
            result = self.sampler(logits, meta)
            tokens = result.sampled_token_ids.tolist()
            lp = _to_host(result.logprobs) if result.logprobs is not None else None
            for j, (i, state, token) in enumerate(zip(sampling, states, tokens)):
                sampled_lists[i] = [token]
                state.output_token_ids.append(token)
                row = state.row
                self.input_batch.token_ids[row, self.input_batch.num_tokens[row]] = token
                self.input_batch.num_tokens[row] += 1
                k = state.sampling_params.logprobs
                if lp is not None and k is not None:
                    logprob_lists[i] = _one_position(lp, j, k)
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled_lists,
                                 logprobs=logprob_lists)

    def _prompt_logprobs(self, step: PreparedStep, hidden: torch.Tensor,
                         output: ModelRunnerOutput) -> None:
        """Logprobs of each prompt token given its prefix, gathered chunk by chunk."""
        for i, req_id in enumerate(step.req_ids):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            if k is None or state.prompt_logprobs is None:
                continue
            num_prompt = len(state.prompt_token_ids)
            start = int(step.batch.seq_lens[i] - step.batch.query_lens[i])
            end = min(int(step.batch.seq_lens[i]), num_prompt - 1)  # positions predicting a prompt token
            if end > start:
                q0 = int(step.batch.query_start_loc[i])
                logits = self.model.compute_logits(hidden[q0 : q0 + end - start])
                targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
                lp = _to_host(compute_logprobs_tensors(torch.log_softmax(logits, dim=-1), targets,
                                                       self._num_top(k)))
                state.prompt_logprobs.extend(
                    _one_position_tuple(lp, j, k) for j in range(end - start))
            if step.batch.seq_lens[i] >= num_prompt:
                ids, lps, ranks = (list(x) for x in zip(*state.prompt_logprobs)) \
                    if state.prompt_logprobs else ([], [], [])
                output.prompt_logprobs[req_id] = LogprobsLists(ids, lps, ranks)
                state.prompt_logprobs = None

    def _num_top(self, k: int) -> int:
        return self.arch.vocab_size if k == -1 else k


def _to_host(t: LogprobsTensors) -> tuple[list[list[int]], list[list[float]], list[int]]:
    return t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()


def _one_position_tuple(lp: tuple[list[list[int]], list[list[float]], list[int]], j: int,
                        k: int) -> tuple[list[int], list[float], int]:
    width = len(lp[0][j]) if k == -1 else k + 1
    return lp[0][j][:width], lp[1][j][:width], lp[2][j]


def _one_position(lp: tuple[list[list[int]], list[list[float]], list[int]], j: int,
                  k: int) -> LogprobsLists:
    ids, lps, rank = _one_position_tuple(lp, j, k)
    return LogprobsLists([ids], [lps], [rank])
