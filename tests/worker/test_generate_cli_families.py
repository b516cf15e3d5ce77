"""`engine generate` (the command line, one process) on tiny random checkpoints with the default
model's tokenizer prints transformers' greedy continuation, for the issue-31 cases whose other
tests run through the model runner: Mistral with a window shorter than the prompt, Phi-4-mini's
shape (partial rotary, LongRoPE) and Qwen2 with YaRN, both with prompts beyond
original_max_position_embeddings. (Gemma, Granite and OLMo 2 have their own command-line tests.)"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_model_with_tokenizer
from tests.worker.runner_utils import hf_causal_lm

NEW_TOKENS = 12
ORIGINAL = 16  # original_max_position_embeddings of the scaled cases
SHARP = {"initializer_range": 0.3}  # weights large enough that the rotation decides tokens


def _longrope(rotary_dim: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": (1 + torch.rand(rotary_dim // 2, generator=gen)).tolist(),
        "long_factor": (2 + 6 * torch.rand(rotary_dim // 2, generator=gen)).tolist(),
    }


CASES = {
    "mistral-window": ("mistral", dict(sliding_window=8, **SHARP)),
    "phi4-mini-longrope": (
        "phi3",
        dict(
            max_position_embeddings=128,
            original_max_position_embeddings=ORIGINAL,
            partial_rotary_factor=0.75,
            rope_parameters=_longrope(12),
            pad_token_id=0,
            **SHARP,
        ),
    ),
    "qwen2-yarn": (
        "qwen2",
        dict(
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            },
            **SHARP,
        ),
    ),
}
PROMPT = (
    "The engine reads a prompt longer than the window and the original context of these tiny "
    "models, so the window and the scaled rotary decide"
)


@pytest.mark.parametrize("name", list(CASES))
def test_engine_generate_prints_transformers_continuation(tmp_path, capsys, name):
    from transformers import AutoTokenizer

    from serve.cli import main

    family, overrides = CASES[name]
    model_dir = make_tiny_model_with_tokenizer(tmp_path / name, arch=family, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    assert len(ids) > max(ORIGINAL, 8)  # beyond the window and the original context
    with torch.inference_mode():
        seq = hf_causal_lm(model_dir).generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    expected = PROMPT + tokenizer.decode(seq[0, len(ids) :], skip_special_tokens=True)
    argv = ["generate", PROMPT, "--model", str(model_dir), "--max-tokens", str(NEW_TOKENS)]
    assert main([*argv, "--ignore-eos", "--device", "cpu", "--max-model-len", "64"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected
