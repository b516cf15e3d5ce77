"""Models named as on the Hugging Face Hub (config/hub.py): tiny random models placed in a
Hugging Face cache layout in tmp_path load offline by their id (HF_HUB_CACHE, HF_HOME,
--download-dir), --revision picks a ref, and what is absent is refused in one line. No test
reaches the real Hub: the online branch runs against a closed local port."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from config.default_model import resolve_model_path
from config.errors import ConfigError
from config.hub import HubOptions, parse_hub_id
from tests.tiny_models import make_tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parent.parent
REPO = "tiny-org/tiny-llama"
PROMPT = "The capital of France is"
SMALL = ["--device", "cpu", "--kv-cache-memory-bytes", "8MiB"]  # the CPU's 2 GiB takes seconds


def place_in_cache(cache: Path, repo_id: str, folder: Path, ref: str = "main") -> Path:
    """folder's files as huggingface_hub's cache holds a download of repo_id at ref: content-
    addressed blobs, snapshots/<commit>/ of relative links to them, refs/<ref> naming the commit.
    Returns the snapshot folder."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files) + ref.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny llamas with the default model's tokenizer: 'main' (2 layers) and 'v2' (1)."""
    root = tmp_path_factory.mktemp("hub-models")
    return {
        "main": make_tiny_model_with_tokenizer(root / "main"),
        "v2": make_tiny_model_with_tokenizer(root / "v2", num_hidden_layers=1),
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Path:
    """An HF_HOME whose hub/ cache holds REPO at refs main and v2."""
    home = tmp_path_factory.mktemp("hf-home")
    for ref, folder in models.items():
        place_in_cache(home / "hub", REPO, folder, ref)
    return home / "hub"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_layout_is_the_one_huggingface_hub_scans(cache: Path) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO
    assert {ref for rev in repo.revisions for ref in rev.refs} == {"main", "v2"}


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("Qwen/Qwen3-8B", ("Qwen/Qwen3-8B", None)),
        ("gpt2", ("gpt2", None)),
        ("unsloth/Qwen3-8B-GGUF:Q4_K_M", ("unsloth/Qwen3-8B-GGUF", "Q4_K_M")),
        ("/abs/model", None),
        ("./rel", None),
        ("~/model", None),
        ("a/b/c", None),
    ],
)
def test_hub_ids_and_paths(name: str, parsed: tuple[str, str | None] | None) -> None:
    assert parse_hub_id(name) == parsed


def test_an_existing_folder_is_never_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("org/name") is None
    assert resolve_model_path("org/name") == Path("org/name")


def test_revision_picks_the_named_ref(cache: Path) -> None:
    from engine_core.resolve import resolved_config

    main = resolve_model_path(REPO, HubOptions(download_dir=str(cache)))
    v2 = resolve_model_path(REPO, HubOptions(revision="v2", download_dir=str(cache)))
    assert main != v2 and main.parent == v2.parent
    assert json.loads((v2 / "config.json").read_text())["num_hidden_layers"] == 1
    by_commit = resolve_model_path(REPO, HubOptions(revision=v2.name, download_dir=str(cache)))
    assert by_commit == v2
    config = resolved_config(
        model=REPO, revision="v2", download_dir=str(cache), device="cpu", load_format="dummy"
    )
    assert config.arch is not None and config.arch.num_hidden_layers == 1
    assert config.model_path == config.tokenizer_path == str(v2)
    assert config.model.served_model_names == [REPO]


def test_tokenizer_revision_and_a_hub_tokenizer(cache: Path, models: dict[str, Path]) -> None:
    from engine_core.resolve import resolved_config

    common = dict(download_dir=str(cache), device="cpu", load_format="dummy")
    config = resolved_config(model=REPO, tokenizer_revision="v2", **common)
    assert Path(config.model_path).name != Path(config.tokenizer_path).name
    assert (Path(config.tokenizer_path) / "tokenizer.json").is_file()
    local = resolved_config(model=str(models["main"]), tokenizer=REPO, revision="v2", **common)
    assert local.model_path == str(models["main"])
    assert Path(local.tokenizer_path) == resolve_model_path(
        REPO, HubOptions(revision="v2", download_dir=str(cache))
    )


