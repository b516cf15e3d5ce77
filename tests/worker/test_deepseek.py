"""DeepSeek-V2/V3 (multi-head latent attention, shared experts, grouped routing) through the model
runner equals transformers on tiny random models, and keeps one latent vector per token.

Each case writes a small random checkpoint with transformers (tests/tiny_models.py) and perturbs
what transformers initialises to constants (norm weights to 1, the V3 router's correction bias
to 0) so those paths matter; it then checks greedy tokens (one request at a time, all in one
batch, prompts in chunks) and the last-position logits against transformers in fp32.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.attention import AttentionFeatures, attention_backends_for
from config.errors import ConfigError
from config.model_arch import ModelArchConfig
from gpu_worker.attention.select import backend_class
from gpu_worker.kv_cache import kv_block_bytes
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import (
    assert_last_logits_close,
    assert_same_tokens,
    hf_causal_lm,
    hf_greedy,
    make_runner,
    random_prompts,
    run_multiproc,
)

NEW_TOKENS = 8
PROMPT_LENS = (1, 7, 16, 45)  # one token, under a block, exactly one block, over two blocks
LOGIT_ATOL = 1e-4

MLA = dict(
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # MLA has no KV heads; transformers repeats KV by heads / this
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
)
MOE = dict(
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
)
V3 = dict(**MLA, **MOE, n_group=2, topk_group=1, q_lora_rank=48, routed_scaling_factor=2.5)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

# name -> (family, overrides of the tiny config)
CASES = {
    "v3": ("deepseek_v3", V3),
    "v3-no-q-lora": ("deepseek_v3", {**V3, "q_lora_rank": None}),
    "v3-rope-halves": ("deepseek_v3", {**V3, "rope_interleave": False, "norm_topk_prob": False}),
    "v3-yarn": ("deepseek_v3", {**V3, "rope_parameters": YARN}),
    # V2-Lite's shape: no q compression, softmax greedy routing, no renormalisation.
    "v2-lite": ("deepseek_v2", {**MLA, **MOE, "q_lora_rank": None, "topk_method": "greedy"}),
    "v2-grouped": (
        "deepseek_v2",
        {
            **MLA,
            **MOE,
            "q_lora_rank": 48,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
}


def _perturb_constants(model_dir) -> None:
    """Random norm weights and correction biases (transformers makes them 1 and 0); the
    correction bias large enough to change which experts are chosen."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.5 * torch.randn(t.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("mlp.gate.weight"):
            tensors[name] = 0.5 * torch.randn(t.shape, generator=gen)  # decisive routing
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(runner, driver, prompts, HF greedy tokens, HF last-position logits)."""
    family, overrides = CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    _perturb_constants(model_dir)
    runner, driver = make_runner(model_dir, kv_cache_memory="2MiB")
    assert runner.backend.name == "mla_torch"
    prompts = random_prompts(runner.arch.vocab_size, PROMPT_LENS)
    tokens, logits = hf_greedy(hf_causal_lm(model_dir), prompts, NEW_TOKENS)
    return runner, driver, prompts, tokens, {r: x[-1] for r, x in logits.items()}


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def test_one_request_at_a_time(case):
    _, driver, prompts, reference, _ = case
    outputs = {}
    for req_id, ids in prompts.items():
        outputs.update(driver.run({req_id: ids}, GREEDY, NEW_TOKENS))
    assert_same_tokens(outputs, reference)


def test_mixed_prompt_lengths_in_one_batch(case):
    _, driver, prompts, reference, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS), reference)


@pytest.mark.parametrize("chunk", [5, 16])
def test_prompts_split_into_chunks(case, chunk):
    _, driver, prompts, reference, _ = case
    assert_same_tokens(driver.run(prompts, GREEDY, NEW_TOKENS, chunk=chunk), reference)


def test_last_position_logits_match_transformers(case, monkeypatch):
    runner, driver, prompts, _, ref_last = case
    assert_last_logits_close(runner, driver, prompts, ref_last, LOGIT_ATOL, monkeypatch)


def test_cache_holds_one_latent_vector_per_token(case):
    """Each layer's cache is [blocks, block_size, kv_lora_rank + qk_rope_head_dim], and the
    sizing counts that (not 2 * heads * head_dim) per token and layer."""
    runner, _, _, _, _ = case
    latent = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    arch, block_size = runner.arch, runner.block_size
    assert arch.kv_latent_dim == latent and arch.head_dim == MLA["qk_rope_head_dim"]
    assert len(runner.kv_caches) == arch.num_hidden_layers
    for cache in runner.kv_caches:
        assert cache.shape[1:] == (block_size, latent)
    per_block = kv_block_bytes(arch, block_size, torch.float32)
    assert per_block == arch.num_hidden_layers * latent * block_size * 4
    # The whole latent vector on every tensor-parallel rank: its heads all read it.
    assert kv_block_bytes(arch, block_size, torch.float32, tensor_parallel_size=2) == per_block
    assert runner.kv_caches[0].shape[0] == 2 * 2**20 // per_block


def _tiny_arch(**overrides) -> ModelArchConfig:
    cfg = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=512,
        **{k: v for k, v in MLA.items() if k not in ("num_hidden_layers", "num_attention_heads")},
    )
    return ModelArchConfig.from_dict({**cfg, **overrides})


def test_only_the_mla_backends_run_a_latent_cache():
    mla = AttentionFeatures.of(_tiny_arch(), 512)
    assert mla.mla
    assert attention_backends_for("cpu", 16, 16, "float32", mla) == ["mla_torch"]
    assert attention_backends_for("cuda", 16, 16, "bfloat16", mla) == ["mla_triton"]
    with pytest.raises(ConfigError, match="kv_cache_dtype fp8 is not supported by the mla_triton"):
        attention_backends_for("cuda", 16, 16, "bfloat16", replace(mla, kv_cache_dtype="fp8"))
    # ... and a model without MLA never gets an MLA backend, nor hears of one in a refusal.
    plain = AttentionFeatures()
    assert attention_backends_for("cpu", 16, 64, "float32", plain) == ["cpu", "torch"]
    with pytest.raises(ConfigError) as refused:
        attention_backends_for("cuda", 16, 100, "bfloat16", plain)
    assert "head_dim 100" in str(refused.value) and "mla" not in str(refused.value)
    for name in ("mla_torch", "mla_triton"):
        with pytest.raises(ValueError, match="one vector per token"):
            backend_class(name).kv_cache_shape(4, 16, 2, 48)


def test_cuda_graphs_with_the_triton_mla_backend_only():
    """The Triton backend reads the device batch (graphs capture it); the torch one plans on the
    host, so the runner runs its steps eagerly."""
    triton_cls, torch_cls = backend_class("mla_triton"), backend_class("mla_torch")
    assert triton_cls.supports_cuda_graphs and not triton_cls.plans_on_host
    assert not torch_cls.supports_cuda_graphs and torch_cls.plans_on_host


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_triton_backend_equals_the_torch_one(tmp_path, name):
    """The model through the Triton MLA backend (the interpreter on the CPU, so a few prompts)
    gives the torch MLA backend's tokens (which are transformers', above)."""
    from gpu_worker.attention.mla_triton_backend import MLATritonBackend

    family, overrides = CASES[name]
    model_dir = make_tiny_model(tmp_path, family, **overrides)
    _perturb_constants(model_dir)
    runner, torch_driver = make_runner(model_dir, kv_cache_memory="2MiB")
    prompts = {
        r: ids
        for r, ids in random_prompts(runner.arch.vocab_size, PROMPT_LENS).items()
        if r != "len7"
    }
    expected = torch_driver.run(prompts, GREEDY, 4, chunk=16)
    _, driver = make_runner(model_dir, attention_backend=MLATritonBackend(), kv_cache_memory="2MiB")
    assert_same_tokens(driver.run(prompts, GREEDY, 4, chunk=16), expected)


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_equal_one(tmp_path, name, expert_parallel):
    """Tensor parallelism through the multiprocess executor: each rank holds half the heads
    (q, kv_b_proj, o_proj) and the whole latent cache, and half of every expert's and shared
    expert's intermediate dimension (or half the experts, with --enable-expert-parallel); the
    greedy tokens are one rank's (which are transformers', above)."""
    family, overrides = CASES[name]
    model_dir = make_tiny_model(tmp_path, family, **overrides)
    _perturb_constants(model_dir)
    runner, one_rank = make_runner(model_dir, kv_cache_memory="2MiB")
    prompts = random_prompts(runner.arch.vocab_size, PROMPT_LENS)
    expected = one_rank.run(prompts, GREEDY, NEW_TOKENS, chunk=16)
    outputs, num_blocks = run_multiproc(
        model_dir,
        prompts,
        GREEDY,
        NEW_TOKENS,
        chunk=16,
        kv_cache_memory="2MiB",
        enable_expert_parallel=expert_parallel,
    )
    # The whole latent vector on each rank: as many blocks as one rank alone gets.
    assert num_blocks == runner.kv_caches[0].shape[0]
    assert_same_tokens(outputs, expected)


@pytest.fixture(scope="module")
def v3_with_tokenizer(tmp_path_factory):
    """A tiny DeepSeek-V3 with the default model's tokenizer, and transformers' model of it."""
    from tests.tiny_models import make_tiny_model_with_tokenizer

    model_dir = tmp_path_factory.mktemp("v3-tokenizer")
    make_tiny_model_with_tokenizer(model_dir, arch="deepseek_v3", **V3)
    _perturb_constants(model_dir)
    return model_dir, hf_causal_lm(model_dir)


def _hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        seq = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return seq[0, len(ids) :].tolist()


def test_prefix_caching_reads_the_latent_blocks_back(v3_with_tokenizer):
    """Prompts sharing a 40-token prefix: the later ones find its blocks in the cache (the
    latent cache is per block like any other) and still give transformers' tokens."""
    from frontend.llm import LLM

    model_dir, model = v3_with_tokenizer
    llm = LLM(
        str(model_dir),
        engine_process=False,
        device="cpu",
        max_model_len=128,
        kv_cache_memory="4MiB",
        enable_prefix_caching=True,
    )
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 49152, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (3, 9, 20)]
    llm.generate(prompt_token_ids=prompts[0], sampling_params=GREEDY, use_tqdm=False)
    hits_before = llm.get_engine_stats()["prefix_cache_hits"]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert llm.get_engine_stats()["prefix_cache_hits"] - hits_before >= 3 * 32
    for ids, out in zip(prompts, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == _hf_greedy(model, ids)


def test_engine_generate_deepseek_v3_equals_transformers(v3_with_tokenizer, capsys):
    """`engine generate` on a tiny DeepSeek-V3 with a real tokenizer prints transformers' text."""
    from transformers import AutoTokenizer

    from serve.cli import main

    model_dir, model = v3_with_tokenizer
    prompt = "Latent attention keeps one vector"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt)["input_ids"]
    expected = prompt + tokenizer.decode(_hf_greedy(model, ids), skip_special_tokens=True)
    argv = ["generate", prompt, "--model", str(model_dir), "--max-tokens", str(NEW_TOKENS)]
    rc = main([*argv, "--ignore-eos", "--device", "cpu", "--max-model-len", "64"])
    assert rc == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_bfloat16_stays_close_to_float32(tmp_path):
    """In bf16 (the router's weight and logits kept in fp32, as transformers keeps them), the
    first token's top logprobs stay within bf16's tolerance of fp32's."""
    from tests.worker.runner_utils import assert_first_logprobs_close

    family, overrides = CASES["v3"]
    model_dir = make_tiny_model(tmp_path, family, **overrides)
    _perturb_constants(model_dir)
    runner, ref = make_runner(model_dir, kv_cache_memory="2MiB")
    bf16_runner, got = make_runner(model_dir, kv_cache_memory="2MiB", dtype="bfloat16")
    assert bf16_runner.kv_caches[0].dtype == torch.bfloat16
    gate = bf16_runner.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert_first_logprobs_close(got, ref, random_prompts(runner.arch.vocab_size, PROMPT_LENS))


