"""A malformed model directory fails with a message that names the file and the problem.

Each test copies a tiny checkpoint written by transformers and breaks one thing in it; errors
surface either when the configuration is resolved (config.json) or when the runner loads the
weights (safetensors files).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.checkpoint import SUPPORTED_ARCHITECTURES
from config.errors import ConfigError
from config.model_arch import SUPPORTED_ROPE_TYPES
from engine_core.resolve import resolved_config
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.registry import ARCHITECTURES
from gpu_worker.models.weights import WeightLoadError
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pristine"), "llama")


@pytest.fixture
def model_dir(pristine, tmp_path) -> Path:
    """A fresh copy of the tiny checkpoint for the test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def _load(model_dir: Path) -> ModelRunner:
    config = resolved_config(model=str(model_dir), device="cpu", kv_cache_memory="4MiB")
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def _edit_weights(model_dir: Path, edit) -> Path:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def _esc(p: Path | str) -> str:
    return re.escape(str(p))


def test_pristine_copy_loads(model_dir):
    assert _load(model_dir).model is not None


# --- config.json -------------------------------------------------------------------------


def test_missing_config_json(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(
        FileNotFoundError, match=_esc(model_dir / "config.json") + ".*no config.json"
    ):
        _load(model_dir)


def test_config_json_is_not_json(model_dir):
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError, match=_esc(model_dir / "config.json") + ": not valid JSON"):
        _load(model_dir)


def test_config_missing_required_field(model_dir):
    _edit_config(model_dir, hidden_size=None)
    with pytest.raises(
        ValueError, match=_esc(model_dir / "config.json") + ".*missing required field 'hidden_size'"
    ):
        _load(model_dir)


def test_config_without_architectures(model_dir):
    _edit_config(model_dir, architectures=None)
    with pytest.raises(ValueError, match=_esc(model_dir / "config.json") + ".*'architectures'"):
        _load(model_dir)


def test_unknown_architecture_is_named_with_the_supported_ones(model_dir):
    # Refused when the configuration resolves, before any process would start.
    _edit_config(model_dir, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(
        ConfigError, match="model model: architecture 'GPTNeoXForCausalLM' is not supported"
    ) as info:
        resolved_config(model=str(model_dir), device="cpu")
    for name in ARCHITECTURES:
        assert name in str(info.value)


def test_registry_and_configuration_list_the_same_architectures():
    assert sorted(ARCHITECTURES) == sorted(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "mxfp4"])
def test_unknown_quant_method_is_refused_at_resolve(model_dir, method):
    # mxfp4 is gpt-oss's alone; the others have no loader (gptq, awq and the fp8 formats do:
    # tests/test_quantization_config.py).
    _edit_config(model_dir, quantization_config={"quant_method": method, "bits": 4})
    refusal = "read only for GptOssForCausalLM" if method == "mxfp4" else "not supported"
    with pytest.raises(ConfigError, match=f"quant_method '{method}' is {refusal}"):
        resolved_config(model=str(model_dir), device="cpu")


@pytest.mark.parametrize(
    "kind, rope",
    [
        (
            # (yarn, longrope and dynamic are supported: tests/worker/test_rope_scaling.py)
            "proportional",
            {
                "rope_parameters": {
                    "rope_type": "proportional",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                }
            },
        ),
        (
            "mrope",
            {
                "rope_parameters": None,
                "rope_theta": 10000.0,  # the pre-v5 layout
                "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            },
        ),
    ],
)
def test_unsupported_rope_scaling_type(model_dir, kind, rope):
    _edit_config(model_dir, **rope)
    with pytest.raises(
        ValueError,
        match=_esc(model_dir / "config.json") + f".*rope scaling type '{kind}' is not supported",
    ) as info:
        _load(model_dir)
    for name in SUPPORTED_ROPE_TYPES:
        assert name in str(info.value)


# --- weights -----------------------------------------------------------------------------


def test_no_safetensors_files(model_dir):
    # Refused when the configuration resolves, naming what was found instead.
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        ConfigError, match=r"no \*\.safetensors weights in .*found pytorch_model\.bin"
    ):
        resolved_config(model=str(model_dir), device="cpu")


def _shard(model_dir: Path) -> dict[str, str]:
    """Split the checkpoint into two shards with an index; returns the weight map."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, model_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return weight_map


def test_sharded_checkpoint_loads(model_dir):
    _shard(model_dir)
    assert _load(model_dir).model is not None


def test_index_names_a_missing_shard(model_dir):
    _shard(model_dir)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    index = model_dir / "model.safetensors.index.json"
    with pytest.raises(
        WeightLoadError, match=_esc(index) + ".*model-00002-of-00002.safetensors, which is missing"
    ):
        _load(model_dir)


def test_index_is_not_valid(model_dir):
    _shard(model_dir)
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))  # no weight_map
    with pytest.raises(WeightLoadError, match=_esc(index) + ": not a valid safetensors index"):
        _load(model_dir)


def test_corrupt_safetensors_file(model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(WeightLoadError, match=_esc(path) + ": cannot read safetensors file"):
        _load(model_dir)


@pytest.mark.parametrize(
    "name, bad_shape, want_shape",
    [
        ("model.layers.0.self_attn.k_proj.weight", (16, 64), (32, 64)),  # a slice of fused qkv_proj
        (
            "model.layers.1.mlp.up_proj.weight",
            (128, 32),
            (128, 64),
        ),  # a slice of fused gate_up_proj
        ("model.embed_tokens.weight", (500, 64), (512, 64)),
        ("model.norm.weight", (32,), (64,)),
    ],
)
def test_tensor_with_wrong_shape(model_dir, name, bad_shape, want_shape):
    def edit(t):
        assert tuple(t[name].shape) == want_shape
        t[name] = torch.zeros(bad_shape)

    path = _edit_weights(model_dir, edit)
    with pytest.raises(
        WeightLoadError,
        match=_esc(path)
        + f".*{re.escape(repr(name))}.*"
        + re.escape(f"shape {bad_shape}")
        + ".*"
        + re.escape(f"expects {want_shape}"),
    ):
        _load(model_dir)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.k_proj.weight",  # one of three slices of a fused parameter
        "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight",  # untied embeddings need their own head
    ],
)
def test_checkpoint_missing_a_tensor(model_dir, name):
    path = _edit_weights(model_dir, lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=_esc(path) + ".*missing.*" + re.escape(name)):
        _load(model_dir)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.extra_proj.weight",
        "model.layers.7.self_attn.q_proj.weight",  # a layer the config does not have
        "model.layers.0.self_attn.o_proj.bias",  # attention_bias is false
    ],
)
def test_extra_unknown_tensor(model_dir, name):
    def edit(t):
        t[name] = torch.zeros(64, 64)

    path = _edit_weights(model_dir, edit)
    with pytest.raises(
        WeightLoadError,
        match=_esc(path) + f".*{re.escape(repr(name))} " + "does not belong to this model",
    ):
        _load(model_dir)


def test_rotary_inv_freq_in_checkpoint_is_ignored(model_dir):
    """Old checkpoints store rotary_emb.inv_freq buffers; they are not weights."""

    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _edit_weights(model_dir, edit)
    assert _load(model_dir).model is not None
