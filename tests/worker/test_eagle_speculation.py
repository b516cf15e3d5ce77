"""EAGLE and EAGLE-3 heads end to end: LLM(..., speculative_config={"method": "eagle" |
"eagle3", ...}) on the CPU, in-process, over a tiny random Llama. Whatever the head drafts, the
output is the target's own; a head that predicts the target exactly has every draft accepted;
heads load with --load-format dummy from config.json alone, and pickled ones after conversion.
The heads and the target are test_eagle_proposer.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.tiny_models import TINY, make_tiny_model
from tests.worker.test_eagle_proposer import (
    LAYERS,
    K,
    _head_config,
    _refusal,
    _sequence,
    write_head,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"), num_hidden_layers=LAYERS)


def _with_tokenizer(path: Path) -> str:
    import shutil

    from config.default_model import resolve_model_path

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path(None) / name, path / name)
    return str(path)


def _spec_totals(llm) -> dict[str, float]:
    """vllm:spec_decode_num_draft_tokens / _num_accepted_tokens so far (in this process)."""
    totals = {"num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in totals:
            totals[name] += m.value
    return totals


def _generate(
    model: str, spec: dict | None, prompts: list[list[int]], **engine_args
) -> tuple[list, dict]:
    """Greedy token ids of prompts, and the draft and accepted tokens counted meanwhile."""
    from frontend.llm import LLM
    from protocol.sampling_params import SamplingParams

    llm = LLM(
        model,
        device="cpu",
        max_model_len=128,
        kv_cache_memory="8MiB",
        block_size=8,
        max_num_batched_tokens=24,  # the 30-token prompt in two chunks
        engine_process=False,
        speculative_config=spec,
        **engine_args,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = _spec_totals(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = _spec_totals(llm)
    counted = {name: after[name] - before[name] for name in after}
    return [o.outputs[0].token_ids for o in outputs], counted


PROMPTS = [_sequence(20, 7), _sequence(21, 30), _sequence(22, 12)]


@pytest.mark.parametrize(("method", "tp"), [("eagle", 1), ("eagle3", 1), ("eagle3", 2)])
def test_llm_greedy_equal_with_and_without_a_head(method, tp, target, tmp_path):
    """A random head's drafts are mostly rejected; the output is the target's all the same
    (with TP 2 over gloo: the head's projections and draft vocabulary split over the ranks)."""
    model = _with_tokenizer(target)
    head = write_head(tmp_path / method, target, method)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
    plain, _ = _generate(model, None, PROMPTS)
    speculative, totals = _generate(model, spec, PROMPTS, tensor_parallel_size=tp)
    assert speculative == plain
    assert totals["num_draft_tokens"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_an_exact_head_has_its_drafts_accepted(tp, tmp_path):
    """A target whose attention outputs nothing (o_proj = 0, final norm weight 1) predicts each
    token from the one before; an EAGLE head with the same MLPs (fc passing the embedding
    through) drafts exactly its greedy tokens: every draft is accepted, also with the head's
    projections split over 2 tensor-parallel ranks (gloo)."""
    from safetensors.torch import load_file

    target = make_tiny_model(tmp_path / "target", num_hidden_layers=2)
    weights = load_file(str(target / "model.safetensors"))
    for name in list(weights):
        if name.endswith("o_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, str(target / "model.safetensors"))
    head = tmp_path / "head"
    write_head(head, target, "eagle")  # the layout, then the exact weights
    h = TINY["hidden_size"]
    tensors = load_file(str(head / "model.safetensors"))
    tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    for name in list(tensors):
        if name.endswith("o_proj.weight"):
            tensors[name] = torch.zeros_like(tensors[name])
        elif name.startswith("layers.") and "self_attn" not in name:
            tensors[name] = weights[f"model.{name}"]
    save_file(tensors, str(head / "model.safetensors"))
    model = _with_tokenizer(target)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": K}
    plain, _ = _generate(model, None, PROMPTS)
    speculative, totals = _generate(model, spec, PROMPTS, tensor_parallel_size=tp)
    assert speculative == plain
    assert totals["num_draft_tokens"] >= 3 * 12
    assert totals["num_accepted_tokens"] == totals["num_draft_tokens"]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_dummy_weights_need_only_the_heads_config(method, target, tmp_path):
    """--load-format dummy: a head folder with config.json alone gives a random head of its
    shape (the target's weights are random too); greedy output equals the plain engine's."""
    head = tmp_path / method
    head.mkdir()
    (head / "config.json").write_text(json.dumps(_head_config(target, method)))
    model = _with_tokenizer(target)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
    plain, _ = _generate(model, None, PROMPTS, load_format="dummy")
    speculative, totals = _generate(model, spec, PROMPTS, load_format="dummy")
    assert speculative == plain
    assert totals["num_draft_tokens"] > 0


def test_a_pickled_head_converts_to_the_loadable_layout(target, tmp_path):
    """scripts/convert_eagle_head.py: the head as the authors publish it (pytorch_model.bin) is
    refused; converted, it resolves and holds the same tensors."""
    from safetensors.torch import load_file

    from engine_core.resolve import resolved_config
    from scripts.convert_eagle_head import main

    head = write_head(tmp_path / "published", target, "eagle3")
    tensors = load_file(str(head / "model.safetensors"))
    (head / "model.safetensors").unlink()
    torch.save(tensors, head / "pytorch_model.bin")
    assert "PyTorch pickles are not loaded" in _refusal(target, head, "eagle3")
    main([str(head), str(tmp_path / "converted")])
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert converted.keys() == tensors.keys()
    assert all(torch.equal(converted[n], t) for n, t in tensors.items())
    spec = {"method": "eagle3", "model": str(tmp_path / "converted"), "num_speculative_tokens": K}
    resolved_config(model=str(target), device="cpu", speculative_config=spec)