@pytest.mark.parametrize(
    ("version", "fields", "words"),
    [
        (2, {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported for DeepSeek-V2"),
        (3, {"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported for DeepSeek-V3"),
        (2, {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
        (3, {"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
        (3, {"n_group": 3}, r"n_routed_experts \(8\) is not divisible by n_group \(3\)"),
        (3, {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds the experts"),
        (3, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (3, {"moe_intermediate_size": None}, "missing field 'moe_intermediate_size'"),
    ],
)
def test_routing_configs_the_model_cannot_run_are_refused(version, fields, words):
    from config.moe_arch import DeepseekMoEConfig

    cfg = {**MOE, "n_group": 2, "topk_group": 1, "architectures": ["DeepseekV3ForCausalLM"]}
    with pytest.raises(ValueError, match=words):
        DeepseekMoEConfig.from_hf({**cfg, **fields}, version)


def test_routing_and_layers_as_transformers_reads_the_config():
    from config.moe_arch import DeepseekMoEConfig

    v3 = DeepseekMoEConfig.from_hf({**MOE, "n_group": 2, "topk_group": 1}, 3)
    assert v3.routing is not None and v3.correction_bias
    assert (v3.routing.scoring, v3.routing.group_score, v3.routing.num_groups) == (
        "sigmoid",
        "top2_sum",
        2,
    )
    assert v3.routing.renormalize and v3.routing.routed_scaling_factor == 2.5  # V3's defaults
    assert [v3.is_sparse(i) for i in range(4)] == [False, True, True, True]
    v2 = DeepseekMoEConfig.from_hf({**MOE, "n_group": 2, "moe_layer_freq": 2}, 2)
    assert v2.routing is not None and not v2.correction_bias and v2.routing.num_groups == 1
    assert not v2.routing.renormalize and v2.routing.scoring == "softmax"
    assert [v2.is_sparse(i) for i in range(5)] == [False, False, True, False, True]
    dense = DeepseekMoEConfig.from_hf({"n_routed_experts": None}, 2)
    assert not any(dense.is_sparse(i) for i in range(4))


def test_attention_configs_the_model_cannot_run_are_refused():
    from config.mla_arch import MLAConfig

    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig.from_hf({**MLA, "qk_rope_head_dim": 15})
    with pytest.raises(ValueError, match="v_head_dim must be a positive integer, not None"):
        MLAConfig.from_hf({**MLA, "v_head_dim": None})
    for missing in (None, "16"):
        with pytest.raises(ValueError, match="kv_lora_rank .latent attention. needs an integer"):
            _tiny_arch(qk_rope_head_dim=missing)


def test_warm_up_gets_the_latent_caches_block_count(tmp_path, monkeypatch):
    """The runner hands warm-up its block count, not a dimension of the cache tensor (a latent
    cache is [blocks, block_size, latent]; a per-head one [2, blocks, ...])."""
    from gpu_worker import model_runner
    from gpu_worker.attention.mla_triton_backend import MLATritonBackend

    family, overrides = CASES["v3"]
    model_dir = make_tiny_model(tmp_path, family, **overrides)
    runner, _ = make_runner(model_dir, attention_backend=MLATritonBackend(), kv_cache_memory="2MiB")
    seen = []
    monkeypatch.setattr(model_runner, "warm_up", lambda *args: seen.append(args[3]))
    runner.warm_up()  # the Triton backend compiles its kernels: warm-up runs
    assert seen == [runner.kv_caches[0].shape[0]] and seen[0] > runner.block_size
