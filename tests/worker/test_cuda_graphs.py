"""CUDA graphs for decode steps (gpu_worker/cuda_graphs.py).

On the CPU: the capture sizes vLLM's --cuda-graph-sizes gives, the flag refused where no graph
can exist, and decode steps whose inputs go through the graphs' persistent buffers (padding
rows included) computing what the ordinary path computes. On CUDA: greedy tokens with graphs
equal those without, through batches that shrink as requests finish, padded sizes, and the
split-context attention of long prompts; and decode steps do replay.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from config.engine import capture_sizes, engine_config_from_kwargs
from config.errors import ConfigError
from engine_core.resolve import resolved_config
from gpu_worker import cuda_graphs
from gpu_worker.decode_inputs import DecodeInputs
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )


def test_capture_sizes_follow_vllm():
    assert capture_sizes(None, 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes([32], 256) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes([3, 1, 500], 64) == [1, 3, 64]
    assert capture_sizes(None, 3) == [1, 2, 3]


def test_graph_sizes_refused_where_no_graph_runs(tiny):
    with pytest.raises(ConfigError, match="only on CUDA"):
        resolved_config(model=str(tiny), device="cpu", cuda_graph_sizes=[8])
    with pytest.raises(ConfigError, match="positive"):
        engine_config_from_kwargs(model=str(tiny), cuda_graph_sizes=[0])
    with pytest.raises(ConfigError, match="enforce_eager turns off"):
        engine_config_from_kwargs(model=str(tiny), cuda_graph_sizes=[8], enforce_eager=True)
    config = resolved_config(model=str(tiny), device="cpu")
    assert config.cuda_graph_capture_sizes() == []


def test_decode_inputs_pad_and_pick_sizes():
    inputs = DecodeInputs([1, 2, 4, 8], max_blocks=3, device=torch.device("cpu"))
    assert [inputs.padded_size(b) for b in range(10)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 0]
    inputs.slot_mapping[:8] = torch.arange(8)
    inputs.seq_lens[:8] = 50
    inputs.pad(3, 4)
    assert inputs.slot_mapping.tolist() == [0, 1, 2, -1, 4, 5, 6, 7]
    assert inputs.seq_lens.tolist() == [50, 50, 50, 1, 50, 50, 50, 50]
    meta = inputs.metadata(4, 77)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.max_query_len == 1
    assert meta.block_table.shape == (4, 3) and meta.max_seq_len == 77


def test_decode_steps_through_the_graph_buffers_compute_the_same(tiny):
    """Without a GPU nothing replays, but a covered decode step's inputs still go through the
    buffers (full-width block-table rows): the eager forward over them gives the same tokens."""
    prompts = {"a": list(range(3, 30)), "b": [7, 8], "c": list(range(100, 119))}
    _, plain = make_runner(tiny, max_model_len=128)
    runner, buffered = make_runner(tiny, max_model_len=128)
    inputs = DecodeInputs([1, 2, 4], runner.states.block_table.shape[1], runner.device)
    runner.inputs.use_graph_inputs(inputs)
    assert buffered.run(prompts, GREEDY, 6, chunk=9) == plain.run(prompts, GREEDY, 6, chunk=9)
    # The last decode step wrote its three requests' rows.
    assert (inputs.slot_mapping[:3] >= 0).all() and (inputs.seq_lens[:3] > 1).all()


def _generate(model, prompts, max_tokens, monkeypatch, **engine_args):
    from engine_core.engine_core import EngineCore
    from protocol.engine_core import EngineCoreRequest

    replays = [0]
    real = cuda_graphs.DecodeGraphs.replay

    def counted(self, num_reqs, max_seq_len):
        hidden = real(self, num_reqs, max_seq_len)
        replays[0] += hidden is not None
        return hidden

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "replay", counted)
    config = engine_config_from_kwargs(
        model=str(model),
        device="cuda",
        dtype="float32",
        max_model_len=4096,
        max_num_seqs=8,
        kv_cache_memory="64MiB",
        **engine_args,
    )
    core = EngineCore(config)
    try:
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        out: dict[str, list[int]] = defaultdict(list)
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                out[o.request_id] += o.new_token_ids
    finally:
        core.shutdown()
        torch.cuda.empty_cache()
    return dict(out), replays[0]


@cuda_only
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_graphs_equals_eager(tiny, monkeypatch, async_scheduling):
    # Five requests finishing one after another: decode batches of 5, 4, 3, 2, 1 (padded to
    # 8, 4, 4, 2, 1).
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(5)]
    lengths = [4, 7, 10, 13, 16]
    eager, none = _generate(
        tiny, prompts, lengths, monkeypatch, enforce_eager=True, async_scheduling=async_scheduling
    )
    graphs, replays = _generate(
        tiny, prompts, lengths, monkeypatch, async_scheduling=async_scheduling
    )
    assert none == 0 and replays >= 10
    assert graphs == eager


@cuda_only
def test_long_contexts_replay_the_split_attention_graphs(tiny, monkeypatch):
    # A 2100-token prompt: decode attention splits its context (kernels/triton/paged_decode.py).
    prompts = [[(7 * j) % 500 + 3 for j in range(2100)], list(range(5, 40))]
    eager, _ = _generate(tiny, prompts, [8, 8], monkeypatch, enforce_eager=True)
    graphs, replays = _generate(tiny, prompts, [8, 8], monkeypatch, cuda_graph_sizes=[1, 2, 4])
    assert replays >= 6
    assert graphs == eager


@cuda_only
def test_graphs_with_sliding_windows_equal_eager(tmp_path, monkeypatch):
    """Per-layer windows are constants of the captured graphs: a Qwen2 whose first layer is full
    (the split-context kernels at 2,100 tokens) and whose second slides by 64 (the one-pass
    kernel in the same step) gives the eager tokens, graphs replaying."""
    model = make_tiny_model(
        tmp_path / "qwen2",
        "qwen2",
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
        max_position_embeddings=4096,
    )
    prompts = [[(7 * j) % 500 + 3 for j in range(2100)], list(range(5, 140))]
    eager, _ = _generate(model, prompts, [8, 8], monkeypatch, enforce_eager=True)
    graphs, replays = _generate(model, prompts, [8, 8], monkeypatch, cuda_graph_sizes=[1, 2, 4])
    assert replays >= 6
    assert graphs == eager
