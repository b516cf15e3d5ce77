"""Per-request state of the model runner, slot-indexed and kept on the device.

Each live request owns a slot (a row). Token ids, token counts and block tables live in device
tensors, changed only by staged writes (new requests, new blocks) and by the step's own
post-update on the device (the sampled token appended, computed counts advanced), so a step
never reads the device from the host. The host keeps mirrors of the counts and block tables,
which it can advance itself: every request that samples in a step gains exactly one token.
"""

from __future__ import annotations

from itertools import compress

import numpy as np
import torch

from gpu_worker.staging import HostToDevice, StagedWrites
from kernels.post_update import post_update_for


class RequestStates:
    """Token ids, computed counts and block tables of every live request, by slot."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        h2d: HostToDevice,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        # One spare column: a request that reaches max_model_len still records its last sample.
        self.token_ids = torch.zeros(
            (max_num_reqs, max_model_len + 1), dtype=torch.int64, device=device
        )
        self.num_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.num_computed = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((max_num_reqs, max_blocks), dtype=torch.int32, device=device)
        # Host mirrors: what the device will hold once the steps launched so far have run.
        self.num_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.prompt_len_np = np.zeros(max_num_reqs, dtype=np.int64)
        # LongRoPE: the slot's request turns with the long factors (NewRequestData.rope_long).
        self.rope_long_np = np.zeros(max_num_reqs, dtype=bool)
        # Blocks each slot holds: a list, read and written one slot at a time.
        self.num_blocks = [0] * max_num_reqs
        self.block_table_np = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self._token_writes = StagedWrites(self.token_ids, h2d)
        self._count_writes = [StagedWrites(t, h2d) for t in (self.num_tokens, self.num_computed)]
        self._block_writes = StagedWrites(self.block_table, h2d)
        self._post_update = post_update_for(device)
        self.slot_of: dict[str, int] = {}
        # Bumped whenever slot_of changes, so a step can reuse the last step's slot lookups.
        self.version = 0
        self._free = list(range(max_num_reqs - 1, -1, -1))

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt: int,
        block_ids: list[int],
        num_computed: int,
        rope_long: bool = False,
    ) -> int:
        """Claim a slot for a request that already holds token_ids; returns the slot.
        rope_long: LongRoPE's long factors turn it (rope_offsets)."""
        if not self._free:
            raise RuntimeError("more live requests than max_num_seqs")
        n = len(token_ids)
        if n > self.token_ids.shape[1] - 1:
            raise ValueError(
                f"request of {n} tokens exceeds max_model_len {self.token_ids.shape[1] - 1}"
            )
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        self.version += 1
        self._token_writes.put_row(slot, token_ids)
        self.num_tokens_np[slot] = n
        self.num_computed_np[slot] = num_computed
        self.prompt_len_np[slot] = num_prompt
        self.rope_long_np[slot] = rope_long
        self._count_writes[0].put(slot, n)
        self._count_writes[1].put(slot, num_computed)
        self.num_blocks[slot] = 0
        self.append_blocks(slot, block_ids)
        return slot

    def remove(self, req_id: str) -> int | None:
        """Give a request's slot back; returns it (None for an unknown request)."""
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
            self.version += 1
        return slot

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        """Extend a slot's block table."""
        if not block_ids:
            return
        start = self.num_blocks[slot]
        if len(block_ids) == 1:  # a decode entering a new block: most calls
            self.block_table_np[slot, start] = block_ids[0]
        else:
            self.block_table_np[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)
        self._block_writes.put_row(slot, block_ids, start)

    def append_blocks_of(self, req_ids: list[str], new_block_ids: list[list[int]]) -> None:
        """append_blocks for each request of req_ids given blocks (a step's block boundary:
        often many requests, one block each, written into the mirror with one numpy call)."""
        slot_of, num_blocks = self.slot_of, self.num_blocks
        width = self.block_table_np.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        flat: list[int] = []
        ids: list[int] = []
        # Only the requests given blocks, picked at C speed (a boundary step: a few of them).
        for req_id, block_ids in compress(zip(req_ids, new_block_ids), new_block_ids):
            slot = slot_of[req_id]
            if len(block_ids) == 1:
                start = num_blocks[slot]
                rows.append(slot)
                cols.append(start)
                flat.append(slot * width + start)
                ids.append(block_ids[0])
                num_blocks[slot] = start + 1
            else:
                self.append_blocks(slot, block_ids)
        if rows:
            self.block_table_np[rows, cols] = ids
            self._block_writes.put_scalars(flat, ids)

    def stage_tokens(self, slot: int, token_ids: list[int], start: int) -> None:
        """Stage token ids into a slot's row from position start (speculative decoding's drafts,
        written after the known tokens; num_tokens does not count them)."""
        self._token_writes.put_row(slot, token_ids, start)

    def apply_staged_writes(self) -> None:
        """Send the new requests and blocks to the device."""
        self._token_writes.apply()
        for writes in self._count_writes:
            writes.apply()
        self._block_writes.apply()

    def post_update(
        self,
        slots: torch.Tensor,
        slots_np: np.ndarray,
        seq_lens: torch.Tensor,
        seq_lens_np: np.ndarray,
        sample_slots: torch.Tensor,
        sample_slots_np: np.ndarray,
        sampled: torch.Tensor | None,
        num_output: torch.Tensor,
    ) -> None:
        """After a step: its requests computed up to seq_lens, and sampled requests gained
        their sampled token and one more output in num_output (SamplingStates' column), all on
        the device by one kernel (kernels.post_update); the mirrors advance alike."""
        if sampled is None:
            sampled = sample_slots  # no row sampled: both are empty
        self._post_update(
            slots,
            seq_lens,
            sample_slots,
            sampled,
            self.num_computed,
            self.num_tokens,
            self.token_ids,
            num_output,
        )
        self.num_computed_np[slots_np] = seq_lens_np
        if len(sample_slots_np):
            self.num_tokens_np[sample_slots_np] += 1
