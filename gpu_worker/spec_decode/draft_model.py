"""DraftModelProposer: a smaller model sharing the target's vocabulary guesses the next tokens.

After each step the draft first catches up: one forward over every proposing request's tokens
its cache lacks (the accepted drafts and the new token of the last step, a whole prompt the
first time), whose last position's argmax is draft 1. Then k - 1 single-token forwards, each
feeding the draft before it, only for the requests that may still take drafts. Drafts are
greedy: the rejection sampler treats them as certain guesses, so the target's distribution is
kept whatever the draft samples, and the argmax is the draft's best guess.

The draft's KV lives in its own cache, addressed by the target's block tables: a request's draft
KV sits in the block ids its target KV does (the scheduler allocates num_speculative_tokens
positions beyond each step's tokens, where the draft's lookahead KV goes). Each draft is written
into the runner's token table after the request's known tokens (scratch that the runner
overwrites with the scheduled drafts next step), where the next forward gathers it from and
where propose() reads the drafts back. The lookahead KV of the drafts the target accepts is kept
(they are the tokens the draft fed itself there), the rest rewritten by the next catch-up, so a
catch-up computes the step's last accepted draft and new token only. The host knows every
count, so nothing is read back from the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from config.attention import AttentionFeatures
from config.draft_model import draft_arch, draft_load
from gpu_worker.attention.select import attention_backend
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.forward_context import StepAttention, forward_context
from gpu_worker.kv_cache import allocate_kv_caches, kv_block_bytes, kv_cache_torch_dtype
from gpu_worker.loader.model_loader import load_model, torch_dtype
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.spec_decode.draft_inputs import DraftInputs
from kernels import cpu_library

if TYPE_CHECKING:
    from config.engine import EngineConfig
    from gpu_worker.request_state import RequestStates
    from gpu_worker.spec_decode.proposer import ProposeInputs


class DraftModelProposer:
    """Proposes the greedy continuation of a draft model (SpeculativeConfig.model_path)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        spec = config.speculative
        assert spec is not None and spec.method == "draft_model"
        self.config = config
        self.device = device
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.arch = draft_arch(config)
        self.dtype = torch_dtype(config.torch_dtype_name)
        self.block_size = config.cache.block_size
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype)
        features = AttentionFeatures.of(
            self.arch, config.max_model_len, config.cache.kv_cache_dtype
        )
        self.backend = attention_backend(
            device, self.dtype, self.arch.head_dim, self.block_size, features
        )
        # The most tokens one catch-up forward computes (a long prompt's first catch-up is
        # split): the target's step budget, for which the activations were sized.
        sched = config.scheduler
        assert sched.max_num_batched_tokens is not None
        self.max_forward_tokens = sched.max_num_batched_tokens
        self.inputs = DraftInputs(sched.max_num_seqs, device)
        # [max_num_seqs] by slot: the leading positions whose draft KV the cache holds, and how
        # many drafts after them the draft fed itself at its last proposal (their KV computed).
        self.computed_np = np.zeros(sched.max_num_seqs, dtype=np.int64)
        self.fed_np = np.zeros(sched.max_num_seqs, dtype=np.int64)
        self.model: DecoderForCausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None

    def attach_target(self, target: torch.nn.Module) -> None:
        """Nothing: the draft model shares no weights with the target."""

    def load(self) -> None:
        """Load the draft in the target's dtype, seed and tensor-parallel sharding (random
        weights when the target's are; config/draft_model.py's draft_load)."""
        load_format, quantization = draft_load(self.config, cpu_library.available)
        spec = self.config.speculative
        assert spec is not None
        model = load_model(
            spec.model_path,
            self.arch,
            self.dtype,
            self.device,
            load_format,
            self.config.model.seed,
            quantization,
        )
        assert isinstance(model, DecoderForCausalLM)
        self.model = model

    def kv_block_bytes(self) -> int:
        """The draft's KV bytes per block of the target's block size, on this rank."""
        tp = self.config.parallel.tensor_parallel_size
        return kv_block_bytes(self.arch, self.block_size, self.kv_dtype, tp)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the draft's cache (num_blocks of the target's block ids) and bind each
        layer's slice to its attention module."""
        assert self.model is not None, "load() first"
        self.kv_caches = allocate_kv_caches(
            self.arch,
            num_blocks,
            self.block_size,
            self.kv_dtype,
            self.device,
            self.backend.kv_cache_shape,
            self.config.parallel.tensor_parallel_size,
        )
        layers = self.model.attention_layers()
        for attn, cache in zip(layers, self.kv_caches, strict=True):
            attn.kv_cache = cache

    def capture_model(self) -> None:
        """Capture the draft's forwards of one token per request (its draft steps, and a
        catch-up after every draft was rejected) as CUDA graphs of the target's capture sizes;
        none where the target captures none (CPU, --enforce-eager, tensor parallelism) or the
        draft's attention backend is not captured."""
        sizes = self.config.cuda_graph_capture_sizes()
        if not sizes or not self.backend.supports_cuda_graphs:
            return
        assert self.model is not None, "load() first"
        max_blocks = -(-self.config.max_model_len // self.block_size)
        inputs = DecodeInputs(sizes, max_blocks, self.device)
        graphs = DecodeGraphs(
            self.model,
            self.backend,
            inputs,
            self.model.attention_layers()[0].num_kv_heads,
            self.config.max_model_len,
            self.device,
        )
        graphs.capture()
        self.graphs = graphs
        self.inputs.use_graph_inputs(inputs)

    def add_request(self, slot: int, num_computed: int) -> None:
        """The request's first num_computed positions hold KV (prefix-cache hits), the draft's
        too where the draft computed those blocks for the request that filled them."""
        self.computed_np[slot] = num_computed
        self.fed_np[slot] = 0

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        """Drafts [S, k] int64: row i's greedy continuation (max_drafts_np[i] tokens, then -1)."""
        k = self.num_speculative_tokens
        # A step that gained n tokens accepted n - 1 drafts, the very tokens the draft fed
        # itself at those positions: their KV is the draft's already, up to the drafts it fed.
        sampled = inputs.slots_np
        accepted = inputs.num_tokens_np - self.computed_np[sampled] - 1
        self.computed_np[sampled] += np.clip(accepted, 0, self.fed_np[sampled])
        self.fed_np[sampled] = 0
        rows = np.flatnonzero(inputs.max_drafts_np > 0)
        states = inputs.states
        slots = inputs.slots_np[rows]
        num_tokens = inputs.num_tokens_np[rows]
        max_drafts = np.minimum(inputs.max_drafts_np[rows], k)
        # A count the scheduler would never leave (nothing to compute) recomputes the last
        # token: its hidden state gives draft 1.
        start = np.minimum(self.computed_np[slots], num_tokens - 1)
        chunk_slots, chunk_ends = self._prompt_chunks(inputs)
        if len(rows) or len(chunk_slots):
            self._catch_up(
                states,
                np.concatenate([slots, chunk_slots]),
                np.concatenate([start, self.computed_np[chunk_slots]]),
                np.concatenate([num_tokens, chunk_ends]),
                len(rows),
            )
            self.computed_np[slots] = num_tokens
            self.fed_np[slots] = max_drafts - 1
            self.computed_np[chunk_slots] = chunk_ends
        for j in range(1, k):
            live = np.flatnonzero(max_drafts > j)
            if not len(live):
                break
            # Draft j sits at num_tokens + j - 1; its forward writes draft j + 1 after it.
            ones = np.ones(len(live), dtype=np.int64)
            self._forward(states, slots[live], num_tokens[live] + j - 1, ones, len(live))
        return self._read_drafts(inputs, rows, num_tokens, max_drafts)

    def _prompt_chunks(self, inputs: ProposeInputs) -> tuple[np.ndarray, np.ndarray]:
        """The step's requests that computed a prompt chunk without sampling, and how far the
        target computed each: the draft computes them along, so that the blocks the target
        fills (and the prefix cache may hand to another request) hold the draft's KV too."""
        batch = inputs.batch
        if batch is None or len(batch.sample_rows_np) == len(batch.slots_np):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        chunk = np.ones(len(batch.slots_np), dtype=bool)
        chunk[batch.sample_rows_np] = False
        slots = batch.slots_np[chunk]
        ends = batch.seq_lens_np[chunk].astype(np.int64)
        behind = ends > self.computed_np[slots]
        return slots[behind], ends[behind]

    def _catch_up(
        self,
        states: RequestStates,
        slots: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        num_samples: int,
    ) -> None:
        """Compute each slot's positions start .. end - 1, in forwards of at most
        max_forward_tokens tokens where the rows allow; the first num_samples rows write
        draft 1 at end (the last forward computes their last tokens, so it holds them)."""
        todo = end - start
        keep = (np.arange(len(slots)) < num_samples).astype(np.int64)
        while todo.sum() > self.max_forward_tokens and (todo > keep).any():
            # The earliest rows' tokens first, sampling rows keeping their last token.
            spare = todo - keep
            before = np.cumsum(spare) - spare
            take = np.clip(self.max_forward_tokens - before, 0, spare)
            part = np.flatnonzero(take)
            self._forward(states, slots[part], start[part], take[part], 0)
            start, todo = start + take, todo - take
        last = np.flatnonzero(todo)  # the sampling rows (first, never done) and what is left
        self._forward(states, slots[last], start[last], todo[last], num_samples)

    def _forward(
        self,
        states: RequestStates,
        slots: np.ndarray,
        start: np.ndarray,
        query_lens: np.ndarray,
        num_samples: int,
    ) -> None:
        """One forward of the draft; each of the first num_samples rows' argmax at its last
        position is written into the token table at the position after it (its next draft)."""
        assert self.model is not None
        sample_rows = np.arange(num_samples, dtype=np.int64)
        batch = self.inputs.prepare(states, slots, start, query_lens, sample_rows)
        hidden = None
        if batch.in_graph_buffers and self.graphs is not None:
            hidden = self.graphs.replay(len(slots), batch.device_batch.max_seq_len)
        if hidden is None:
            host_batch = batch.host_batch() if self.backend.plans_on_host else None
            metadata = self.backend.build(host_batch, batch.device_batch, self.device)
            with forward_context(StepAttention(self.backend, metadata)):
                hidden = self.model(batch.input_ids, batch.positions)
        if not num_samples:
            return
        last = hidden.index_select(0, batch.logits_indices)
        tokens = self.model.greedy_tokens(last)
        if tokens is None:
            tokens = self.model.compute_logits(last).argmax(dim=-1)
        # The position after each row's last one, in the flat token table.
        where = batch.positions.index_select(0, batch.logits_indices) + 1
        where += batch.sample_slots * states.token_ids.stride(0)
        states.token_ids.view(-1).index_copy_(0, where, tokens.to(torch.int64))

    def _read_drafts(
        self,
        inputs: ProposeInputs,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        max_drafts: np.ndarray,
    ) -> torch.Tensor:
        """[S, k]: the drafts the forwards wrote after each row's known tokens, -1 past its
        max_drafts (and for rows that take none)."""
        k = self.num_speculative_tokens
        num_rows = len(inputs.slots_np)
        width = inputs.states.token_ids.stride(0)
        where = np.zeros((num_rows, k), dtype=np.int64)
        valid = np.zeros((num_rows, k), dtype=bool)
        cols = np.arange(k, dtype=np.int64)
        valid[rows] = cols < max_drafts[:, None]
        where[rows] = (inputs.slots_np[rows] * width + num_tokens)[:, None] + cols
        where[~valid] = 0  # any position in the table: masked out below
        where_dev, valid_dev = self.inputs.h2d.copy(where.reshape(-1), valid.reshape(-1))
        drafts = inputs.states.token_ids.view(-1).index_select(0, where_dev)
        return drafts.masked_fill_(~valid_dev, -1).view(num_rows, k)
