"""The attention-backend contract (gpu_worker/attention/backend.py) and the capability table
(config/attention.py) agree: each backend class points to its own entry, and a configuration
that needs a capability no backend has is refused at resolve time, naming backend and reason."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from config.attention import (
    ATTENTION_BACKENDS,
    AttentionFeatures,
    AttentionSupport,
    attention_backends_for,
)
from config.errors import ConfigError
from config.model_arch import ModelArchConfig
from engine_core.resolve import resolved_config
from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.select import attention_backend, backend_class
from tests.tiny_models import make_tiny_model

ENTRIES = [(device, s) for device, table in ATTENTION_BACKENDS.items() for s in table]
ENTRY_IDS = [f"{device}-{support.backend}" for device, support in ENTRIES]


@pytest.mark.parametrize(("device_type", "support"), ENTRIES, ids=ENTRY_IDS)
def test_each_backend_points_to_its_table_entry(device_type, support):
    cls = backend_class(support.backend)
    assert issubclass(cls, AttentionBackend)
    assert cls.name == support.backend
    assert cls.support is support


def test_every_backend_class_is_in_the_table():
    for _, support in ENTRIES:
        backend_class(support.backend)  # imports each backend module
    named = {s.backend for _, s in ENTRIES}
    assert {cls.name for cls in AttentionBackend.__subclasses__()} == named


def test_no_backend_claims_a_feature_it_does_not_implement():
    for _, support in ENTRIES:
        # Soft-capping: every per-head backend (tests/kernels/test_attention_softcap.py).
        assert support.logits_soft_cap == (not support.mla)
        # An fp8 cache: every per-head backend (tests/kernels/test_kv_cache_fp8.py), no MLA one.
        assert support.kv_cache_dtypes == (("auto",) if support.mla else ("auto", "fp8"))
        # MLA: the latent-cache backend alone (tests/worker/test_deepseek.py).
        assert support.mla == support.backend.startswith("mla_")


@pytest.mark.parametrize(
    ("features", "words", "backends"),
    [
        (
            AttentionFeatures(mla=True, logits_soft_cap=True),
            "attention logits soft-capping",
            {"cpu": ("mla_torch",), "cuda": "mla_triton"},
        ),
        (
            AttentionFeatures(mla=True, logits_soft_cap=True),
            "a latent (MLA) KV cache",
            {"cpu": ("cpu", "torch"), "cuda": "triton"},
        ),
    ],
)
def test_a_feature_no_backend_runs_is_refused_naming_each_backend(features, words, backends):
    with pytest.raises(ConfigError) as refused:
        attention_backends_for("cpu", 16, 64, "float32", features)
    for backend in backends["cpu"]:
        assert f"{words} is not supported by the {backend} attention kernels on cpu" in str(
            refused.value
        )
    cuda = backends["cuda"]
    with pytest.raises(ConfigError, match=re.escape(f"{words} is not supported by the {cuda} ")):
        attention_backends_for("cuda", 16, 128, "bfloat16", features)
    with pytest.raises(ConfigError, match=re.escape(words)):
        attention_backend(torch.device("cpu"), torch.float32, 64, 16, features)


def test_a_kv_cache_dtype_no_backend_keeps_is_refused_naming_the_kept_ones():
    fp8 = AttentionFeatures(kv_cache_dtype="fp8")
    assert attention_backends_for("cuda", 16, 128, "bfloat16", fp8) == ["triton"]
    assert attention_backends_for("cpu", 16, 64, "float32", fp8) == ["cpu", "torch"]
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "kv_cache_dtype fp8 is not supported by the mla_triton attention kernels on cuda, "
            "which take kv_cache_dtype auto"
        ),
    ):
        attention_backends_for("cuda", 16, 128, "bfloat16", replace(fp8, mla=True))


def _arch(**fields) -> ModelArchConfig:
    base = dict(
        architectures=["MistralForCausalLM"],
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=512,
    )
    return ModelArchConfig.from_dict({**base, **fields})


def test_the_sliding_window_is_read_where_the_config_turns_it_on():
    assert _arch().sliding_window is None
    assert _arch(sliding_window=4096).sliding_window == 4096  # Mistral: on when given
    # Mistral ignores use_sliding_window, as transformers does; Qwen2 reads it, then windows
    # the layers from max_window_layers on.
    assert _arch(sliding_window=4096, use_sliding_window=False).sliding_window == 4096
    qwen2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=4096)
    assert _arch(**qwen2, use_sliding_window=False).sliding_window is None
    assert _arch(**qwen2, use_sliding_window=True, max_window_layers=0).sliding_window == 4096
    assert _arch(**qwen2, use_sliding_window=True, max_window_layers=2).sliding_window is None
    full = ["full_attention", "full_attention"]
    assert _arch(sliding_window=4096, layer_types=full).sliding_window is None
    mixed = ["sliding_attention", "full_attention"]
    assert _arch(sliding_window=4096, layer_types=mixed).sliding_window == 4096


def test_a_window_matters_only_where_a_sequence_outgrows_it():
    arch = _arch(sliding_window=64)
    assert AttentionFeatures.of(arch, 64) == AttentionFeatures()
    assert AttentionFeatures.of(arch, 65) == AttentionFeatures(sliding_window=True)


def test_a_window_shorter_than_max_model_len_runs_where_the_backends_run_windows(tmp_path):
    model = make_tiny_model(tmp_path / "mistral", "mistral", sliding_window=64)
    config = resolved_config(model=str(model), device="cpu")
    assert config.arch is not None and config.arch.sliding_window == 64


def test_a_window_no_backend_runs_is_refused_unless_max_model_len_is_within_it(
    tmp_path, monkeypatch
):
    """The refusal path stays for a backend whose support lacks windows."""
    monkeypatch.setitem(ATTENTION_BACKENDS, "cpu", (AttentionSupport("torch"),))
    model = make_tiny_model(tmp_path / "mistral", "mistral", sliding_window=64)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "sliding-window attention is not supported by the torch attention kernels on cpu; "
            "a max_model_len within the model's sliding window needs none"
        ),
    ):
        resolved_config(model=str(model), device="cpu")
    config = resolved_config(model=str(model), device="cpu", max_model_len=64)
    assert config.arch is not None and config.arch.sliding_window == 64


def _qwen2_with_window(path, **window_keys):
    """A tiny Qwen2 whose config.json is written the way Qwen2.5's is: a sliding_window with or
    without use_sliding_window, and no layer_types."""
    model = make_tiny_model(path, "qwen2")
    config_path = model / "config.json"
    cfg = json.loads(config_path.read_text())
    for key in ("use_sliding_window", "layer_types", "max_window_layers"):
        cfg.pop(key, None)
    config_path.write_text(json.dumps({**cfg, "sliding_window": 64, **window_keys}))
    return model


def test_a_qwen2_window_without_use_sliding_window_is_off(tmp_path):
    model = _qwen2_with_window(tmp_path / "qwen2")
    config = resolved_config(model=str(model), device="cpu")
    assert config.arch is not None and config.arch.sliding_window is None


def test_a_qwen2_window_turned_on_slides_the_layers_from_max_window_layers(tmp_path):
    model = _qwen2_with_window(tmp_path / "qwen2", use_sliding_window=True, max_window_layers=1)
    config = resolved_config(model=str(model), device="cpu")
    arch = config.arch
    assert arch is not None and arch.sliding_window == 64
    assert [arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)] == [None, 64]


def test_qwen2_layers_below_max_window_layers_attend_to_the_whole_context(tmp_path):
    model = _qwen2_with_window(tmp_path / "qwen2", use_sliding_window=True)  # 28 full layers
    config = resolved_config(model=str(model), device="cpu")
    assert config.arch is not None and config.arch.sliding_window is None


def test_a_phi3_mini_head_size_selects_triton_on_cuda(tmp_path):
    """Phi-3-mini's head_dim 96 (3072 over 32 heads): the Triton kernels pad it to 128 lanes,
    so CUDA takes it (configuration only: nothing is loaded on a GPU)."""
    model = make_tiny_model(
        tmp_path / "phi3",
        "phi3",
        hidden_size=192,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    config = resolved_config(model=str(model), device="cuda", dtype="bfloat16")
    assert config.arch is not None and config.arch.head_dim == 96
    block_size = config.cache.block_size
    assert attention_backends_for("cuda", block_size, 96, "bfloat16") == ["triton"]
    cuda = torch.device("cuda")  # only named: nothing is allocated on it
    assert attention_backend(cuda, torch.bfloat16, 96, block_size).name == "triton"
