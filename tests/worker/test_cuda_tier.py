"""The model runner's CUDA tier: the same runner on a GPU against the fp32 references.

Skipped without a GPU (the CPU tier covers the same code with Triton's interpreter and the
host-read guard). On CUDA: fp32 greedy tokens equal the CPU runner's and transformers'; bf16
logprobs stay within bf16's tolerance of fp32's; and a whole step launches with CUDA's sync
debug mode set to error, so any implicit device-to-host synchronisation inside it raises.
"""

from __future__ import annotations

import pytest
import torch

from protocol.sampling_params import SamplingParams
from tests.hf_reference import NEW_TOKENS, greedy, prompt_ids
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import assert_first_logprobs_close, make_runner

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA test tier: no GPU on this machine"
)

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
PROMPTS = {"a": list(range(3, 40)), "b": [7], "c": list(range(100, 121))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def test_fp32_on_cuda_equals_the_cpu_runner(tiny):
    _, cpu = make_runner(tiny, device="cpu", max_model_len=128)
    runner, cuda = make_runner(tiny, device="cuda", dtype="float32", max_model_len=128)
    assert runner.device.type == "cuda" and runner.backend.name == "triton"
    runner.warm_up()
    assert cuda.run(PROMPTS, GREEDY, 8, chunk=9) == cpu.run(PROMPTS, GREEDY, 8, chunk=9)


def test_bf16_logprobs_within_tolerance_of_fp32(tiny):
    _, fp32 = make_runner(tiny, device="cuda", dtype="float32", max_model_len=128)
    _, bf16 = make_runner(tiny, device="cuda", dtype="bfloat16", max_model_len=128)
    assert_first_logprobs_close(bf16, fp32, PROMPTS)


def test_a_step_makes_no_implicit_sync(tiny):
    runner, driver = make_runner(tiny, device="cuda", max_model_len=128)
    runner.warm_up()
    driver.run({"w": [1, 2, 3]}, GREEDY, 2)  # first launches and allocations out of the way
    real = runner.execute_model

    def checked(sched):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = runner.execute_model_async(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return launched.get_output()

    runner.execute_model = checked
    try:
        params = SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            seed=1,
            repetition_penalty=1.2,
            min_tokens=2,
            logprobs=2,
            ignore_eos=True,
        )
        driver.run(PROMPTS, params, 4, chunk=9)
    finally:
        runner.execute_model = real


def _default_model_installed() -> bool:
    try:
        from config.default_model import find_default_gguf

        find_default_gguf()
    except RuntimeError:
        return False
    return True


# SmolLM2-135M's shapes (config.json of the default model), for a random-weight twin: the device
# machines lack the default model's package, and its 98 MB GGUF is over what travels there.
SMOLLM2_SHAPES = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_default_model_shapes_fp32_on_cuda_equal_transformers(tmp_path, enforce_eager):
    """The default model's shapes with random weights: greedy tokens on CUDA in fp32, with CUDA
    graphs and without, equal transformers' on the same weights."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "smollm2", **SMOLLM2_SHAPES)
    runner, driver = make_runner(
        path,
        device="cuda",
        dtype="float32",
        max_model_len=256,
        kv_cache_memory="256MiB",
        enforce_eager=enforce_eager,
    )
    runner.warm_up()
    runner.capture_model()
    assert (runner.graphs is None) == enforce_eager
    gen = torch.Generator().manual_seed(1)
    prompts = {
        f"p{i}": torch.randint(3, 49152, (n,), generator=gen).tolist()
        for i, n in enumerate((5, 17, 40))
    }
    outputs = driver.run(prompts, GREEDY, 12)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    for req, ids in prompts.items():
        with torch.inference_mode():
            ref = model.generate(
                torch.tensor([ids], device="cuda"),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        assert outputs[req] == ref[0, len(ids) :].tolist(), req


@pytest.mark.skipif(
    not _default_model_installed(), reason="the default model's package is not installed"
)
def test_default_model_fp32_on_cuda_equals_transformers():
    _, driver = make_runner(
        None, device="cuda", dtype="float32", max_model_len=2048, kv_cache_memory="512MiB"
    )
    prompts = prompt_ids()
    outputs = driver.run(prompts, GREEDY, NEW_TOKENS)
    for req, ids in prompts.items():
        assert outputs[req] == greedy(tuple(ids))[0], req
