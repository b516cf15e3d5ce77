"""The packed-weights cache of GGUF models (gpu_worker/loader/packed_cache.py): a second load
maps what the first packed and holds the same weights; a changed file or packing code is packed
again (and its older version removed); small models are not kept; an unreadable cache is packed
again, not an error."""

from __future__ import annotations

import json
import os

import pytest
import torch

from config.gguf_convert import GGUF_LINK
from config.model_arch import ModelArchConfig
from gpu_worker.layers.linear import Linear
from gpu_worker.layers.quant_linear import GGUFLinearMethod
from gpu_worker.loader import gguf_weights, packed_cache
from gpu_worker.loader.model_loader import load_model
from gpu_worker.loader.packed_cache import cache_file
from kernels import cpu_binding
from tests.tiny_models import make_tiny_model
from tests.worker.test_gguf_quant import write_gguf

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")

CPU = torch.device("cpu")


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(packed_cache, "MIN_CACHED_BYTES", 0)  # the tiny model is kept too
    model_dir = make_tiny_model(
        tmp_path / "tiny",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    (model_dir / GGUF_LINK).symlink_to(write_gguf(tmp_path / "tiny.gguf", layers))
    return model_dir


def _load(model_dir):
    return load_model(
        model_dir, ModelArchConfig.from_model_dir(model_dir), torch.float32, CPU, "gguf"
    )


def _packed(model) -> dict[str, list[tuple]]:
    return {
        name: [(p.qtype, p.out_features, p.data) for p in m.method.parts]
        for name, m in model.named_modules()
        if isinstance(m, Linear) and isinstance(m.method, GGUFLinearMethod)
    }


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        len(a[n]) == len(b[n])
        and all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a[n], b[n]))
        for n in a
    )


def _no_packing(monkeypatch):
    def refuse(*args):
        raise AssertionError("packed again although the cache holds it")

    monkeypatch.setattr(gguf_weights, "pack", refuse)


def test_second_load_maps_what_the_first_packed(model_dir, monkeypatch):
    first = _packed(_load(model_dir))
    stored = cache_file(model_dir / GGUF_LINK)
    assert stored.is_file()
    _no_packing(monkeypatch)
    second = _load(model_dir)
    assert _same(first, _packed(second))
    x = torch.randn(3, 256)
    layer = second.model.layers[0].self_attn.o_proj
    torch.testing.assert_close(layer(x), x @ layer.method.dequantize().T, rtol=1e-5, atol=1e-4)


def test_changed_file_or_code_is_packed_again(model_dir, monkeypatch):
    first = _packed(_load(model_dir))
    old = cache_file(model_dir / GGUF_LINK)
    gguf = (model_dir / GGUF_LINK).resolve()
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    new = cache_file(model_dir / GGUF_LINK)
    assert new != old
    assert _same(first, _packed(_load(model_dir)))
    assert new.is_file() and not old.exists()
    # The packing code is part of the key.
    monkeypatch.setattr(packed_cache, "_PACKING_SOURCES", (model_dir / "config.json",))
    assert cache_file(model_dir / GGUF_LINK) != new


def test_small_models_are_not_kept(model_dir, monkeypatch):
    monkeypatch.setattr(packed_cache, "MIN_CACHED_BYTES", 2**30)
    _load(model_dir)
    assert not cache_file(model_dir / GGUF_LINK).parent.exists()


def test_unreadable_cache_is_packed_again(model_dir, caplog):
    first = _packed(_load(model_dir))
    stored = cache_file(model_dir / GGUF_LINK)
    stored.write_bytes(b"not safetensors")
    assert _same(first, _packed(_load(model_dir)))
    assert "ignoring the packed weights" in caplog.text
    assert stored.stat().st_size > 100  # written again, whole
