"""Verification steps replay the decode graphs (issue 33): a speculative step whose rows are
all one token (verify.one_token_rows) is written into the decode graphs' persistent buffers and
replayed by the graph of that many rows. CUDA graphs do not exist on the CPU, so a stand-in
replay runs the model eagerly over the buffers, as a captured graph reads them: greedy tokens
equal decoding without speculation only if every buffer (ids, positions, one-token context
lengths, slots, full-width block-table rows) holds the step."""

from __future__ import annotations

import shutil

import pytest
import torch

from frontend.llm import LLM
from gpu_worker.decode_inputs import DecodeInputs
from gpu_worker.forward_context import StepAttention, forward_context
from kernels.cpu_binding import available
from protocol.sampling_params import SamplingParams
from tests.spec_decode.test_ngram_e2e import NGRAM, PROMPTS
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")


class EagerReplay:
    """DecodeGraphs' replay on the CPU: the target run eagerly over the buffers' first rows,
    with the metadata a captured graph reads (built over the buffers)."""

    def __init__(self, runner, inputs: DecodeInputs) -> None:
        self.runner, self.inputs = runner, inputs
        self.calls: list[int] = []

    def replay(self, num_reqs: int, max_seq_len: int) -> torch.Tensor | None:
        if not self.inputs.padded_size(num_reqs):
            return None
        self.calls.append(num_reqs)
        backend = self.runner.backend
        meta = backend.graph_metadata(self.inputs.metadata(num_reqs, max_seq_len), CPU)
        with forward_context(StepAttention(backend, meta)):
            return self.runner.model(
                self.inputs.input_ids[:num_reqs], self.inputs.positions[:num_reqs]
            )


@pytest.mark.skipif(not available(), reason="the C attention backend builds no host plan")
def test_verification_steps_replay_the_decode_graphs(tmp_path) -> None:
    from config.default_model import resolve_model_path

    path = make_tiny_model(
        tmp_path / "h64",
        vocab_size=512,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path(None) / name, path / name)
    args = dict(device="cpu", max_model_len=128, kv_cache_memory="8MiB", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = LLM(str(path), engine_process=False, **args)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]

    llm = LLM(str(path), engine_process=False, speculative_config=NGRAM, **args)
    runner = llm.engine.engine_core.executor.worker.runner
    assert not runner.backend.plans_on_host
    inputs = DecodeInputs([1, 2, 4, 8, 16], runner.states.block_table.shape[1], CPU)
    runner.graphs = graphs = EagerReplay(runner, inputs)
    runner.inputs.use_graph_inputs(inputs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # Plain decode steps replay with one row per request; verification steps with 1 + k rows
    # per drafting request: more rows than requests.
    assert max(graphs.calls) > len(PROMPTS)
