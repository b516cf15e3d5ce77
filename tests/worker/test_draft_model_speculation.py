"""Speculative decoding with a draft model through the offline LLM (CPU fp32, tiny random Llamas
sharing the default model's tokenizer): greedy outputs equal those without speculation, with the
target as its own draft every draft is accepted, and a draft of another vocabulary is refused at
start in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config.errors import ConfigError
from frontend.llm import LLM
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, make_tiny_model_with_tokenizer

K = 3
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "target": make_tiny_model_with_tokenizer(root / "target"),
        "other": make_tiny_model_with_tokenizer(root / "other", num_hidden_layers=1),
    }


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def generate(
    target: Path,
    ids: list[list[int]],
    name: str,
    draft: Path | None = None,
    params: SamplingParams = GREEDY,
    **engine_args,
) -> tuple[list[list[int]], dict, dict]:
    """Greedy tokens of each prompt, this LLM's vllm:spec_decode_* metrics and engine stats."""
    engine_args.setdefault("kv_cache_memory", "16MiB")
    spec = None if draft is None else {"model": str(draft), "num_speculative_tokens": K}
    llm = LLM(
        str(target),
        engine_process=False,
        device="cpu",
        max_model_len=256,
        speculative_config=spec,
        served_model_name=name,
        **engine_args,
    )
    try:
        outputs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        metrics = {
            m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", None)
            for m in llm.get_metrics()
            if m.labels.get("model_name") == name and m.name.startswith("vllm:spec_decode_")
        }
        stats = llm.get_engine_stats()
    finally:
        llm.shutdown()
    return [list(out.outputs[0].token_ids) for out in outputs], metrics, stats


def test_greedy_outputs_equal_and_the_target_as_its_own_draft_is_always_right(models):
    ids = prompts((5, 17, 40, 1))
    base, none, _ = generate(models["target"], ids, "draft-base")
    assert none == {}
    other, metrics, _ = generate(models["target"], ids, "draft-other", models["other"])
    assert other == base
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] > metrics["num_drafts"]
    same, metrics, _ = generate(models["target"], ids, "draft-self", models["target"])
    assert same == base
    # Each request's first token comes from its prompt's step, then every step accepts all K
    # drafts and adds one (the last steps' drafts trimmed to max_tokens): 24 tokens in 7 steps.
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"] > 0
    assert metrics["num_drafts"] == len(ids) * -(-(NEW_TOKENS - 1) // (K + 1))


def test_chunked_prefill_prefix_caching_and_preemption(models):
    shared = prompts((32,), seed=1)[0]
    ids = [shared + tail for tail in prompts((9, 30, 2, 21), seed=2)] + prompts((50,), seed=3)
    tight = dict(
        max_num_batched_tokens=16,  # prompts in chunks, the draft's first catch-up in parts
        enable_prefix_caching=True,
        num_gpu_blocks_override=17,  # 16 hold one request of max_model_len
    )
    longer = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    base, _, _ = generate(models["target"], ids, "tight-base", None, longer, **tight)
    got, metrics, stats = generate(
        models["target"], ids, "tight-self", models["target"], longer, **tight
    )
    assert stats["num_blocks"] == 17
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0
    assert got == base
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"] > 0


def test_a_draft_of_another_vocabulary_is_refused_at_start(models, tmp_path):
    draft = make_tiny_model(tmp_path / "small-vocab")  # vocab_size 512
    with pytest.raises(ConfigError) as err:
        LLM(
            str(models["target"]),
            engine_process=False,
            device="cpu",
            speculative_config={"model": str(draft), "num_speculative_tokens": K},
        )
    assert str(err.value) == (
        "speculative_config: the draft model must share the target's tokenizer/vocabulary: "
        f"512 vs 49152 (vocab_size of the draft {draft} vs the target's)"
    )


def test_engine_generate_with_the_default_model_as_its_own_draft(capsys):
    """`engine generate` on the default model (its GGUF weights, the draft's too): the same text
    with --speculative-config as without."""
    from serve.cli import main

    argv = ["generate", "The capital of France is", "--device", "cpu", "--max-tokens", "24"]
    argv += ["--temperature", "0", "--ignore-eos"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    spec = json.dumps({"model": "SmolLM2-135M-Instruct", "num_speculative_tokens": K})
    assert main([*argv, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out == plain
    assert len(plain) > len("The capital of France is") + 10


def test_tensor_parallel_draft(models):
    """At tensor_parallel_size 2 (the multiprocess executor, gloo) the draft runs sharded like the
    target on every rank: the same tokens as one rank without speculation, every draft of the
    target as its own draft accepted."""
    ids = prompts((5, 33), seed=4)
    base, _, _ = generate(models["target"], ids, "tp-base")
    got, metrics, _ = generate(
        models["target"], ids, "tp-self", models["target"], tensor_parallel_size=2
    )
    assert got == base
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"] > 0
