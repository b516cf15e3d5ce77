"""ModelRunner: runs one scheduled step of the model over the paged KV cache and samples.

The shape of vLLM's second runner: request state lives on the device by slot (request_state.py,
sampling_state.py), a step's inputs are gathered there from a few host arrays copied once
(input_batch.py), and its results go back on a side stream (async_output.py). Nothing on the step
path reads the device from the host: execute_model_async() returns once the step is launched,
and only AsyncOutput.get_output() waits, for the copy of the results.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from config.attention import AttentionFeatures
from config.engine import EngineConfig
from config.kv_window import freed_window
from gpu_worker.async_output import AsyncOutput, DeviceToHost, ReadyOutput
from gpu_worker.attention.select import attention_backend
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.forward_context import StepAttention, forward_context
from gpu_worker.grammar_mask import apply_grammar_bitmask
from gpu_worker.input_batch import InputBatch, InputPreparer
from gpu_worker.kv_cache import allocate_kv_caches, kv_cache_num_blocks, kv_cache_torch_dtype
from gpu_worker.loader.model_loader import load_model, torch_dtype
from gpu_worker.prompt_logprobs import PromptLogprobs
from gpu_worker.request_state import RequestStates
from gpu_worker.sampler import LogprobsTensors, Sampler
from gpu_worker.sampling_state import SamplingStates
from gpu_worker.spec_decode.proposer import make_proposer
from gpu_worker.spec_decode.speculation import Speculation
from gpu_worker.spec_decode.verify import OneTokenRows, one_token_rows, write_graph_inputs
from gpu_worker.staging import HostToDevice
from gpu_worker.warmup import PROFILE_SAMPLING, DummyLimits, run_dummy, warm_up
from protocol.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache and the persistent request state of one device."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        assert config.arch is not None, "EngineConfig.resolve() not called"
        self.config = config
        self.arch = config.arch
        self.device = device
        self.dtype = torch_dtype(config.torch_dtype_name)
        self.block_size = config.cache.block_size
        features = AttentionFeatures.of(
            self.arch, config.max_model_len, config.cache.kv_cache_dtype
        )
        self.backend = attention_backend(
            device, self.dtype, self.arch.head_dim, self.block_size, features
        )
        self.sampler = Sampler()
        max_reqs = config.scheduler.max_num_seqs
        self.dummy_limits = DummyLimits.of(config)
        eos = self.arch.eos_token_ids[0] if self.arch.eos_token_ids else None
        self.h2d = HostToDevice(device)
        self.d2h = DeviceToHost(device)
        self.states = RequestStates(
            max_reqs, config.max_model_len, self.block_size, device, self.h2d
        )
        self.sampling = SamplingStates(max_reqs, self.arch.vocab_size, eos, device, self.h2d)
        self.prompt_logprobs = PromptLogprobs(self.arch.vocab_size)
        self.inputs = InputPreparer(self.states, self.h2d, device)
        self._logits_buffer: torch.Tensor | None = None
        # Greedy steps take the argmax inside the output projection where a kernel can
        # (model.greedy_tokens); off: through the logits, as any other step.
        self.fused_greedy = True
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0  # of the KV cache allocated now (its layout is the backend's)
        self.graphs: DecodeGraphs | None = None
        # --speculative-config: the proposer and the verification of its drafts (None: off).
        proposer = make_proposer(config, device)
        self.speculation = (
            Speculation(proposer, self.states, self.sampling, self.h2d, config.max_model_len)
            if proposer is not None
            else None
        )

    def load_model(self) -> None:
        """Build the model and load its weights onto the device."""
        self.model = load_model(
            self.config.model_path,
            self.arch,
            self.dtype,
            self.device,
            self.config.load.load_format,
            self.config.model.seed,
            self.config.model.quantization,
        )
        if self.speculation is not None:
            self.speculation.proposer.attach_target(self.model)
            self.speculation.proposer.load()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit in the memory the configuration allows (on a GPU: beside the
        measured peak of a profile run)."""
        extra = self.speculation.proposer.kv_block_bytes() if self.speculation else 0
        if not extra:
            return kv_cache_num_blocks(self.config, self.dtype, self.device, self.profile_run)
        return kv_cache_num_blocks(
            self.config, self.dtype, self.device, self.profile_run, extra_block_bytes=extra
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and bind each layer's slice to its attention module."""
        assert self.model is not None, "load_model() first"
        self.kv_caches = allocate_kv_caches(
            self.arch,
            num_blocks,
            self.block_size,
            kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.dtype),
            self.device,
            self.backend.kv_cache_shape,
            self.config.parallel.tensor_parallel_size,
        )
        self.num_blocks = num_blocks
        window = freed_window(self.config)
        layers = self.model.attention_layers()
        for i, (attn, cache) in enumerate(zip(layers, self.kv_caches, strict=True)):
            # The engine core frees blocks behind this window: no layer may read past it.
            if window is not None and attn.sliding_window != window:
                raise RuntimeError(
                    f"the engine core frees KV blocks behind the sliding window {window} every "
                    f"layer of the configuration has, but layer {i} of the "
                    f"{type(self.model).__name__} attends within {attn.sliding_window}"
                )
            attn.kv_cache = cache
        if self.speculation is not None:
            self.speculation.proposer.initialize_kv_cache(num_blocks)

    def _release_kv_cache(self) -> None:
        assert self.model is not None
        for attn in self.model.attention_layers():
            attn.kv_cache = torch.empty(0)
        self.kv_caches = []
        if self.speculation is not None:  # the proposer's cache went with the profile's
            self.speculation.proposer.initialize_kv_cache(0)

    def profile_run(self) -> int:
        """Peak device bytes, beyond what is allocated now, of the largest step: the token
        budget spread over max_num_seqs requests that all sample, with every sampler stage on,
        run on a temporary KV cache just large enough (CUDA)."""
        sched = self.config.scheduler
        tokens = sched.max_num_batched_tokens
        assert tokens is not None
        num_reqs = min(sched.max_num_seqs, tokens)
        # No request holds more than max_model_len tokens, so neither does a step's share.
        lens = [
            min(tokens // num_reqs + (i < tokens % num_reqs), self.config.max_model_len)
            for i in range(num_reqs)
        ]
        num_blocks = sum(-(-n // self.block_size) for n in lens)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.initialize_kv_cache(num_blocks)
        kv_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        run_dummy(self.execute_model, self.dummy_limits, lens, 0, num_blocks, PROFILE_SAMPLING)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - kv_bytes
        graph_reserve = self._graph_reserve(before + kv_bytes, num_blocks)
        self._release_kv_cache()
        torch.cuda.empty_cache()
        logger.info(
            "profile run: %d tokens over %d requests peak at %.2f GiB of activations; "
            "%.2f GiB kept for CUDA graphs",
            tokens,
            num_reqs,
            peak / 2**30,
            graph_reserve / 2**30,
        )
        return peak + graph_reserve

    def _graph_reserve(self, baseline: int, num_blocks: int) -> int:
        """What the CUDA graphs' pool will hold, beside the eager steps' peak: the activation
        peak of the largest captured decode batch (the graphs share one pool, largest first),
        measured by a dummy step of that many one-token requests on the profile's cache."""
        sizes = self.config.cuda_graph_capture_sizes()
        if not sizes:
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        run_dummy(self.execute_model, self.dummy_limits, [1] * sizes[-1], 0, num_blocks)
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - baseline)

    def warm_up(self) -> None:
        """Run every step shape the engine will meet once, so that no request waits for a
        kernel compile; only a backend whose kernels compile at first launch needs it."""
        if not self.backend.compiles_kernels:
            return
        warm_up(
            self.execute_model,
            self.dummy_limits,
            self.config.max_model_len,
            self.num_blocks,
            self.device,
            self.backend.warm_up_context_len,
        )

    def capture_model(self) -> None:
        """Capture the decode steps' CUDA graphs (config.cuda_graph_capture_sizes(): none on
        the CPU, under --enforce-eager, or with tensor parallelism, whose all-reduce is not
        captured); from then on decode steps of those sizes replay them."""
        sizes = self.config.cuda_graph_capture_sizes()
        if not sizes:
            return
        if not self.backend.supports_cuda_graphs:
            logger.info(
                "CUDA graphs are off: the %s attention backend is not captured", self.backend.name
            )
            return
        inputs = DecodeInputs(sizes, self.states.block_table.shape[1], self.device)
        assert self.model is not None
        graphs = DecodeGraphs(
            self.model,
            self.backend,
            inputs,
            self.model.attention_layers()[0].num_kv_heads,  # this rank's, as its KV cache holds
            self.config.max_model_len,
            self.device,
        )
        graphs.capture()
        self.graphs = graphs
        self.inputs.use_graph_inputs(inputs)
        if self.speculation is not None:
            self.speculation.proposer.capture_model()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output."""
        return self.execute_model_async(sched).get_output()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> AsyncOutput | ReadyOutput:
        """Launch one step: update request state, compute the scheduled tokens, sample, and
        start copying the results to the host; returns without waiting for the device."""
        assert self.model is not None, "load_model() first"
        self._update_states(sched)
        if not sched.num_scheduled_tokens:
            return ReadyOutput(ModelRunnerOutput())
        req_ids = list(sched.num_scheduled_tokens)
        num_scheduled = np.fromiter(
            sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids)
        )
        # --speculative-config (gpu_worker/spec_decode/speculation.py): the scheduled drafts are
        # written after their requests' tokens and verified in this forward, and the next
        # drafts proposed before the results' copy starts.
        spec = self.speculation
        drafts_per_slot = spec.stage(sched) if spec is not None else None
        batch = self.inputs.prepare(req_ids, num_scheduled, sched.total_num_scheduled_tokens)
        self._offset_long_rope(batch, num_scheduled)
        attention = None
        if drafts_per_slot is not None:
            attention = one_token_rows(batch, drafts_per_slot, self.h2d, self.backend.plans_on_host)
        hidden = self._forward(batch, attention)
        owners, chunks, complete = self.prompt_logprobs.compute(
            self.model.compute_logits, hidden, batch, self.states
        )
        verify_starts = drafts = None
        if spec is None or drafts_per_slot is None:
            sampled, logprobs = self._sample(batch, hidden, sched)
            last_rows = batch.logits_indices
        else:  # verified and applied to the request state
            sampled, logprobs, verify_starts, last_rows = spec.verify(
                self.model, batch, hidden, sched, drafts_per_slot
            )
        if spec is not None:
            if drafts_per_slot is None:
                self._post_update(batch, sampled)  # the proposer reads the updated state
            drafts = spec.propose(
                batch, hidden, last_rows, getattr(self.model, "aux_hidden_states", None)
            )
        output = AsyncOutput(
            self.d2h,
            req_ids,
            batch.sample_rows_np,
            sampled,
            logprobs,
            self.sampling.logprobs_np[batch.sample_slots_np],
            chunks,
            verify_starts,
            drafts,
        )
        self.prompt_logprobs.attach(output, owners, complete)
        if spec is None:
            # After the copy is queued: the copy need not wait for the bookkeeping.
            self._post_update(batch, sampled)
        return output

    def _post_update(self, batch: InputBatch, sampled: torch.Tensor | None) -> None:
        """The step's requests computed their tokens; those that sampled gained one token."""
        self.states.post_update(
            batch.slots,
            batch.slots_np,
            batch.device_batch.seq_lens,
            batch.seq_lens_np,
            batch.sample_slots,
            batch.sample_slots_np,
            sampled,
            self.sampling.num_output,
        )
        self.sampling.post_update(batch.sample_slots, batch.sample_slots_np, sampled)

    def _offset_long_rope(self, batch: InputBatch, num_scheduled: np.ndarray) -> None:
        """LongRoPE: the positions of long requests' tokens move to the rotary table's long
        half (RotaryEmbedding.long_offset), in place, before the forward (a CUDA graph's
        persistent positions included). Nothing reads positions but the rotary lookup: the
        attention metadata and slot mapping are built already."""
        offset = int(getattr(getattr(self.model, "rotary", None), "long_offset", 0))
        if not offset:
            return
        long_rows = self.states.rope_long_np[batch.slots_np]
        if not long_rows.any():
            return
        per_token = np.repeat(long_rows.astype(np.int64) * offset, num_scheduled)
        (shift,) = self.h2d.copy(per_token)
        batch.positions.add_(shift)

    def _update_states(self, sched: SchedulerOutput) -> None:
        states, sampling = self.states, self.sampling
        for req_id in sched.finished_req_ids:
            self._remove(req_id)
        penalized = []
        for new in sched.scheduled_new_reqs:
            if new.req_id in states.slot_of:  # resumed after preemption: start over
                self._remove(new.req_id)
            params = new.sampling_params
            slot = states.add(
                new.req_id,
                new.prompt_token_ids + new.output_token_ids,
                len(new.prompt_token_ids),
                new.block_ids,
                new.num_computed_tokens,
                new.rope_long,
            )
            sampling.add(slot, params, len(new.output_token_ids))
            if self.speculation is not None:
                self.speculation.proposer.add_request(slot, new.num_computed_tokens)
            if sampling.penalized_np[slot]:
                penalized.append(slot)
            # A request resumed after preemption sent its prompt logprobs already.
            if params.prompt_logprobs is not None and not new.output_token_ids:
                self.prompt_logprobs.add_request(new.req_id, params.prompt_logprobs)
        cached = sched.scheduled_cached_reqs
        if len(cached.req_ids) != len(cached.new_block_ids):
            raise ValueError("scheduled_cached_reqs: req_ids and new_block_ids differ in length")
        if any(cached.new_block_ids):  # most steps give no request a block
            states.append_blocks_of(cached.req_ids, cached.new_block_ids)
        states.apply_staged_writes()
        sampling.apply_staged_writes()
        for slot in penalized:
            n, p = int(states.num_tokens_np[slot]), int(states.prompt_len_np[slot])
            sampling.set_penalty_tokens(
                slot, states.token_ids[slot, :p], states.token_ids[slot, p:n]
            )

    def _remove(self, req_id: str) -> None:
        self.states.remove(req_id)
        self.prompt_logprobs.remove_request(req_id)

    def _forward(self, batch: InputBatch, attention: OneTokenRows | None = None) -> torch.Tensor:
        """The step's hidden states; attention: the batch as attention sees it, where it is
        not the requests' own (a speculative step's one-token rows, which a decode graph of
        that many rows replays when every row is one token)."""
        assert self.model is not None
        graphs = self.graphs
        if batch.in_graph_buffers and graphs is not None and attention is None:
            hidden = graphs.replay(len(batch.req_ids), batch.device_batch.max_seq_len)
            if hidden is not None:
                return hidden
        if (
            attention is not None
            and graphs is not None
            and attention.device.max_query_len == 1
            and graphs.inputs.padded_size(attention.num_rows)
        ):
            write_graph_inputs(graphs.inputs, batch, attention, self.states.block_table)
            hidden = graphs.replay(attention.num_rows, attention.device.max_seq_len)
            if hidden is not None:
                return hidden
        if attention is None:
            host_batch = batch.host_batch() if self.backend.plans_on_host else None
            device_batch = batch.device_batch
        else:
            host_batch, device_batch = attention.host, attention.device
        metadata = self.backend.build(host_batch, device_batch, self.device)
        with forward_context(StepAttention(self.backend, metadata)):
            return self.model(batch.input_ids, batch.positions)

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        """A reused buffer for a step's logits on the CPU: [rows, vocab] fp32 is tens of MB at
        large batches, and a fresh one costs a page fault per 4 KiB and an unmap each step
        (256 rows x 49152: ~28 ms of 42 in null-model's step). CUDA's allocator caches."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
            self._logits_buffer = torch.empty(
                self.config.scheduler.max_num_seqs, self.arch.vocab_size
            )
        return self._logits_buffer[:rows]

    def _sample(
        self, batch: InputBatch, hidden: torch.Tensor, sched: SchedulerOutput
    ) -> tuple[torch.Tensor | None, LogprobsTensors | None]:
        if not len(batch.sample_rows_np):
            return None, None
        assert self.model is not None
        rows = hidden.index_select(0, batch.logits_indices)
        metadata = self.sampling.metadata(batch.sample_slots_np, batch.sample_slots, self.states)
        if (
            self.fused_greedy
            and metadata.argmax_only
            and metadata.max_num_logprobs is None
            and not sched.structured_output_request_ids
        ):
            # Every row takes its argmax: where a kernel fuses it with the output projection,
            # the logits (tens of MB at large batches) are never written.
            sampled = self.model.greedy_tokens(rows)
            if sampled is not None:
                return sampled, None
        logits = self.model.compute_logits(rows, self._logits_out(len(batch.sample_rows_np)))
        if sched.structured_output_request_ids:
            apply_grammar_bitmask(logits, sched, batch, self.h2d)
        result = self.sampler(logits, metadata)
        return result.sampled_token_ids, result.logprobs
