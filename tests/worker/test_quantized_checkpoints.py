"""GPTQ, AWQ and FP8 checkpoints of a tiny random Llama, written here with this test's own
quantizer and packing code (not the engine's), give transformers' greedy tokens for the dense
model whose weights are the dequantized ones (fp32, CPU), through the model runner and through
`engine generate`; the loader's parts dequantize exactly to those weights.

Int weights run through IntCpuLinearMethod (the C kernels), fp8 ones dequantized (the CPU's
weight-only path).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.loader import quant_methods, quantized_checkpoint
from kernels.quant_weights import IntWeight
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, make_tiny_model_with_tokenizer
from tests.worker.runner_utils import hf_causal_lm, make_runner

NEW_TOKENS = 12
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = {"a": [1, 523, 912, 77, 4051, 31, 8], "b": [1, 12000, 5, 5, 301]}
PROMPTS_SMALL_VOCAB = {"a": [1, 52, 91, 77, 405, 31, 8], "b": [1, 120, 5, 5, 301]}  # vocab 512


# --- this test's quantizer and packers -------------------------------------------------------


def rtn(w: torch.Tensor, bits: int, groups: torch.Tensor, sym: bool):
    """Round-to-nearest over w [N, K] with input k in group groups[k]: codes q [N, K], fp16
    scales s and integer zeros z [G, N] (GPTQ's layout), and W = s * (q - z) per input."""
    n, _ = w.shape
    g = int(groups.max()) + 1
    top = (1 << bits) - 1
    s = torch.empty(g, n)
    z = torch.empty(g, n)
    for j in range(g):
        cols = w[:, groups == j]
        if sym:
            s[j] = cols.abs().amax(1) / (top // 2)
            z[j] = (top + 1) // 2
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[j] = (hi - lo) / top
            z[j] = (-lo / s[j].half().float()).round().clamp(1, top)  # GPTQ v1 cannot store 0
    s = s.half().float()
    q = (w / s[groups].t() + z[groups].t()).round().clamp(0, top)
    deq = s[groups].t() * (q - z[groups].t())
    return q.to(torch.int64), s, z.to(torch.int64), deq


def pack_along_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] -> int32 [R * bits / 32, C], value r at bits * (r % per) of word r // per."""
    per = 32 // bits
    v = v.to(torch.int64).view(-1, per, v.shape[1])
    words = sum(v[:, i] << (bits * i) for i in range(per))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement wrap


def pack_along_columns(v: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """int [R, C] -> int32 [R, C * bits / 32]; slot i of word j holds column j*per + order[i]."""
    per = 32 // bits
    order = order or list(range(per))
    v = v.to(torch.int64).view(v.shape[0], -1, per)
    words = sum(v[:, :, order[i]] << (bits * i) for i in range(per))
    return (words - ((words >> 31) << 32)).to(torch.int32)


# --- checkpoint writers: (dense state dict, config) -> (tensors, quantization_config, W) -----


def gptq(bits: int, group: int, sym: bool, desc_act: bool, v2: bool = False) -> Callable:
    def write(name: str, w: torch.Tensor, tensors: dict) -> torch.Tensor:
        n, k = w.shape
        g = group if group > 0 else k
        order = torch.arange(k)
        if desc_act:
            order = torch.randperm(k, generator=torch.Generator().manual_seed(len(name) + k))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // g  # groups in processing order
        q, s, z, deq = rtn(w, bits, g_idx, sym)
        tensors[f"{name}.qweight"] = pack_along_rows(q.t(), bits)
        tensors[f"{name}.qzeros"] = pack_along_columns(z if v2 else z - 1, bits)
        tensors[f"{name}.scales"] = s.half()
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
        return deq

    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    return write, config


def awq(group: int) -> Callable:
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def write(name: str, w: torch.Tensor, tensors: dict) -> torch.Tensor:
        q, s, z, deq = rtn(w, 4, torch.arange(w.shape[1]) // group, sym=False)
        tensors[f"{name}.qweight"] = pack_along_columns(q.t(), 4, order)  # [K, N / 8]
        tensors[f"{name}.qzeros"] = pack_along_columns(z, 4, order)
        tensors[f"{name}.scales"] = s.half()
        return deq

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True}
    config["version"] = "gemm"
    return write, config


def ct_int(bits: int, group: int, actorder: str | None = None) -> Callable:
    """compressed-tensors pack-quantized, symmetric: signed codes offset by 2**(bits-1) and
    packed along K, a scale per output row and group (actorder "group": groups in a shuffled
    input order, weight_g_idx)."""

    def write(name: str, w: torch.Tensor, tensors: dict) -> torch.Tensor:
        n, k = w.shape
        g_idx = torch.arange(k) // (group if group > 0 else k)
        if actorder == "group":
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k + n))]
            tensors[f"{name}.weight_g_idx"] = g_idx.to(torch.int32)
        q, s, _, deq = rtn(w, bits, g_idx, sym=True)
        tensors[f"{name}.weight_packed"] = pack_along_columns(q, bits)  # [N, K * bits / 32]
        tensors[f"{name}.weight_scale"] = s.t().half()  # [N, groups]
        tensors[f"{name}.weight_shape"] = torch.tensor([n, k])
        return deq

    weights = {"num_bits": bits, "type": "int", "symmetric": True, "actorder": actorder}
    weights |= {"strategy": "group", "group_size": group} if group > 0 else {"strategy": "channel"}
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    return write, config


def fp8(per_channel: bool, static: bool, fmt: str = "compressed-tensors") -> Callable:
    def write(name: str, w: torch.Tensor, tensors: dict) -> torch.Tensor:
        amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().view(1)
        scale = amax / 448.0
        q = (w / scale).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale"] = scale if per_channel or fmt != "modelopt" else scale[0]
        if static:
            tensors[f"{name}.input_scale"] = torch.tensor([0.02 + 0.01 * len(name) % 3])
        return q.float() * scale

    if fmt == "fbgemm_fp8":
        return write, {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]}
    if fmt == "modelopt":
        config = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
        config["kv_cache_quant_algo"] = "FP8"
        return write, config
    acts = (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
        if static
        else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    )
    strategy = "channel" if per_channel else "tensor"
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}
    scheme["weights"] |= {"strategy": strategy, "symmetric": True, "dynamic": False}
    scheme["input_activations"] = acts
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"],
    }
    if static:
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    return write, config


CASES = {
    "gptq-sym-g32": gptq(4, 32, sym=True, desc_act=False),
    "gptq-asym-g128": gptq(4, 128, sym=False, desc_act=False),
    "gptq-asym-g32-desc-act": gptq(4, 32, sym=False, desc_act=True),
    "gptq-8bit-channel-v2": gptq(8, -1, sym=False, desc_act=False, v2=True),
    "awq-g32": awq(32),
    "ct-w4a16-g32": ct_int(4, 32),
    "ct-w8a16-channel": ct_int(8, -1),
    "ct-w4a16-g32-actorder-group": ct_int(4, 32, "group"),
    "ct-fp8-channel-dynamic": fp8(per_channel=True, static=False),
    "ct-fp8-tensor-static": fp8(per_channel=False, static=True),
    "fbgemm-fp8": fp8(per_channel=True, static=False, fmt="fbgemm_fp8"),
    "modelopt-fp8": fp8(per_channel=False, static=True, fmt="modelopt"),
}


def write_checkpoint(dense_dir: Path, out: Path, case: str) -> dict[str, torch.Tensor]:
    """The quantized checkpoint of dense_dir's model at out; returns the dequantized weights
    by checkpoint name (W of every Linear the checkpoint quantizes)."""
    write, qconfig = CASES[case]
    shutil.copytree(dense_dir, out)
    state = load_file(str(out / "model.safetensors"))
    ignore = qconfig.get("ignore", [])
    tensors: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module = key.removesuffix(".weight")
        kept = "re:.*layers\\.1\\.mlp\\.down_proj$" in ignore and module.endswith(
            "layers.1.mlp.down_proj"
        )
        if key.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS and not kept:
            deq[key] = write(module, value, tensors)
        else:
            tensors[key] = value
    if qconfig.get("kv_cache_scheme"):
        for layer in range(2):
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5 + layer)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.25)
    if qconfig.get("kv_cache_quant_algo"):  # ModelOpt names them after the projections
        for layer in range(2):
            tensors[f"model.layers.{layer}.self_attn.k_proj.k_scale"] = torch.tensor(0.5 + layer)
            tensors[f"model.layers.{layer}.self_attn.v_proj.v_scale"] = torch.tensor([0.25])
    (out / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config))
    return deq


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dense") / "llama"
    return make_tiny_model_with_tokenizer(path, initializer_range=0.2)


