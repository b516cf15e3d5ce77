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

    common = ["generate", PROMPT, "--max-tokens", "8", "--device", "cpu"]
    assert main([*common, "--model", str(models["main"])]) == 0
    by_folder = capsys.readouterr().out
    assert main([*common, "--model", REPO, "--download-dir", str(cache)]) == 0
    assert capsys.readouterr().out == by_folder
    assert by_folder.startswith(PROMPT) and len(by_folder) > len(PROMPT) + 1
    cpu = ["--model", REPO, "--device", "cpu"]
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
