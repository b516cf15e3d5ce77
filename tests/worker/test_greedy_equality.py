"""The default model through the model runner equals transformers' greedy generate, token for token."""

from __future__ import annotations

import pytest
import torch

from engine_core.sampling_params import SamplingParams
from tests.worker.runner_utils import make_runner

NEW_TOKENS = 32

PROMPT_TEXTS = [
    "The capital of France is",
    "Hi",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
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
    " ".join(["The history of the Roman Empire spans many centuries and includes the reigns of "
              "emperors such as Augustus, Nero, Trajan, Hadrian and Constantine."] * 12),
    "Q: What is 17 times 23?\nA:",
]


@pytest.fixture(scope="module")
def engine():
    runner, driver = make_runner(None, max_model_len=2048, kv_cache_memory="512MiB")
    return runner, driver


@pytest.fixture(scope="module")
def prompts(engine):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine[0].config.model_path)
    ids = [tok(text).input_ids for text in PROMPT_TEXTS]
    assert max(len(p) for p in ids) > 300, "one prompt must be long"
    return {f"p{i}": p for i, p in enumerate(ids)}


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """transformers' greedy tokens and raw per-step logprobs, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine[0].config.model_path, dtype=torch.float32)
    # Like ignore_eos: keep generating past EOS without masking it (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    out = {}
    with torch.inference_mode():
        for req_id, ids in prompts.items():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            tokens = gen.sequences[0, len(ids):].tolist()
            logprobs = torch.log_softmax(torch.cat(gen.logits).float(), dim=-1)
            out[req_id] = (tokens, logprobs)
    return out


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def _check(outputs, reference):
    mismatched = {r: (o, reference[r][0]) for r, o in outputs.items() if o != reference[r][0]}
    assert not mismatched, f"{len(mismatched)} prompts differ from transformers: {mismatched}"


def test_one_request_at_a_time(engine, prompts, reference):
    _, driver = engine
    outputs = {}
    for req_id, ids in prompts.items():
        outputs.update(driver.run({req_id: ids}, GREEDY, NEW_TOKENS))
    _check(outputs, reference)


def test_all_requests_in_one_batch(engine, prompts, reference):
    _check(engine[1].run(prompts, GREEDY, NEW_TOKENS), reference)


def test_prompts_split_into_chunks(engine, prompts, reference):
    _check(engine[1].run(prompts, GREEDY, NEW_TOKENS, chunk=13), reference)


def test_sampled_logprobs_and_top5_match_transformers(engine, prompts, reference):
    _, driver = engine
    subset = {r: prompts[r] for r in ("p0", "p3", "p7", "p14")}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS, logprobs=5)
    driver.run(subset, params, NEW_TOKENS)
    for req_id in subset:
        ref_tokens, ref_lp = reference[req_id]
        steps = driver.logprobs[req_id]
        assert len(steps) == NEW_TOKENS
        for pos, step in enumerate(steps):
            ids, lps, rank = step.token_ids[0], step.logprobs[0], step.ranks[0]
            assert ids[0] == ref_tokens[pos] and rank == 1
            assert abs(lps[0] - ref_lp[pos, ids[0]].item()) < 1e-3
            top_vals, top_ids = ref_lp[pos].topk(5)
            assert torch.allclose(torch.tensor(lps[1:]), top_vals, atol=1e-3)
            # Ids must agree except where two candidates are within the tolerance of each other.
            for got, want, val in zip(ids[1:], top_ids.tolist(), top_vals.tolist()):
                assert got == want or abs(ref_lp[pos, got].item() - val) < 1e-3


def test_prompt_logprobs_match_transformers(engine, prompts):
    from transformers import AutoModelForCausalLM

    runner, driver = engine
    ids = prompts["p10"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    driver.run({"pl": ids}, params, 1, chunk=9)
    got = driver.prompt_logprobs["pl"]
    model = AutoModelForCausalLM.from_pretrained(runner.config.model_path, dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(got.token_ids) == len(ids) - 1
    for pos in range(len(ids) - 1):
        assert got.token_ids[pos][0] == ids[pos + 1]
        assert abs(got.logprobs[pos][0] - ref[pos, ids[pos + 1]].item()) < 1e-3
        assert torch.allclose(torch.tensor(got.logprobs[pos][1:]), ref[pos].topk(3).values, atol=1e-3)
