"""DraftModelProposer's drafts equal the draft model's greedy continuation in transformers.

The proposer runs alone over a RequestStates filled as the runner fills it (prompt, outputs and
accepted drafts in the token table, blocks for the known tokens and num_speculative_tokens more),
on CPU fp32 tiny random Llamas: a different draft (the torch attention backend, and one of head
size 64 on the C kernels' backend), and the target as its own draft. Each round extends every
request as a verified step would (some of its drafts accepted, then one more token) and asks for
drafts again, so the draft's catch-up covers whole prompts, a step's accepted tokens, and a
request left out of earlier rounds.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_core.resolve import resolved_config
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.forward_context import StepAttention, forward_context
from gpu_worker.request_state import RequestStates
from gpu_worker.spec_decode.draft_model import DraftModelProposer
from gpu_worker.spec_decode.proposer import ProposeInputs, make_proposer
from gpu_worker.staging import HostToDevice
from kernels.cpu_binding import available
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import hf_causal_lm, random_prompts

K = 3
BLOCK = 16
NUM_BLOCKS = 64
CPU = torch.device("cpu")
# name -> overrides of the draft's tiny config (None: the target itself).
DRAFTS = {
    "other": {"num_hidden_layers": 1, "intermediate_size": 96},
    "head64": {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
    "self": None,
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module", params=list(DRAFTS))
def draft(request, target, tmp_path_factory):
    """(draft folder, transformers' model of it)."""
    overrides = DRAFTS[request.param]
    path = (
        target
        if overrides is None
        else make_tiny_model(tmp_path_factory.mktemp(request.param), **overrides)
    )
    return path, hf_causal_lm(path)


def reference(hf, ids: list[int], n: int) -> list[int]:
    """The draft's n greedy tokens after ids, by transformers."""
    with torch.inference_mode():
        seq = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return seq[0, len(ids) :].tolist()


class Requests:
    """RequestStates as the runner keeps them, with blocks for each request's known tokens and
    K lookahead positions (the scheduler's allocation), and the proposer told of each new one."""

    def __init__(self, proposer: DraftModelProposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.states = RequestStates(8, max_model_len, BLOCK, CPU, HostToDevice(CPU))
        self.free = list(range(NUM_BLOCKS))
        self.tokens: dict[str, list[int]] = {}

    def _blocks(self, req_id: str, have: int) -> list[int]:
        need = -(-(len(self.tokens[req_id]) + K) // BLOCK) - have
        return [self.free.pop(0) for _ in range(need)]

    def add(self, req_id: str, ids: list[int], blocks: list[int] = (), num_computed: int = 0):
        self.tokens[req_id] = list(ids)
        blocks = list(blocks) + self._blocks(req_id, len(blocks))
        slot = self.states.add(req_id, ids, len(ids), blocks, num_computed)
        self.states.apply_staged_writes()
        self.proposer.add_request(slot, num_computed)

    def extend(self, req_id: str, ids: list[int]) -> None:
        """The request gained ids (accepted drafts and a new token), as the post-update writes."""
        st, slot = self.states, self.states.slot_of[req_id]
        n = len(self.tokens[req_id])
        st.token_ids[slot, n : n + len(ids)] = torch.tensor(ids)
        st.num_tokens_np[slot] = n + len(ids)
        self.tokens[req_id] += ids
        st.append_blocks(slot, self._blocks(req_id, st.num_blocks[slot]))
        st.apply_staged_writes()

    def propose(
        self, max_drafts: dict[str, int], chunks: dict[str, int] | None = None
    ) -> dict[str, list[int]]:
        """Drafts for the requests of max_drafts, which sampled; chunks: requests that computed
        a prompt chunk in the step, up to this many tokens (the step's batch holds them)."""
        req_ids = list(max_drafts)
        slots = np.array([self.states.slot_of[r] for r in req_ids], dtype=np.int64)
        batch = None
        if chunks is not None:
            chunk_slots = [self.states.slot_of[r] for r in chunks]
            # What _prompt_chunks reads of the step's InputBatch.
            batch = SimpleNamespace(
                slots_np=np.array([*slots, *chunk_slots], dtype=np.int64),
                seq_lens_np=np.array([0] * len(slots) + list(chunks.values()), dtype=np.int32),
                sample_rows_np=np.arange(len(slots), dtype=np.int64),
            )
        inputs = ProposeInputs(
            slots_np=slots,
            slots=torch.from_numpy(slots.copy()),
            num_tokens_np=np.array([len(self.tokens[r]) for r in req_ids], dtype=np.int64),
            max_drafts_np=np.array(list(max_drafts.values()), dtype=np.int64),
            states=self.states,
            batch=batch,  # type: ignore[arg-type]
        )
        drafts = self.proposer.propose(inputs)
        assert drafts.shape == (len(req_ids), K) and drafts.dtype == torch.int64
        # as_subclass: the host's copy of the result (a guarded tensor refuses tolist).
        return dict(zip(req_ids, drafts.as_subclass(torch.Tensor).tolist()))


def expected(hf, requests: Requests, max_drafts: dict[str, int]) -> dict[str, list[int]]:
    return {
        r: reference(hf, requests.tokens[r], m)[:m] + [-1] * (K - m) if m else [-1] * K
        for r, m in max_drafts.items()
    }


def make(target, draft_path, **engine_args) -> tuple[DraftModelProposer, Requests]:
    config = resolved_config(
        model=str(target),
        device="cpu",
        kv_cache_memory="4MiB",
        speculative_config={"model": str(draft_path), "num_speculative_tokens": K},
        **engine_args,
    )
    proposer = make_proposer(config, CPU)
    assert isinstance(proposer, DraftModelProposer)
    proposer.load()
    proposer.initialize_kv_cache(NUM_BLOCKS)
    return proposer, Requests(proposer, config.max_model_len)


def record_forwards(proposer: DraftModelProposer, monkeypatch) -> list[list[int]]:
    """Each draft forward's query lengths, from now on."""
    sizes: list[list[int]] = []
    prepare = proposer.inputs.prepare

    def recording(states, slots, start, query_lens, sample_rows):
        sizes.append([int(n) for n in query_lens])
        return prepare(states, slots, start, query_lens, sample_rows)

    monkeypatch.setattr(proposer.inputs, "prepare", recording)
    return sizes


@pytest.mark.parametrize("max_forward_tokens", [None, 20])
def test_drafts_equal_the_draft_models_greedy_continuation(
    target, draft, max_forward_tokens, monkeypatch
):
    draft_path, hf = draft
    proposer, requests = make(target, draft_path)
    if max_forward_tokens is not None:
        proposer.max_forward_tokens = max_forward_tokens  # long prompts' catch-up in parts
    forwards = record_forwards(proposer, monkeypatch)
    head64 = proposer.arch.head_dim == 64  # the C kernels' head size; the others: torch
    assert proposer.backend.name == ("cpu" if head64 and available() else "torch")
    prompts = random_prompts(512, (1, 7, 16, 45))
    for req_id, ids in prompts.items():
        requests.add(req_id, ids)

    every = {r: K for r in prompts}
    got = requests.propose(every)
    assert got == expected(hf, requests, every)
    if max_forward_tokens is not None:
        assert all(sum(f) <= max_forward_tokens for f in forwards)
        assert len(forwards) > K

    # A verified step: row i accepted i of its drafts (the last one all), then one more token;
    # a request the draft never saw joins; each may take another number of drafts (len7: none).
    gen = torch.Generator().manual_seed(3)
    for i, req_id in enumerate(prompts):
        requests.extend(req_id, got[req_id][:i] + [int(torch.randint(3, 512, (1,), generator=gen))])
    requests.add("late", random_prompts(512, (30,), seed=11)["len30"])
    limits = {"len1": 3, "len7": 0, "len16": 1, "len45": 2, "late": 3}
    forwards.clear()
    got = requests.propose(limits)
    assert got == expected(hf, requests, limits)
    if max_forward_tokens is None:
        # The catch-up computes only what each row's draft cache lacks: the accepted drafts'
        # KV is there from their own forwards (all but the last draft's: len45 accepted 3 of
        # 3, two of them fed), the new token's is not.
        assert forwards[0] == [1, 1, 2, 30]
        assert [len(f) for f in forwards] == [4, 3, 2]

    # Each accepted its first draft and one more token; len7 had none (its draft cache lags by
    # two steps' tokens), len16's only draft was never fed.
    for req_id, m in limits.items():
        requests.extend(req_id, (got[req_id][:1] if m else []) + [6])
    forwards.clear()
    again = {r: K for r in limits}
    assert requests.propose(again) == expected(hf, requests, again)
    if max_forward_tokens is None:
        assert forwards[0] == [1, 2, 2, 1, 1]


def test_prefix_cache_hit_reads_the_drafts_kv_of_the_shared_blocks(target, draft, monkeypatch):
    draft_path, hf = draft
    proposer, requests = make(target, draft_path)
    forwards = record_forwards(proposer, monkeypatch)
    prompt = random_prompts(512, (40,), seed=5)["len40"]
    requests.add("first", prompt)
    requests.propose({"first": K})
    # Its first two blocks, full of prompt tokens, are the next request's prefix-cache hit.
    shared = requests.states.block_table_np[requests.states.slot_of["first"], :2].tolist()
    second = prompt[:32] + random_prompts(512, (9,), seed=6)["len9"]
    requests.add("second", second, blocks=shared, num_computed=32)
    forwards.clear()
    assert requests.propose({"second": K}) == expected(hf, requests, {"second": K})
    assert forwards[0] == [9]


def test_prompt_chunks_of_the_step_are_computed_along(target, draft, monkeypatch):
    """A request whose prompt the target computes in chunks, in steps where others sample: the
    draft computes each chunk in that step's catch-up, and the request's first drafts need only
    its last chunk."""
    draft_path, hf = draft
    proposer, requests = make(target, draft_path)
    forwards = record_forwards(proposer, monkeypatch)
    requests.add("a", random_prompts(512, (6,), seed=8)["len6"])
    requests.add("long", random_prompts(512, (45,), seed=9)["len45"])
    requests.propose({"a": K}, chunks={"long": 16})
    assert forwards[0] == [6, 16]
    requests.extend("a", [7])
    forwards.clear()
    requests.propose({"a": 1}, chunks={"long": 32})
    assert forwards == [[1, 16]]
    forwards.clear()
    both = {"a": K, "long": K}
    requests.extend("a", [8])
    assert requests.propose(both) == expected(hf, requests, both)
    assert forwards[0] == [1, 13]
    # Only what the draft lacks: chunks it already computed are not computed again.
    requests.extend("a", [9])
    requests.extend("long", [9])
    forwards.clear()
    requests.propose({"a": 1}, chunks={"long": 40})
    assert forwards == [[1]]


def test_rows_without_drafts_are_not_computed(target, draft, monkeypatch):
    draft_path, _ = draft
    proposer, requests = make(target, draft_path)
    forwards = record_forwards(proposer, monkeypatch)
    requests.add("a", [5, 6, 7])
    assert requests.propose({"a": 0}) == {"a": [-1] * K}
    assert forwards == []


def test_propose_reads_nothing_back_from_the_device(target, monkeypatch):
    """Every tensor that would live on a GPU guarded (tests/worker/test_no_host_reads.py): the
    runner's tables, the draft's positions and KV cache, whatever the host copies over; the
    model in torch ops, so that everything it computes inherits the guard."""
    from gpu_worker import staging
    from tests.kernels.library_env import library_env
    from tests.worker.test_no_host_reads import _guard

    with library_env(ENGINE_CPU_KERNELS="0"):
        proposer, requests = make(target, target)
        hf = hf_causal_lm(target)
        st = requests.states
        for name in ("token_ids", "num_tokens", "num_computed", "block_table"):
            setattr(st, name, _guard(getattr(st, name)))
        proposer.inputs._start = _guard(proposer.inputs._start)
        for attn in proposer.model.attention_layers():
            attn.kv_cache = _guard(attn.kv_cache)
        copy = staging.HostToDevice.copy
        monkeypatch.setattr(
            staging.HostToDevice, "copy", lambda self, *a: [_guard(t) for t in copy(self, *a)]
        )
        prompts = random_prompts(512, (5, 23))
        for req_id, ids in prompts.items():
            requests.add(req_id, ids)
        limits = {"len5": K, "len23": 2}
        assert requests.propose(limits) == expected(hf, requests, limits)


class EagerReplay:
    """DecodeGraphs.replay on the CPU: the draft run eagerly over the graph buffers' first
    num_reqs rows, read as a captured graph reads them (metadata built over the buffers)."""

    def __init__(self, proposer: DraftModelProposer, inputs: DecodeInputs) -> None:
        self.proposer, self.inputs = proposer, inputs
        self.calls: list[int] = []

    def replay(self, num_reqs: int, max_seq_len: int) -> torch.Tensor | None:
        if not self.inputs.padded_size(num_reqs):
            return None
        self.calls.append(num_reqs)
        backend = self.proposer.backend
        meta = backend.graph_metadata(self.inputs.metadata(num_reqs, max_seq_len), CPU)
        with forward_context(StepAttention(backend, meta)):
            return self.proposer.model(
                self.inputs.input_ids[:num_reqs], self.inputs.positions[:num_reqs]
            )


@pytest.mark.skipif(not available(), reason="the C kernels' attention backend builds no host plan")
def test_one_token_forwards_gather_into_the_graph_buffers(target, tmp_path):
    draft = make_tiny_model(tmp_path / "head64", **DRAFTS["head64"])
    hf = hf_causal_lm(draft)
    proposer, requests = make(target, draft)
    assert not proposer.backend.plans_on_host
    inputs = DecodeInputs([1, 2, 4], requests.states.block_table.shape[1], CPU)
    proposer.inputs.use_graph_inputs(inputs)
    proposer.graphs = graphs = EagerReplay(proposer, inputs)  # type: ignore[assignment]
    prompts = random_prompts(512, (3, 17, 40))
    for req_id, ids in prompts.items():
        requests.add(req_id, ids)
    every = {r: K for r in prompts}
    got = requests.propose(every)
    assert got == expected(hf, requests, every)
    assert graphs.calls == [3, 3]  # the catch-up of whole prompts runs eagerly
    # Every draft rejected: the catch-up is one token per request, a graph's shape too.
    for i, req_id in enumerate(prompts):
        requests.extend(req_id, [7 + i])
    graphs.calls.clear()
    assert requests.propose(every) == expected(hf, requests, every)
    assert graphs.calls == [3, 3, 3]
    # More requests than the largest size: eager again.
    for n in (5, 6):
        requests.add(f"more{n}", random_prompts(512, (n,), seed=n)[f"len{n}"])
        requests.extend(f"more{n}", [9])
    graphs.calls.clear()
    every = {r: K for r in requests.tokens}
    assert requests.propose(every) == expected(hf, requests, every)
    assert graphs.calls == []
