"""GGUF models with their linear weights kept quantized: how the configuration decides it, what
the loader keeps quantized (mixed types in fused projections included) and that it holds exactly
the dequantized model's weights; the float32 path stays as before. Greedy equality of the
quantized default model with transformers is tests/worker/test_greedy_equality.py (the default
configuration on the CPU is quantized, which the first test here pins)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter
from safetensors.torch import load_file

from config.args import add_engine_args, engine_kwargs
from config.engine import engine_config_from_kwargs
from config.errors import ConfigError
from config.gguf_convert import GGUF_LINK, dense_tensor
from config.gguf_tensors import read_gguf_tensors
from config.model_arch import ModelArchConfig
from engine_core.resolve import resolved_config
from gpu_worker.layers.cpu_linear import BlockedLinearMethod, SwiGLUPairsLinearMethod
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.quant_linear import GGUFLinearMethod
from gpu_worker.loader.model_loader import load_model
from gpu_worker.models.weights import WeightLoadError
from kernels import cpu_binding
from kernels import linear as cpu_linear
from protocol.sampling_params import SamplingParams
from tests.hf_reference import NEW_TOKENS, greedy, prompt_ids
from tests.kernels.library_env import library_env
from tests.kernels.test_quant_linear import quantized
from tests.tiny_models import make_tiny_model
from tests.worker.runner_utils import make_runner

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")

CPU = torch.device("cpu")


def _resolved(**kwargs):
    return resolved_config(**{"device": "cpu", **kwargs})


def test_gguf_models_stay_quantized_on_the_cpu_by_default():
    config = _resolved()
    assert (config.model.quantization, config.load.load_format) == ("gguf", "gguf")
    assert config.torch_dtype_name == "float32"
    assert _resolved(dtype="float32", quantization="gguf").model.quantization == "gguf"
    assert _resolved(load_format="gguf").model.quantization == "gguf"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"device": "cuda"},
        {"tensor_parallel_size": 3},
        {"load_format": "safetensors"},
    ],
)
def test_what_dequantizes_at_load_as_before(kwargs):
    config = _resolved(**kwargs)
    assert config.model.quantization is None and config.load.load_format != "gguf"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "bfloat16"}, "computes in float32 on the CPU, not bfloat16"),
        ({"tensor_parallel_size": 3}, "not split across tensor-parallel ranks"),
        ({"load_format": "dummy"}, "not load_format 'dummy'"),
    ],
)
def test_what_quantized_weights_cannot_run_is_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _resolved(quantization="gguf", **kwargs)


@pytest.mark.parametrize("dtype, expected", [("auto", "bfloat16"), ("float32", "float32")])
def test_quantized_weights_on_cuda_compute_in_the_models_dtype(dtype, expected):
    config = _resolved(device="cuda", quantization="gguf", dtype=dtype)
    assert (config.model.quantization, config.load.load_format) == ("gguf", "gguf")
    assert config.torch_dtype_name == expected


def test_quantization_needs_a_gguf_model_and_the_kernels(tmp_path):
    tiny = make_tiny_model(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="needs a GGUF model"):
        _resolved(model=str(tiny), quantization="gguf")
    assert _resolved(model=str(tiny)).model.quantization is None
    with pytest.raises(ConfigError, match="quantization must be one of gguf, fp8"):
        engine_config_from_kwargs(quantization="bitsandbytes")
    with library_env(ENGINE_CPU_KERNELS="0"):
        assert _resolved().model.quantization is None
        with pytest.raises(ConfigError, match="need the C CPU kernels"):
            _resolved(quantization="gguf")


def test_quantization_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--quantization", "gguf"])) == {"quantization": "gguf"}


def test_loader_refuses_quantized_weights_where_no_kernel_runs_them(tmp_path):
    config = _resolved()
    with pytest.raises(ValueError, match="CPU with float32 activations, not torch.bfloat16"):
        load_model(config.model_path, config.arch, torch.bfloat16, CPU, "gguf")
    with pytest.raises(ValueError, match="no kernels on meta"):
        load_model(config.model_path, config.arch, torch.float32, torch.device("meta"), "gguf")
    with pytest.raises(WeightLoadError, match="no model.gguf"):
        tiny = make_tiny_model(tmp_path / "tiny")
        load_model(tiny, ModelArchConfig.from_model_dir(tiny), torch.float32, CPU, "gguf")


def test_default_model_holds_the_dequantized_weights():
    """Every linear layer of the default model runs its Q4_1 blocks (the tied output projection
    the embedding's Q8_0 ones, which the lookup shares), which dequantize to exactly the
    converted fp32 weights."""
    config = _resolved()
    model = load_model(config.model_path, config.arch, torch.float32, CPU, "gguf")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert all(
        isinstance(m.method, GGUFLinearMethod) and m.weight is None for m in linears.values()
    )
    assert [p.qtype for p in linears["lm_head"].method.parts] == [GGMLType.Q8_0]
    assert {p.qtype for m in linears.values() for p in m.method.parts} == {
        GGMLType.Q4_1,
        GGMLType.Q8_0,
    }
    # One packed weight per fused projection: q, k and v rows are whole 32-column blocks.
    assert all(len(m.method.parts) == 1 for m in linears.values())
    fp32 = load_file(Path(config.model_path) / "model.safetensors")
    embedding = fp32["model.embed_tokens.weight"]
    table = model.model.embed_tokens
    assert table.weight is None and table.method.parts[0] is linears["lm_head"].method.parts[0]
    ids = torch.tensor([[0, 49151, 7], [31, 32, 12345]])
    assert torch.equal(table(ids), embedding[ids])
    assert torch.equal(linears["lm_head"].method.dequantize(), embedding)
    layer = "model.layers.7"
    qkv = torch.cat([fp32[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(linears[f"{layer}.self_attn.qkv_proj"].method.dequantize(), qkv)
    gate_up = torch.cat([fp32[f"{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(linears[f"{layer}.mlp.gate_up_proj"].method.dequantize(), gate_up)
    down = linears[f"{layer}.mlp.down_proj"].method.dequantize()
    assert torch.equal(down, fp32[f"{layer}.mlp.down_proj.weight"])


# --- a tiny llama written as GGUF with a different type per tensor --------------------------

# Fused projections of mixed types (q and k Q4_K, v Q6_K), a fused projection with a part of no
# kernel (gate F16: gate_up stays fp32), the other types, and an untied output projection.
_TYPES = {
    "attn_q": GGMLType.Q4_K,
    "attn_k": GGMLType.Q4_K,
    "attn_v": GGMLType.Q6_K,
    "attn_output": GGMLType.Q5_K,
    "ffn_gate": GGMLType.F16,
    "ffn_up": GGMLType.Q8_0,
    "ffn_down": GGMLType.Q5_1,
    "output": GGMLType.Q6_K,
    "token_embd": GGMLType.Q5_0,
}
_SHAPES = {
    "attn_q": (256, 256),
    "attn_k": (128, 256),
    "attn_v": (128, 256),
    "attn_output": (256, 256),
    "ffn_gate": (512, 256),
    "ffn_up": (512, 256),
    "ffn_down": (256, 512),
    "output": (512, 256),
    "token_embd": (512, 256),
}


def write_gguf(path: Path, layers: int, types: dict[str, GGMLType] = _TYPES) -> Path:
    """Random quantized tensors of the tiny model's _SHAPES, of the given type per tensor kind;
    the model reads q and k rows un-permuted, as any file's."""
    writer = GGUFWriter(str(path), "llama")
    names = [n for n in types if n in ("output", "token_embd")] + [
        f"blk.{i}.{n}" for i in range(layers) for n in types if n not in ("output", "token_embd")
    ]
    for seed, name in enumerate(names):
        kind = name.rsplit(".", 1)[-1]
        qtype = types[kind]
        n, k = _SHAPES[kind]
        if qtype == GGMLType.F16:
            weight = np.random.default_rng(seed).standard_normal((n, k), np.float32) * 0.05
            writer.add_tensor(f"{name}.weight", weight.astype(np.float16))
            continue
        raw, _ = quantized(qtype, n, k, seed)
        writer.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(256, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["blocked-gate-up", "fused-swiglu"])
def mixed(request, tmp_path_factory):
    """(quantized model, fp32 model of the same file dequantized), loaded once with each CPU MLP
    layout: whether the fused SwiGLU layout pays depends on the build's vector width (512-bit
    vectors: it does), so both are forced here and the suite checks both on any machine."""
    fused = request.param
    root = tmp_path_factory.mktemp("mixed")
    model_dir = make_tiny_model(
        root / "tiny",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = json.loads((model_dir / "config.json").read_text())
    gguf_file = write_gguf(root / "tiny.gguf", config["num_hidden_layers"])
    (model_dir / GGUF_LINK).symlink_to(gguf_file)
    arch = ModelArchConfig.from_model_dir(model_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_linear, "fused_swiglu_pays", lambda: fused)
        model = load_model(model_dir, arch, torch.float32, CPU, "gguf")
    from config.gguf_convert import hf_tensor_name
    from gpu_worker.models.registry import model_class

    reference = model_class(arch.architecture)(arch)
    reference.load_weights(
        (str(gguf_file), hf_tensor_name(t.name), dense_tensor(t, hf_tensor_name(t.name), 4, 2))
        for t in read_gguf_tensors(gguf_file)
    )
    return model, reference, fused


def test_mixed_types_keep_their_blocks_per_part(mixed):
    model, _, fused = mixed
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert [(p.qtype, p.out_features) for p in attn.qkv_proj.method.parts] == [
        (GGMLType.Q4_K, 384),
        (GGMLType.Q6_K, 128),
    ]  # q and k merged, v its own
    assert [p.qtype for p in attn.o_proj.method.parts] == [GGMLType.Q5_K]
    assert [p.qtype for p in mlp.down_proj.method.parts] == [GGMLType.Q5_1]
    # The F32 gate/up weight takes the fused SwiGLU layout where that pays, else the blocked one.
    assert not isinstance(mlp.gate_up_proj.method, GGUFLinearMethod)
    assert isinstance(mlp.gate_up_proj.method, SwiGLUPairsLinearMethod) == fused
    assert isinstance(mlp.gate_up_proj.method, BlockedLinearMethod) == (not fused)
    assert [p.qtype for p in model.lm_head.method.parts] == [GGMLType.Q6_K]


def test_mixed_types_equal_the_dequantized_model(mixed):
    model, reference, _ = mixed
    ours = dict(model.named_modules())
    x = torch.randn(5, 512)
    for name, ref in reference.named_modules():
        if isinstance(ref, Linear) and isinstance(ours[name].method, GGUFLinearMethod):
            assert torch.equal(ours[name].method.dequantize(), ref.weight), name
            inputs = x[:, : ref.weight.shape[1]]
            torch.testing.assert_close(ours[name](inputs), ref(inputs), rtol=1e-5, atol=1e-4)
    ids = torch.arange(512).reshape(2, 256)
    assert torch.equal(model.model.embed_tokens(ids), reference.model.embed_tokens(ids))
    with pytest.raises(IndexError, match="outside the table's 512 rows"):
        model.model.embed_tokens(torch.tensor([512]))


def test_float32_dtype_keeps_the_dequantized_model():
    """--dtype float32 on the default model: fp32 weights as before, transformers' tokens."""
    runner, driver = make_runner(None, dtype="float32", max_model_len=512, kv_cache_memory="64MiB")
    assert not any(
        isinstance(m, Linear) and isinstance(m.method, GGUFLinearMethod)
        for m in runner.model.modules()
    )
    ids = prompt_ids()
    prompts = {r: ids[r] for r in ("p0", "p9", "p13")}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)
    outputs = driver.run(prompts, params, NEW_TOKENS)
    assert outputs == {r: greedy(tuple(p))[0] for r, p in prompts.items()}
