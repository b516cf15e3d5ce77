"""transformers' greedy outputs for the default model, computed once per test session."""

from __future__ import annotations

import functools

import torch

NEW_TOKENS = 32

PROMPT_TEXTS = [
    "The capital of France is",
    "Hi",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "La tour Eiffel a été construite pour",
    "Der schnellste Weg von Berlin nach München ist",
    "東京は日本の首都で、",
    "Москва — столица России, и",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "#include <stdio.h>\nint main(void) {\n    printf(",
    "El rápido zorro marrón salta sobre",
    "Photosynthesis is the process by which plants",
    " ".join(
        [
            "The history of the Roman Empire spans many centuries and includes the reigns of "
            "emperors such as Augustus, Nero, Trajan, Hadrian and Constantine."
        ]
        * 12
    ),
    "Q: What is 17 times 23?\nA:",
]


@functools.cache
def default_model_path() -> str:
    from config.default_model import resolve_model_path

    return str(resolve_model_path(None))


@functools.cache
def prompt_ids() -> dict[str, list[int]]:
    """The prompts above, tokenized, keyed p0..p15."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    return {f"p{i}": tok(text).input_ids for i, text in enumerate(PROMPT_TEXTS)}


@functools.cache
def _model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    # Like ignore_eos: keep generating past EOS without masking it (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    return model


@functools.cache
def greedy(ids: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    """NEW_TOKENS greedy tokens after ids, and the raw logprobs [NEW_TOKENS, vocab] of each step."""
    with torch.inference_mode():
        gen = _model().generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return gen.sequences[0, len(ids) :].tolist(), torch.log_softmax(
        torch.cat(gen.logits).float(), -1
    )


def prompt_logprobs(ids: tuple[int, ...]) -> torch.Tensor:
    """log_softmax of the logits at every prompt position [len(ids), vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(_model()(torch.tensor([ids])).logits[0].float(), dim=-1)
