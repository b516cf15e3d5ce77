"""EagleProposer: drafts with an EAGLE or EAGLE-3 head (gpu_worker/models/eagle_heads.py).

The head runs pairs (the target's hidden state at position p, the token at p + 1) and writes its
own KV cache, one layer's worth, in the target's block ids. Each step it consumes every position
the target computed (ProposeInputs.batch, sampling requests or not), so its cache covers the
prompt chunk by chunk: the step's batch again, in the same order, the input ids shifted by one
(read from the token table, where the post-update has put the accepted tokens), the attention
metadata built over the same batch. Rows of rejected drafts compute pairs beyond the known
tokens; their KV lies past each request's last valid position and is rewritten before it is
ever attended to (attention is causal, and the next step starts at that position).

A request that sampled then drafts greedily: the head's output at its last valid pair (the
runner's last_rows) gives draft 1; k - 1 single-token steps follow, each feeding the head its own
output hidden state and the previous draft (EAGLE's chain). Every step keeps all S requests, so
the shapes stay fixed and the host decides everything (no device read): a request past its
max_drafts computes a discarded row at position N - 1 (N: its known tokens), the one position
past them it may always write (its KV is scratch until the next step's catch-up rewrites it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from config.attention import AttentionFeatures
from config.eagle_head import EagleHeadSpec, check_eagle_head
from config.engine import EngineConfig
from gpu_worker.attention.metadata import DeviceBatch, StepBatch
from gpu_worker.attention.select import attention_backend
from gpu_worker.forward_context import StepAttention, forward_context
from gpu_worker.kv_cache import allocate_kv_caches, kv_block_bytes, kv_cache_torch_dtype
from gpu_worker.loader.cpu_layout import process_weights_after_loading
from gpu_worker.loader.model_loader import iter_safetensors, torch_dtype
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.models.eagle_heads import EagleHead, build_eagle_head

if TYPE_CHECKING:
    from gpu_worker.spec_decode.proposer import ProposeInputs


class EagleProposer:
    """The Proposer of methods eagle and eagle3. The runner hands it the loaded target model
    (attach_target) before load()."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        spec = config.speculative
        assert spec is not None and config.arch is not None
        self.config = config
        self.device = device
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.head_path = spec.model_path
        self.spec: EagleHeadSpec = check_eagle_head(config)
        self.dtype = torch_dtype(config.torch_dtype_name)
        self.block_size = config.cache.block_size
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype)
        features = AttentionFeatures(kv_cache_dtype=config.cache.kv_cache_dtype)
        self.backend = attention_backend(
            device, self.dtype, self.spec.arch.head_dim, self.block_size, features
        )
        self.target: DecoderForCausalLM | None = None
        self.head: EagleHead | None = None
        self.kv_caches: list[torch.Tensor] = []
        # [K] int64: the draft columns, to cut each row at its max_drafts.
        self._columns = torch.arange(self.num_speculative_tokens, device=device)

    def attach_target(self, target: torch.nn.Module) -> None:
        """The target model whose hidden states (EAGLE-3: the aux layers' inputs, switched on
        here) and embedding (EAGLE: and output projection) the head reads."""
        if not isinstance(target, DecoderForCausalLM):
            raise ValueError(
                f"an EAGLE head drafts over the shared decoder's hidden states; the target "
                f"{type(target).__name__} has none"
            )
        self.target = target
        if self.spec.method == "eagle3":
            max_tokens = self.config.scheduler.max_num_batched_tokens
            assert max_tokens is not None
            target.keep_aux_hidden_states(self.spec.aux_layer_ids, max_tokens)

    def load(self) -> None:
        """Build the head and load its weights (random ones with --load-format dummy)."""
        if self.target is None:
            raise RuntimeError("EagleProposer.attach_target(model) before load()")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                head = build_eagle_head(self.spec, self.target)
        finally:
            torch.set_default_dtype(previous)
        if self.config.load.load_format == "dummy":
            head.fill_dummy(self.config.model.seed)
        else:
            head.load_weights(iter_safetensors(self.head_path))
        process_weights_after_loading(head, self.device, torch.get_num_threads())
        self.head = head.eval()

    def kv_block_bytes(self) -> int:
        """One block's bytes of the head's layers, at the target's block size and KV dtype."""
        tp = self.config.parallel.tensor_parallel_size
        return kv_block_bytes(self.spec.arch, self.block_size, self.kv_dtype, tp)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the head's KV cache (num_blocks blocks, the target's block ids) and bind it."""
        assert self.head is not None, "load() first"
        self.kv_caches = allocate_kv_caches(
            self.spec.arch,
            num_blocks,
            self.block_size,
            self.kv_dtype,
            self.device,
            self.backend.kv_cache_shape,
            self.config.parallel.tensor_parallel_size,
        )
        for attn, cache in zip(self.head.attention_layers(), self.kv_caches, strict=True):
            attn.kv_cache = cache

    def capture_model(self) -> None:
        """Nothing yet: the head's steps run eagerly (CUDA graphs for them are owed)."""

    def add_request(self, slot: int, num_computed: int) -> None:
        """Nothing kept per slot: the head's KV follows the positions the target computes (a
        prefix-cache hit's blocks hold the head's KV where it computed them before)."""

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        head, batch = self.head, inputs.batch
        assert head is not None, "load() first"
        assert batch is not None and inputs.hidden_states is not None, "EAGLE reads the step"
        num_reqs, k = len(inputs.slots_np), self.num_speculative_tokens
        out, hidden = self._catch_up(head, inputs)
        if num_reqs == 0 or not inputs.max_drafts_np.any():
            return torch.full((num_reqs, k), -1, dtype=torch.int64, device=self.device)
        assert inputs.last_rows is not None
        out = out.index_select(0, inputs.last_rows)
        hidden = hidden.index_select(0, inputs.last_rows)
        tokens = head.greedy_tokens(out)
        drafts = [tokens]
        steps = int(inputs.max_drafts_np.max())
        if steps > 1:
            chain = _ChainSteps(
                inputs, steps, self.block_size, self.config.max_model_len, self.device
            )
            for j in range(1, steps):
                metadata = self.backend.build(
                    chain.host_batch(j) if self.backend.plans_on_host else None,
                    chain.device_batch(j),
                    self.device,
                )
                with forward_context(StepAttention(self.backend, metadata)):
                    out, hidden = head(head.embed(tokens), hidden, chain.positions[j - 1])
                tokens = head.greedy_tokens(out)
                drafts.append(tokens)
        drafts += [tokens] * (k - len(drafts))
        max_drafts = torch.from_numpy(inputs.max_drafts_np).to(self.device, non_blocking=True)
        keep = self._columns.unsqueeze(0) < max_drafts.unsqueeze(1)
        return torch.stack(drafts, dim=1).masked_fill_(~keep, -1)

    def _catch_up(
        self, head: EagleHead, inputs: ProposeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over every position of the step's batch: pairs (the target's hidden state
        at p, the token at p + 1 from the token table); returns the head's two outputs [T, H]."""
        batch, states = inputs.batch, inputs.states
        assert batch is not None and inputs.hidden_states is not None
        num_tokens = int(batch.query_start_loc_np[-1])
        device_batch = batch.device_batch
        qsl = device_batch.query_start_loc.to(torch.int64)
        # Each row's slot, then its next token: token_ids[slot, position + 1].
        row_slots = torch.repeat_interleave(batch.slots, qsl[1:] - qsl[:-1], output_size=num_tokens)
        positions = batch.positions[:num_tokens]
        flat = row_slots * states.token_ids.stride(0) + positions + 1
        ids = states.token_ids.view(-1).index_select(0, flat)
        aux = inputs.aux_hidden_states
        if aux is not None:
            aux = [a[:num_tokens] for a in aux]
        hidden = head.combine(inputs.hidden_states[:num_tokens], aux)
        host = batch.host_batch() if self.backend.plans_on_host else None
        metadata = self.backend.build(host, device_batch, self.device)
        with forward_context(StepAttention(self.backend, metadata)):
            return head(head.embed(ids), hidden, positions)


