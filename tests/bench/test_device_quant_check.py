"""scripts/device_quant_check.py on the CPU: the quantized model against its dequantized self
agrees, and the comparison catches a reference that is not dequantized."""

from __future__ import annotations

import json

import pytest

from scripts import device_quant_check


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(device_quant_check.CONFIG))
    return tmp_path


def test_gptq_on_the_cpu_equals_its_dequantized_model(model_dir):
    case = device_quant_check.check_case(model_dir, "cpu", "float32", "gptq")
    assert case["methods"] == ["IntCpuLinearMethod"]
    assert "IntCpuLinearMethod" not in case["reference_methods"]
    assert case["tokens_equal"] and case["steps_compared"] == case["steps"] == 64
    assert case["max_logprob_diff"] <= 2e-3 and case["ok"]


def test_a_reference_that_is_not_dequantized_fails_the_check(model_dir, monkeypatch):
    monkeypatch.setattr(device_quant_check, "dequantized_linears", lambda model, scheme: 0)
    case = device_quant_check.check_case(model_dir, "cpu", "float32", "awq")
    assert not case["ok"] and case["max_logprob_diff"] > 0.1
