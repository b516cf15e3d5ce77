"""`engine bench device` on a mixture of experts: the small-moe shape on the CPU (the code path the
qwen3-30b-a3b shape takes on a GPU), and the arithmetic of the bytes a step reads."""

from __future__ import annotations

import json

import pytest

from bench.device_shapes import SHAPES, model_config
from bench.moe_bytes import MoELayerShape, moe_step_bytes
from config.model_arch import ModelArchConfig
from serve.cli import main


def test_small_moe_shape_counts_the_experts_each_step_reads(capsys):
    argv = ["--device", "cpu", "--shape", "small-moe", "--batch-sizes", "1,4"]
    argv += ["--context-len", "16", "--output-len", "5", "--quick"]
    assert main(["bench", "device", *argv]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["shape"], result["weight_bytes_per_step"]) == ("small-moe", None)
    moe = result["moe"]
    # 2 layers of 16 experts (gate, up [256, 256], down [256, 256]) in fp32, top-2.
    expert = 3 * 256 * 256 * 4
    assert moe == {
        "moe_layers": 2,
        "experts": 16,
        "top_k": 2,
        "bytes_per_expert": expert,
        # Per layer qkv, o, q/k norms, two norms, router; the final norm and the output
        # projection (the embedding table is not read, one row per request aside).
        "other_weight_bytes": 4
        * (
            2 * (256 * (256 + 2 * 128) + 256 * 256 + 2 * 64 + 2 * 256 + 16 * 256)
            + 256
            + 32000 * 256
        ),
        "all_experts_bytes": 2 * 16 * expert,
    }
    # --quick: one engine, async scheduling on (no graphs on the CPU), no offline-mixed.
    assert [(r["batch_size"], r["async_scheduling"]) for r in result["runs"]] == [
        (1, True),
        (4, True),
    ]
    assert result["offline_mixed"] == []
    one, four = result["runs"]
    # Counted from the routing: one token reads exactly its top-2; four read 2..8 of 16.
    assert one["experts_hit_from"] == four["experts_hit_from"] == "routing"
    assert one["experts_hit_per_layer"] == 2.0
    assert 2.0 <= four["experts_hit_per_layer"] <= 8.0
    for run in result["runs"]:
        hit = run["experts_hit_per_layer"]
        assert run["weight_bytes_per_step"] == pytest.approx(
            moe["other_weight_bytes"] + 2 * hit * expert, rel=1e-3
        )
        assert run["bytes_per_step"] == run["weight_bytes_per_step"] + run["kv_bytes_per_step"]
        assert run["steps_timed"] == 3 and 0 < run["fraction_of_bandwidth_limit"] < 20


def test_expected_experts_under_uniform_routing():
    layer = MoELayerShape(num_experts=128, top_k=8, bytes_per_expert=1)
    assert layer.expected_hit(1) == pytest.approx(8.0)
    # 64 tokens of top-8 of 128: 128 * (1 - (120/128)^64) = 125.9 (nearly every expert).
    assert layer.expected_hit(64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    assert 125.9 < layer.expected_hit(64) < 126


def test_qwen3_30b_a3b_shape_bytes():
    """The GPU shape's arithmetic, from the model built on the meta device (no memory)."""
    arch = ModelArchConfig.from_dict(model_config("qwen3-30b-a3b"))
    assert arch.architecture == "Qwen3MoeForCausalLM"
    moe = moe_step_bytes(arch, 2)
    assert moe is not None and len(moe.layers) == 48
    assert {(m.num_experts, m.top_k) for m in moe.layers} == {(128, 8)}
    assert moe.layers[0].bytes_per_expert == 3 * 2048 * 768 * 2
    # 30.5B parameters: 48 x 128 experts, and the rest (attention, routers, norms, embedding
    # and output projection) around 1.3B + 0.3B.
    total = moe.all_experts_bytes + moe.other_bytes + 151936 * 2048 * 2
    assert 30.0e9 < total / 2 < 31.0e9
    # Batch 1 reads 8 experts a layer: about 3.3B parameters (the "A3B"), 6.6 GB in bf16.
    assert 6.0e9 < moe.weight_bytes([8.0] * 48) < 7.0e9
    assert SHAPES["qwen3-30b-a3b"]["torch_dtype"] == "bfloat16"


def test_dense_shape_has_no_moe_bytes():
    assert moe_step_bytes(ModelArchConfig.from_dict(model_config("small")), 4) is None


def test_small_moe_flops_count_the_routed_experts():
    """offline-mixed's matmul FLOPs on the small MoE: a token runs 2 of 16 experts a layer."""
    from bench.moe_model import SMALL_MOE
    from bench.offline import _flops_per_token

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **SMALL_MOE}
    arch = ModelArchConfig.from_dict({**cfg, "vocab_size": 49152})
    prompt, sampled = _flops_per_token(arch)
    h = 512
    # Per layer: q (512) + k, v (128 each) + o; q/k norms, two norms; router; 2 experts of
    # 3 x 512 x 512. Plus the final norm.
    per_layer = h * (512 + 256) + 512 * h + 2 * 64 + 2 * h + 16 * h + 2 * 3 * h * 512
    assert prompt == 2 * (4 * per_layer + h)
    assert sampled == prompt + 2 * h * 49152


def test_small_moe_refuses_a_model(capsys):
    assert main(["bench", "throughput", "--small-moe", "--model", "x", "--no-hf"]) != 0
    assert "--small-moe runs its own model: leave out --model" in capsys.readouterr().err