class _ChainSteps:
    """The k - 1 single-token steps' inputs, known on the host: request i's step j computes
    position N_i - 2 + j (N_i: its known tokens) while j < max_drafts[i], a discarded row at
    N_i - 1 (within max_model_len) after. One copy to the device for all steps."""

    def __init__(
        self,
        inputs: ProposeInputs,
        steps: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        states = inputs.states
        last = inputs.num_tokens_np - 2  # [S]: the last valid pair's position
        idle = np.minimum(last + 1, max_model_len - 1)
        j = np.arange(1, steps)[:, None]  # [J, 1]
        live = j < inputs.max_drafts_np[None, :]  # [J, S]
        positions = np.where(live, last[None, :] + j, idle[None, :])
        self.seq_lens_np = (positions + 1).astype(np.int32)
        self.max_blocks = -(-int(self.seq_lens_np.max()) // block_size)
        self.block_table_np = states.block_table_np[inputs.slots_np, : self.max_blocks]
        blocks = np.take_along_axis(
            np.broadcast_to(self.block_table_np, (steps - 1, *self.block_table_np.shape)),
            (positions // block_size)[..., None],
            axis=2,
        )[..., 0]
        self.slot_mapping_np = blocks.astype(np.int64) * block_size + positions % block_size
        num_reqs = len(inputs.slots_np)
        self.query_start_loc_np = np.arange(num_reqs + 1, dtype=np.int32)
        self.block_size = block_size

        def to(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

        self.positions = to(positions)
        self.seq_lens = to(self.seq_lens_np)
        self.slot_mapping = to(self.slot_mapping_np)
        self.query_start_loc = to(self.query_start_loc_np)
        self.block_table = states.block_table.index_select(0, inputs.slots)[:, : self.max_blocks]

    def device_batch(self, j: int) -> DeviceBatch:
        return DeviceBatch(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens[j - 1],
            block_table=self.block_table,
            slot_mapping=self.slot_mapping[j - 1],
            max_query_len=1,
            max_seq_len=int(self.seq_lens_np[j - 1].max()),
        )

    def host_batch(self, j: int) -> StepBatch:
        return StepBatch(
            query_start_loc=self.query_start_loc_np,
            seq_lens=self.seq_lens_np[j - 1],
            block_table=self.block_table_np,
            slot_mapping=self.slot_mapping_np[j - 1],
            block_size=self.block_size,
        )
