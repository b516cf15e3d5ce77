"""A draft model (--speculative-config's draft_model) checked against the target when the
configuration resolves (config/draft_model.py): each refusal one line, before any process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.draft_model import draft_load
from config.errors import ConfigError
from engine_core.resolve import resolved_config
from kernels import cpu_library
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"))


def resolve(target: Path, draft: Path | str, **engine_args):
    return resolved_config(
        model=str(target),
        device="cpu",
        kv_cache_memory="4MiB",
        speculative_config={"model": str(draft), "num_speculative_tokens": 2},
        **engine_args,
    )


def refusal(target: Path, draft: Path | str, **engine_args) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(target, draft, **engine_args)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_draft_of_the_same_vocabulary_resolves(target, tmp_path) -> None:
    draft = make_tiny_model(tmp_path / "draft", num_hidden_layers=1)
    config = resolve(target, draft)
    assert config.speculative is not None and config.speculative.model_path == str(draft)
    assert draft_load(config, cpu_library.available) == ("auto", None)
    dummy = resolve(target, draft, load_format="dummy")
    assert draft_load(dummy, cpu_library.available) == ("dummy", None)


def test_another_vocabulary_is_refused(target, tmp_path) -> None:
    draft = make_tiny_model(tmp_path / "draft", vocab_size=256)
    assert refusal(target, draft) == (
        "speculative_config: the draft model must share the target's tokenizer/vocabulary: "
        f"256 vs 512 (vocab_size of the draft {draft} vs the target's)"
    )


def test_an_unsupported_architecture_is_refused(target, tmp_path) -> None:
    draft = make_tiny_model(tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (draft / "config.json").write_text(json.dumps(cfg))
    assert "architecture 'GPT2LMHeadModel' is not supported" in refusal(target, draft)


def test_a_folder_without_config_is_refused(target, tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    message = refusal(target, tmp_path / "empty")
    assert message.startswith("speculative_config: draft model ") and "no config.json" in message


def test_heads_tensor_parallelism_cannot_split(target, tmp_path) -> None:
    draft = make_tiny_model(
        tmp_path / "draft", hidden_size=48, num_attention_heads=3, num_key_value_heads=3
    )
    message = refusal(target, draft, tensor_parallel_size=2)
    assert "tensor_parallel_size 2 must divide its attention heads (3)" in message


def test_a_shorter_context_is_refused(target, tmp_path) -> None:
    draft = make_tiny_model(tmp_path / "draft", max_position_embeddings=128)
    assert "max_model_len 512 exceeds the draft's context of 128 tokens" in refusal(target, draft)
    resolve(target, draft, max_model_len=128)


def test_full_attention_behind_the_targets_freed_window_is_refused(tmp_path) -> None:
    target = make_tiny_model(tmp_path / "target", "mistral", sliding_window=64)
    draft = make_tiny_model(tmp_path / "draft", num_hidden_layers=1)
    message = refusal(target, draft)
    assert "its layer 0 attends to the whole context, beyond the target's sliding window" in message
    windowed = make_tiny_model(tmp_path / "windowed", "mistral", sliding_window=32)
    resolve(target, windowed)


@pytest.mark.skipif(not cpu_library.available(), reason="the C CPU kernels do not build here")
def test_the_default_gguf_model_drafts_with_its_gguf_weights() -> None:
    from config.default_model import DEFAULT_MODEL

    config = resolved_config(
        device="cpu",
        kv_cache_memory="64MiB",
        speculative_config={"model": DEFAULT_MODEL, "num_speculative_tokens": 2},
    )
    assert draft_load(config, cpu_library.available) == ("gguf", "gguf")