def _generate(argv: list[str], env: dict[str, str] | None = None) -> str:
    """`engine generate` in its own process (huggingface_hub reads HF_HOME and HF_HUB_CACHE when
    imported); its stdout."""
    cmd = [sys.executable, "-m", "serve.cli", "generate", PROMPT, "--max-tokens", "8"]
    run_env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE")}
    run_env.update(HF_HUB_OFFLINE="1", **(env or {}))
    done = subprocess.run(
        cmd + argv, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_generate_by_hub_id_gives_the_folders_tokens(
    cache: Path, models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from serve.cli import main

    common = ["generate", PROMPT, "--max-tokens", "8", *SMALL]
    assert main([*common, "--model", str(models["main"])]) == 0
    by_folder = capsys.readouterr().out
    assert main([*common, "--model", REPO, "--download-dir", str(cache)]) == 0
    assert capsys.readouterr().out == by_folder
    assert by_folder.startswith(PROMPT) and len(by_folder) > len(PROMPT) + 1
    cpu = ["--model", REPO, *SMALL]
    assert _generate(cpu, {"HF_HUB_CACHE": str(cache)}) == by_folder
    assert _generate(cpu, {"HF_HOME": str(cache.parent)}) == by_folder


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from serve.cli import main

    code = main(["generate", PROMPT, "--device", "cpu", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    return err[0]


def test_a_repository_absent_from_the_cache_is_refused_in_one_line(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refusal(["--model", "tiny-org/absent", "--download-dir", str(cache)], capsys)
    assert line.startswith("engine: error: model tiny-org/absent (revision main) cannot be ")
    for part in (str(cache.resolve()), "config.json", "*.safetensors", "HF_HUB_OFFLINE is set"):
        assert part in line
    line = _refusal(["--model", REPO, "--revision", "v9", "--download-dir", str(cache)], capsys)
    cached = f"cannot be loaded from the Hugging Face cache {cache.resolve()}: no snapshot"
    assert f"model {REPO} (revision v9) {cached}" in line


def test_a_snapshot_without_its_weights_is_refused_in_one_line(
    tmp_path: Path, models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(models["main"], partial, ignore=shutil.ignore_patterns("*.safetensors"))
    snapshot = place_in_cache(tmp_path / "hub", "tiny-org/partial", partial)
    line = _refusal(
        ["--model", "tiny-org/partial", "--download-dir", str(tmp_path / "hub")], capsys
    )
    assert f"snapshot {snapshot.resolve()} lacks *.safetensors" in line
    assert "HF_HUB_OFFLINE is set" in line and str((tmp_path / "hub").resolve()) in line


def test_every_shard_of_the_index_is_required(tmp_path: Path, models: dict[str, Path]) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(models["main"], sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    place_in_cache(tmp_path / "hub", "tiny-org/sharded", sharded)
    with pytest.raises(ConfigError, match=r"lacks model-00002-of-00002\.safetensors;"):
        resolve_model_path("tiny-org/sharded", HubOptions(download_dir=str(tmp_path / "hub")))
    (sharded / "model.safetensors.index.json").unlink()
    place_in_cache(tmp_path / "hub2", "tiny-org/sharded", sharded)
    with pytest.raises(ConfigError, match=r"lacks model\.safetensors\.index\.json;"):
        resolve_model_path("tiny-org/sharded", HubOptions(download_dir=str(tmp_path / "hub2")))


def test_load_format_dummy_needs_no_weights(tmp_path: Path, models: dict[str, Path]) -> None:
    from engine_core.resolve import resolved_config

    bare = tmp_path / "bare"
    shutil.copytree(models["main"], bare, ignore=shutil.ignore_patterns("*.safetensors"))
    snapshot = place_in_cache(tmp_path / "hub", "tiny-org/bare", bare)
    config = resolved_config(
        model="tiny-org/bare", download_dir=str(tmp_path / "hub"), device="cpu", load_format="dummy"
    )
    assert config.model_path == str(snapshot.resolve())


_ONLINE = """
import sys, time
from config.default_model import resolve_model_path
from config.errors import ConfigError
from config.hub import HubOptions
began = time.monotonic()
try:
    print(resolve_model_path(sys.argv[1], HubOptions(download_dir=sys.argv[2])))
except ConfigError as e:
    print("refused:", e)
print(time.monotonic() - began)
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("repo", [REPO, "tiny-org/absent"])
def test_online_without_a_reachable_hub(cache: Path, repo: str) -> None:
    """HF_HUB_OFFLINE unset and the Hub unreachable: a cached model still loads (huggingface_hub
    falls back to the cache), an absent one is refused at once, saying the Hub is unreachable."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    done = subprocess.run(
        [sys.executable, "-c", _ONLINE, repo, str(cache)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result, seconds = done.stdout.strip().splitlines()
    assert float(seconds) < 20
    if repo == REPO:
        assert Path(result) == resolve_model_path(REPO, HubOptions(download_dir=str(cache)))
    else:
        assert result.startswith(f"refused: model {repo} (revision main) cannot be loaded from")
        assert "the Hub is unreachable (ConnectError" in result
        assert "HF_HUB_OFFLINE" not in result


def _byte_level_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order: a byte-level BPE vocabulary with no
    merges (token i is byte i)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A one-layer random llama as llama.cpp writes it (float32 tensors, a byte-level gpt2
    tokenizer in the metadata), small enough to convert in seconds."""
    import gguf
    import numpy as np

    tokens = [*_byte_level_tokens(), "Ġt", "<|endoftext|>"]
    vocab, hidden, inter, kv = len(tokens), 64, 128, 32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 1) + [3])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 1)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    shapes = {
        "token_embd": (vocab, hidden),
        "blk.0.attn_q": (hidden, hidden),
        "blk.0.attn_k": (kv, hidden),
        "blk.0.attn_v": (kv, hidden),
        "blk.0.attn_output": (hidden, hidden),
        "blk.0.ffn_gate": (inter, hidden),
        "blk.0.ffn_up": (inter, hidden),
        "blk.0.ffn_down": (hidden, inter),
    }
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.normal(0, 0.5, shape).astype(np.float32))
    for norm in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{norm}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_REPO = "tiny-org/tiny-llama-GGUF"


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Hugging Face cache holding GGUF_REPO, the F32 file as a local path). The repo also
    holds a look-alike pair for Q8_0, Q4_K_M (not Q4_K) and a split Q2_K (never read)."""
    root = tmp_path_factory.mktemp("gguf-hub")
    local = write_tiny_gguf(root / "tiny-F32.gguf")
    repo = root / "repo"
    (repo / "Q2_K").mkdir(parents=True)
    shutil.copy(local, repo / "tiny-llama-F32.gguf")
    for name in ("tiny-llama-Q8_0.gguf", "tiny-llama-UD-Q8_0.gguf", "tiny-llama-Q4_K_M.gguf"):
        (repo / name).write_bytes(b"GGUF look-alike " + name.encode())
    (repo / "Q2_K" / "tiny-llama-Q2_K-00001-of-00002.gguf").write_bytes(b"part 1")
    (repo / "README.md").write_text("tiny")
    place_in_cache(root / "hub", GGUF_REPO, repo)
    return root / "hub", local


@pytest.mark.parametrize(
    ("quant", "refusal"),
    [
        ("Q4_K", r"no \.gguf file in the cache .* has Q4_K in its name \(\.gguf files: .*"),
        ("Q8_0", r"several \.gguf files in the cache .* match Q8_0: .*UD-Q8_0\.gguf"),
        ("Q2_K", r"one part of a split GGUF file"),
    ],
)
def test_a_gguf_quantization_names_one_whole_file(
    gguf_cache: tuple[Path, Path], quant: str, refusal: str
) -> None:
    from config.hub import gguf_file

    hub, _ = gguf_cache
    with pytest.raises(ConfigError, match=refusal):
        gguf_file(GGUF_REPO, quant, HubOptions(download_dir=str(hub)))


def test_a_hub_gguf_file_runs_as_the_same_file_by_path(
    gguf_cache: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """org/name:QUANT (any case) takes the cached file through the existing GGUF conversion:
    the same tokens as the file named by its path."""
    from config.hub import gguf_file
    from serve.cli import main

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "engine-cache"))
    hub, local = gguf_cache
    picked = gguf_file(GGUF_REPO, "f32", HubOptions(download_dir=str(hub)))
    assert picked.name == "tiny-llama-F32.gguf" and picked.read_bytes() == local.read_bytes()
    common = ["generate", "the cat", "--max-tokens", "8", *SMALL]
    assert main([*common, "--model", str(local)]) == 0
    by_path = capsys.readouterr().out
    hub_args = ["--model", f"{GGUF_REPO}:F32", "--download-dir", str(hub)]
    assert main([*common, *hub_args]) == 0
    assert capsys.readouterr().out == by_path and len(by_path) > len("the cat\n")
    converted = resolve_model_path(f"{GGUF_REPO}:F32", HubOptions(download_dir=str(hub)))
    assert (converted / "model.gguf").resolve() == picked.resolve()
    assert converted.parent == tmp_path / "engine-cache" / "models"


def test_messages_name_a_hub_model_by_its_id(tmp_path: Path, models: dict[str, Path]) -> None:
    """Not by its snapshot folder, which is a commit hash."""
    from engine_core.resolve import resolved_config

    other = tmp_path / "other"
    shutil.copytree(models["main"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    place_in_cache(tmp_path / "hub", "tiny-org/other", other)
    with pytest.raises(ConfigError, match=r"^model tiny-org/other: architecture 'FooForCausalLM'"):
        resolved_config(model="tiny-org/other", download_dir=str(tmp_path / "hub"), device="cpu")


def test_the_token_is_read_and_not_passed_on(cache: Path) -> None:
    """--hf-token as vLLM reads it (a value, or alone: the saved login); the resolved
    configuration, which travels on the child processes' command lines, no longer holds it."""
    from config.args import engine_kwargs
    from engine_core.resolve import resolved_config
    from serve.cli import build_parser

    def parsed(*flags: str) -> object:
        return engine_kwargs(build_parser().parse_args(["generate", "x", *flags])).get("hf_token")

    assert (parsed("--hf-token"), parsed("--hf-token", "hf_abc"), parsed()) == (
        True,
        "hf_abc",
        None,
    )
    config = resolved_config(
        model=REPO, hf_token="hf_secret", download_dir=str(cache), device="cpu", load_format="dummy"
    )
    assert config.model.hf_token is None and "hf_secret" not in config.encode()


def test_an_interrupted_download_is_judged_by_what_the_engine_needs(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """huggingface_hub 2.x caches the repository's file listing and calls a snapshot lacking a
    listed file incomplete; a missing optional file does not stop the model, missing weights do."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    from huggingface_hub.file_download import repo_folder_name

    def cache_with_listing(name: str, dropped: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(models["main"], folder)
        listing = {
            p.name: tree_cache.TreeCacheEntry(size=p.stat().st_size, blob_id="0" * 40)
            for p in folder.iterdir()
        }
        (folder / dropped).unlink()
        snapshot = place_in_cache(tmp_path / name / "hub", f"tiny-org/{name}", folder)
        storage = (
            tmp_path
            / name
            / "hub"
            / repo_folder_name(repo_id=f"tiny-org/{name}", repo_type="model")
        )
        tree_cache.write_tree_cache(str(storage), snapshot.name, listing)
        return snapshot

    snapshot = cache_with_listing("optional", "generation_config.json")
    options = HubOptions(download_dir=str(tmp_path / "optional" / "hub"))
    assert resolve_model_path("tiny-org/optional", options) == snapshot.resolve()
    cache_with_listing("weightless", "model.safetensors")
    options = HubOptions(download_dir=str(tmp_path / "weightless" / "hub"))
    with pytest.raises(ConfigError, match=r"lacks \*\.safetensors; HF_HUB_OFFLINE is set"):
        resolve_model_path("tiny-org/weightless", options)
