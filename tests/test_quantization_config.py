"""--quantization and a checkpoint's quantization_config: what resolves to which method, and what
is refused at configuration time, naming what and why (config/quantization.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.errors import ConfigError
from config.load import LoadConfig
from config.model import ModelConfig
from config.quantization import QuantScheme, quant_scheme, resolve_quantization
from engine_core.resolve import resolved_config
from tests.tiny_models import make_tiny_model

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def _ct_fp8(weights: dict, acts: dict | None) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def _ct_int(overrides: dict) -> dict:
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32} | overrides
    group = {"targets": ["Linear"], "weights": weights}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
    }


FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("q") / "llama")


def _with(dense: Path, tmp_path: Path, qc: dict | None) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    for f in dense.iterdir():
        (path / f.name).symlink_to(f)
    config = json.loads((dense / "config.json").read_text())
    if qc is not None:
        config["quantization_config"] = qc
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _resolve(model: Path, **kwargs):
    return resolved_config(model=str(model), **{"device": "cpu", **kwargs})


@pytest.mark.parametrize(
    "qc, method",
    [
        (GPTQ, "gptq"),
        (AWQ, "awq"),
        (_ct_fp8(FP8_CHANNEL, DYNAMIC_TOKEN), "compressed-tensors"),
        (_ct_int({"actorder": "group"}), "compressed-tensors"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "modelopt"),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}, "modelopt"),
        ({"quant_method": "fbgemm_fp8"}, "fbgemm_fp8"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8"),
    ],
)
def test_checkpoint_quantization_resolves_to_its_method(dense, tmp_path, qc, method):
    model = _with(dense, tmp_path, qc)
    assert _resolve(model).model.quantization == method
    assert _resolve(model, quantization=method).model.quantization == method


def test_schemes_read_from_quantization_config():
    assert quant_scheme({"quantization_config": {**GPTQ, "desc_act": True}}, None) == QuantScheme(
        "int", "gptq", 4, 32, sym=True, desc_act=True, checkpoint_format="gptq"
    )
    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensor = {**FP8_CHANNEL, "strategy": "tensor"}
    scheme = quant_scheme({"quantization_config": _ct_fp8(tensor, static)}, None)
    assert scheme is not None
    assert (scheme.method, scheme.weight_per_channel, scheme.activation_dynamic) == (
        "fp8",
        False,
        False,
    )
    assert scheme.ignore == ("lm_head",)
    w8a16 = quant_scheme({"quantization_config": _ct_fp8(FP8_CHANNEL, None)}, None)
    assert w8a16 is not None and w8a16.weight_only
    at_load = quant_scheme({}, "fp8")
    assert at_load is not None and at_load.quantize_at_load and at_load.weight_per_channel


def test_dense_checkpoint_quantized_at_load_or_dummy(dense, tmp_path):
    model = _with(dense, tmp_path, None)
    assert _resolve(model).model.quantization is None
    assert _resolve(model, quantization="fp8").model.quantization == "fp8"
    config = _resolve(model, quantization="gptq", load_format="dummy")
    assert config.model.quantization == "gptq"
    scheme = quant_scheme(config.arch.hf_config, "gptq", "dummy")
    assert scheme == QuantScheme("int", "gptq", 4, 128, sym=False, quantize_at_load=True)


@pytest.mark.parametrize(
    "qc, kwargs, message",
    [
        ({"quant_method": "bitsandbytes"}, {}, "quant_method 'bitsandbytes' is not supported"),
        ({**GPTQ, "bits": 3}, {}, "gptq: 3-bit weights are not supported"),
        ({**GPTQ, "group_size": 48}, {}, "group_size 48 is not supported.*multiple of 32"),
        ({**GPTQ, "checkpoint_format": "marlin"}, {}, "checkpoint_format 'marlin' is not read"),
        ({**AWQ, "version": "gemv"}, {}, "awq: version 'gemv' is not read"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            {},
            "block-wise fp8 .* is not supported",
        ),
        (
            _ct_fp8({**FP8_CHANNEL, "strategy": "block"}, DYNAMIC_TOKEN),
            {},
            "strategy 'block' are not read .block-wise fp8 is not supported",
        ),
        (
            _ct_fp8(FP8_CHANNEL, {**DYNAMIC_TOKEN, "strategy": "tensor"}),
            {},
            "dynamic activation scales per 'tensor' are not supported",
        ),
        (
            {"quant_method": "modelopt", "quant_algo": "NVFP4"},
            {},
            "quant_algo 'NVFP4' is not supported",
        ),
        (
            _ct_int({"symmetric": False}),
            {},
            "asymmetric pack-quantized weights are not read",
        ),
        (_ct_int({"actorder": "random"}), {}, "actorder 'random' is not read"),
        (GPTQ, {"quantization": "awq"}, "--quantization awq does not match .* gptq"),
        (None, {"quantization": "gptq"}, "no quantization_config .dense weights"),
        (GPTQ, {"dtype": "bfloat16"}, "float32 activations, not bfloat16"),
        (GPTQ, {"tensor_parallel_size": 2}, "not split across tensor-parallel ranks yet"),
        (
            _ct_fp8(FP8_CHANNEL, DYNAMIC_TOKEN),
            {"device": "cuda", "tensor_parallel_size": 2},
            "not split across tensor-parallel ranks yet",
        ),
    ],
)
def test_what_cannot_run_is_refused_at_configuration(dense, tmp_path, qc, kwargs, message):
    model = _with(dense, tmp_path, qc)
    with pytest.raises(ConfigError, match=message):
        _resolve(model, **kwargs)


def test_mixture_of_experts_checkpoints_are_refused(tmp_path):
    moe = make_tiny_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2)
    config = json.loads((moe / "config.json").read_text())
    config["quantization_config"] = GPTQ
    (moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="gptq checkpoints of mixture-of-experts models"):
        _resolve(moe)


def test_fp8_on_the_cpu_is_dequantized_so_tensor_parallel_runs(dense, tmp_path):
    model = _with(dense, tmp_path, _ct_fp8(FP8_CHANNEL, DYNAMIC_TOKEN))
    config = _resolve(model, tensor_parallel_size=2)
    assert config.model.quantization == "compressed-tensors"


def test_a_device_without_a_path_is_refused():
    # The engine's devices are cpu and cuda today; a new one gets no quantized path silently.
    with pytest.raises(ConfigError, match="gptq 4-bit weights .* there is no mps path"):
        resolve_quantization(
            ModelConfig(model="/a/gptq"),
            LoadConfig(),
            1,
            "mps",
            lambda: True,
            {"quantization_config": GPTQ},
        )


def test_gguf_resolution_unchanged():
    assert resolved_config(device="cpu").model.quantization == "gguf"
    with pytest.raises(ConfigError, match="quantization 'fp8' reads a safetensors checkpoint"):
        resolved_config(device="cpu", quantization="fp8")  # the default model is GGUF
    with pytest.raises(ConfigError, match="load_format 'gguf' keeps a GGUF file's own"):
        resolved_config(device="cpu", quantization="fp8", load_format="gguf")
