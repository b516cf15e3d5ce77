"""--speculative-config read as vLLM reads it (config/speculative.py), and its checks at
resolve time (config/engine.py)."""

from __future__ import annotations

import pytest

from config.engine import engine_config_from_kwargs
from config.errors import ConfigError
from config.speculative import SpeculativeConfig, parse_speculative_config


def test_ngram_lookup_bounds_default_as_vllm() -> None:
    both = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert both == SpeculativeConfig("ngram", 3, 5, 5)
    lo = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    )
    assert (lo.prompt_lookup_min, lo.prompt_lookup_max) == (2, 2)
    hi = parse_speculative_config(
        {"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (hi.method, hi.prompt_lookup_min, hi.prompt_lookup_max) == ("ngram", 4, 4)


@pytest.mark.parametrize(
    ("model", "method"),
    [
        ("org/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
        ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle"),
        ("/models/Llama-3.2-1B", "draft_model"),
    ],
)
def test_method_inferred_from_the_model(model: str, method: str) -> None:
    spec = parse_speculative_config({"model": model, "num_speculative_tokens": 4})
    assert spec is not None and spec.method == method and spec.model == model


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "must be a JSON object"),
        ("{}", "give a method"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "is not one of"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 2}', "ngram's"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "unknown key 'foo'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}',
            "disable_by_batch_size is not supported",
        ),
    ],
)
def test_refusals_name_the_problem(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config(value)


def test_engine_config_carries_it_and_survives_encoding() -> None:
    from config.engine import decode_config

    config = engine_config_from_kwargs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    )
    assert config.speculative == SpeculativeConfig("ngram", 3, 5, 5)
    assert decode_config(config.encode()).speculative == config.speculative


def test_speculation_schedules_synchronously(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    config = engine_config_from_kwargs(speculative_config=spec, device="cpu")
    config.resolve(lambda: True)
    assert config.scheduler.async_scheduling is False
    asked = engine_config_from_kwargs(speculative_config=spec, async_scheduling=True)
    with pytest.raises(ConfigError, match="drop --async-scheduling"):
        asked.resolve(lambda: True)
    tp = engine_config_from_kwargs(speculative_config={**spec}, tensor_parallel_size=1)
    tp.speculative.draft_tensor_parallel_size = 2  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size 2"):
        tp.resolve(lambda: True)
