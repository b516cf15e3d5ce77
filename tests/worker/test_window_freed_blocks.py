"""A model whose every layer slides (tiny MistralForCausalLM, window 18, blocks of 16) runs
prompts and outputs several windows long in a KV cache too small to hold them whole: the engine
core frees the blocks behind the window (engine_core/kv_cache_manager.py) and reuses them, and
the greedy tokens still equal transformers' generate, with every freed block filled with NaN
as it is freed (the window is not a multiple of the block size, so a block freed one position
early would be read by the next step). On the C backend (head_dim 64, the fused
decode stack) and the torch one, through the offline LLM in-process, without preemption; a
later prompt sharing a prefix takes only the cached blocks inside its first window (the
workers get null entries for the rest) and still equals transformers."""

from __future__ import annotations

import pytest
import torch

from engine_core.resolve import resolved_config
from frontend.llm import LLM
from gpu_worker.model_runner import ModelRunner
from kernels.cpu_binding import available as c_kernels_available
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model_with_tokenizer
from tests.worker.runner_utils import hf_causal_lm, hf_greedy

WINDOW = 18
BLOCK = 16
NEW_TOKENS = 48
PROMPT_LENS = (40, 70)
POOL = 6  # blocks: the 117 computed tokens of the longest sequence alone need 8
HEAD64 = {"hidden_size": 256, "num_attention_heads": 4}

CASES = {"c": ("cpu", HEAD64), "torch": ("torch", {})}


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    """(model dir, the backend expected to run it, prompts, transformers' greedy tokens)."""
    backend, overrides = CASES[request.param]
    if backend == "cpu" and not c_kernels_available():
        pytest.skip("no C compiler on this machine")
    model_dir = make_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp(request.param),
        arch="mistral",
        sliding_window=WINDOW,
        max_position_embeddings=512,
        **overrides,
    )
    gen = torch.Generator().manual_seed(5)
    prompts = {f"p{n}": torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS}
    # The continuation of the longest prompt shares its first 4 blocks.
    longest = prompts[f"p{PROMPT_LENS[-1]}"]
    assert len(set(longest)) > 60
    prompts["shared"] = longest + torch.randint(3, 49152, (5,), generator=gen).tolist()
    hf = hf_causal_lm(model_dir)
    reference, _ = hf_greedy(hf, prompts, NEW_TOKENS)
    # The window matters: without it transformers computes other logits for the longest prompt.
    ids = torch.tensor([longest + reference[f"p{PROMPT_LENS[-1]}"]])
    with torch.inference_mode():
        full = hf_causal_lm(model_dir, sliding_window=None)(ids).logits
        assert (hf(ids).logits - full).abs().max() > 1e-3
    return model_dir, backend, prompts, reference


def _llm(model_dir, num_blocks: int, caching: bool = True) -> LLM:
    return LLM(
        str(model_dir),
        engine_process=False,
        device="cpu",
        max_model_len=256,
        block_size=BLOCK,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=caching,
    )


def _poison_freed_blocks(llm: LLM) -> list[int]:
    """Fill every block the KV cache manager frees behind the window with NaN in every layer's
    cache, as it is freed (scheduling is synchronous on the CPU: the steps that read it are
    done); a kernel that read one again would produce NaN. Returns the poisoned ids."""
    kv = llm.engine_core.scheduler.kv
    caches = llm.engine_core.executor.worker.runner.kv_caches
    free_behind_window = kv._free_behind_window
    poisoned: list[int] = []

    def poisoning(request, blocks):
        before = list(blocks)
        free_behind_window(request, blocks)
        ids = [a.block_id for a, b in zip(before, blocks) if a is not b and a.ref_cnt == 0]
        for cache in caches:  # [2, num_blocks, ...] in either backend's layout
            cache[:, ids] = float("nan")
        poisoned.extend(ids)

    kv._free_behind_window = poisoning
    return poisoned


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_sequences_longer_than_the_cache_equal_transformers(model):
    model_dir, backend, prompts, reference = model
    llm = _llm(model_dir, POOL, caching=False)  # poisoned blocks must not be prefix hits
    poisoned = _poison_freed_blocks(llm)
    core = llm.engine_core
    assert core.executor.worker.runner.backend.name == backend
    sched = core.scheduler
    assert sched.kv.sliding_window == WINDOW and core.num_blocks == POOL
    positions: list[int] = []  # the longest block list (positional, freed entries null)
    schedule = sched.schedule

    def recording():
        out = schedule()
        positions.extend(len(blocks) for blocks in sched.kv.req_to_blocks.values())
        return out

    sched.schedule = recording
    names = [f"p{n}" for n in PROMPT_LENS]
    got = _generate(llm, [prompts[n] for n in names])
    assert dict(zip(names, got, strict=True)) == {n: reference[n] for n in names}
    # The longest sequence alone spans 8 blocks (the pool has 6), both together 14: the requests
    # ran on blocks freed behind the window (and, while two prefill chunks of 4 blocks each
    # contended for 6, on preemption); the pool is whole again.
    assert max(positions) == -(-(PROMPT_LENS[-1] + NEW_TOKENS - 1) // BLOCK) > POOL
    assert sched.kv.num_free_blocks == POOL and len(poisoned) >= 8


def test_prefix_hit_takes_only_the_blocks_inside_the_window(model):
    model_dir, _, prompts, reference = model
    llm = _llm(model_dir, 16)  # room enough that the first request's blocks stay cached
    longest = f"p{PROMPT_LENS[-1]}"
    assert _generate(llm, [prompts[longest]]) == [reference[longest]]
    sched = llm.engine_core.scheduler
    new_reqs, null_entries = [], []
    schedule = sched.schedule

    def recording():
        out = schedule()
        new_reqs.extend(out.scheduled_new_reqs)
        for new in out.scheduled_new_reqs:
            blocks = sched.kv.req_to_blocks[new.req_id]
            null_entries.append([b is sched.kv.pool.null_block for b in blocks])
        return out

    sched.schedule = recording
    assert _generate(llm, [prompts["shared"]]) == [reference["shared"]]
    # 64 tokens hit; the first computed query (at 64) sees 47..64: blocks 0-1 are not taken.
    (new,) = new_reqs
    assert new.num_computed_tokens == 64 and new.block_ids[:2] == [0, 0]
    assert null_entries == [[True, True] + [False] * (len(new.block_ids) - 2)]


def test_a_full_attention_model_needs_the_whole_sequence_in_the_cache(tmp_path):
    model_dir = make_tiny_model_with_tokenizer(tmp_path, arch="mistral", sliding_window=None)
    with pytest.raises(ValueError, match="fewer than the 16 blocks one request"):
        _llm(model_dir, POOL)


def test_a_layer_reading_past_the_freed_window_is_refused(model):
    """The runner checks the model it built against the window the engine core frees behind."""
    config = resolved_config(model=str(model[0]), device="cpu", kv_cache_memory="4MiB")
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    assert runner.model is not None
    runner.model.attention_layers()[1].sliding_window = None
    with pytest.raises(RuntimeError, match="window 18 .* layer 1 of the .* within None"):
        runner.initialize_kv_cache(runner.determine_num_blocks())