@pytest.fixture
def int_parts(monkeypatch) -> list[list[IntWeight]]:
    """Records the int parts the loader builds (and the methods it gives them)."""
    seen: list[list[IntWeight]] = []
    real = quant_methods.int_method

    def record(parts, device):
        seen.append(list(parts))
        return real(parts, device)

    monkeypatch.setattr(quantized_checkpoint, "int_method", record)
    monkeypatch.setattr(quant_methods, "int_method", record)
    return seen


def hf_reference(dense_dir: Path, deq: dict[str, torch.Tensor]):
    model = hf_causal_lm(dense_dir)
    state = model.state_dict()
    for name, w in deq.items():
        assert state[name].shape == w.shape
        state[name] = w
    model.load_state_dict(state)
    return model


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        seq = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return seq[0, len(ids) :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_greedy_equals_dequantized_transformers(
    dense_dir, tmp_path, case, int_parts
):
    deq = write_checkpoint(dense_dir, tmp_path / case, case)
    runner, driver = make_runner(tmp_path / case, max_model_len=64)
    assert runner.config.model.quantization == CASES[case][1]["quant_method"]
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    got = driver.run(PROMPTS, params, NEW_TOKENS)
    reference = hf_reference(dense_dir, deq)
    for req, ids in PROMPTS.items():
        assert got[req] == hf_greedy(reference, ids), (case, req)
    model = runner.model
    if case.startswith(("gptq", "awq", "ct-w")):
        # Every Linear but lm_head took int parts; each dequantizes exactly to the checkpoint's W.
        assert len(int_parts) == 2 * 4
        qkv = torch.cat([p.dequantize() for p in int_parts[0]])
        names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        torch.testing.assert_close(qkv, torch.cat([deq[n] for n in names]), rtol=0, atol=0)
        if "desc-act" in case or "actorder" in case:
            assert all(p.perm is not None for parts in int_parts for p in parts)
    else:
        assert not int_parts
        # fp8 on the CPU: the dense weights are the dequantized ones (x = I reads W^T back).
        qkv = model.model.layers[0].self_attn.qkv_proj
        w = qkv(torch.eye(qkv.in_features)).t()
        names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        torch.testing.assert_close(w, torch.cat([deq[n] for n in names]), rtol=0, atol=1e-7)
    if case in ("ct-fp8-tensor-static", "modelopt-fp8"):
        attns = model.attention_layers()
        assert [(a.k_scale, a.v_scale) for a in attns] == [(0.5, 0.25), (1.5, 0.25)]


@pytest.mark.parametrize("case", ["gptq-asym-g32-desc-act", "ct-fp8-channel-dynamic"])
def test_engine_generate_prints_dequantized_transformers_continuation(
    dense_dir, tmp_path, capsys, case, int_parts
):
    from transformers import AutoTokenizer

    from serve.cli import main

    deq = write_checkpoint(dense_dir, tmp_path / case, case)
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    prompt = "A quantized checkpoint reads as its dequantized model"
    ids = tokenizer(prompt)["input_ids"]
    tokens = hf_greedy(hf_reference(dense_dir, deq), ids)
    expected = prompt + tokenizer.decode(tokens, skip_special_tokens=True)
    argv = ["generate", prompt, "--model", str(tmp_path / case), "--max-tokens", str(NEW_TOKENS)]
    assert main([*argv, "--ignore-eos", "--device", "cpu", "--max-model-len", "64"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_fp8_quantized_at_load_equals_transformers_with_fp8_rounded_weights(dense_dir, int_parts):
    # --quantization fp8 on a dense checkpoint: every Linear but lm_head per output channel.
    runner, driver = make_runner(dense_dir, max_model_len=64, quantization="fp8")
    write, _ = fp8(per_channel=True, static=False)
    state = load_file(str(dense_dir / "model.safetensors"))
    deq = {
        key: write(key.removesuffix(".weight"), value, {})
        for key, value in state.items()
        if key.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS
    }
    got = driver.run(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True), NEW_TOKENS)
    reference = hf_reference(dense_dir, deq)
    for req, ids in PROMPTS.items():
        assert got[req] == hf_greedy(reference, ids), req
    assert not int_parts
    o_proj = runner.model.model.layers[1].self_attn.o_proj  # its W^T read back through x = I
    expected = deq["model.layers.1.self_attn.o_proj.weight"]
    torch.testing.assert_close(
        o_proj(torch.eye(o_proj.in_features)).t(), expected, rtol=0, atol=1e-7
    )
    assert not torch.equal(expected, state["model.layers.1.self_attn.o_proj.weight"])


def test_dummy_weights_quantized_at_load_for_benchmarks(dense_dir, int_parts):
    runner, driver = make_runner(
        dense_dir, max_model_len=64, quantization="gptq", load_format="dummy"
    )
    assert len(int_parts) == 2 * 4  # qkv, o, gate_up, down of each layer; lm_head stays dense
    assert {(p.bits, p.group_size) for parts in int_parts for p in parts} == {(4, 64), (4, 128)}
    got = driver.run(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True), 4)
    assert all(len(tokens) == 4 for tokens in got.values())


def test_act_order_groups_of_unequal_size_are_refused(dense_dir, tmp_path, int_parts):
    from engine_core.resolve import resolved_config
    from gpu_worker.loader.model_loader import load_model
    from gpu_worker.models.weights import WeightLoadError

    path = tmp_path / "gptq"
    write_checkpoint(dense_dir, path, "gptq-asym-g32-desc-act")
    tensors = load_file(str(path / "model.safetensors"))
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    g_idx[g_idx == 0] = 1  # group 1 gets 64 inputs, group 0 none
    save_file(tensors, str(path / "model.safetensors"))
    config = resolved_config(model=str(path), device="cpu")
    with pytest.raises(WeightLoadError, match="q_proj.*g_idx does not give each of the 2 groups"):
        load_model(path, config.arch, torch.float32, torch.device("cpu"), "auto", 0, "gptq")


def test_qwen2_gptq_with_qkv_bias_and_tied_embeddings(tmp_path, int_parts):
    # Qwen2's q/k/v biases load beside the quantized qkv; a tied lm_head stays the embedding.
    dense = make_tiny_model(tmp_path / "qwen2", "qwen2", tie_word_embeddings=True)
    state = load_file(str(dense / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for key in [k for k in state if k.endswith(".bias")]:  # transformers initializes them to 0
        state[key] = torch.randn(state[key].shape, generator=gen) * 0.5
    save_file(state, str(dense / "model.safetensors"), metadata={"format": "pt"})
    deq = write_checkpoint(dense, tmp_path / "gptq", "gptq-asym-g32-desc-act")
    runner, driver = make_runner(tmp_path / "gptq", max_model_len=64)
    got = driver.run(PROMPTS_SMALL_VOCAB, SamplingParams(temperature=0.0, ignore_eos=True), 8)
    reference = hf_reference(dense, deq)
    assert any(reference.model.layers[0].self_attn.q_proj.bias != 0)
    for req, ids in PROMPTS_SMALL_VOCAB.items():
        assert got[req] == hf_greedy(reference, ids)[:8], req
    assert len(int_parts) == 2 * 4


def test_modelopt_hf_quant_config_json_alone(dense_dir, tmp_path, int_parts):
    # ModelOpt's older exports: no quantization_config, hf_quant_config.json beside config.json.
    path = tmp_path / "modelopt"
    deq = write_checkpoint(dense_dir, path, "modelopt-fp8")
    config = json.loads((path / "config.json").read_text())
    qc = config.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(config))
    quantization = {k: v for k, v in qc.items() if k != "quant_method"}
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": quantization}))
    runner, driver = make_runner(path, max_model_len=64)
    assert runner.config.model.quantization == "modelopt"
    got = driver.run(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True), NEW_TOKENS)
    reference = hf_reference(dense_dir, deq)
    for req, ids in PROMPTS.items():
        assert got[req] == hf_greedy(reference, ids), req
