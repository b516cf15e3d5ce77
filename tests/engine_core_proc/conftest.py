"""Shared fixtures: a tiny random model and one headless engine core serving it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine_core.client import EngineCoreClient
from tests.tiny_models import make_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def engine_args(tmp_path_factory) -> dict:
    """EngineConfig keyword arguments for a tiny random llama on the CPU."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    return dict(model=str(model), device="cpu", kv_cache_memory="16MiB", max_model_len=256)


@pytest.fixture(scope="session")
def socket_dir():
    """A short directory for ipc:// sockets (their paths are limited to ~100 bytes)."""
    path = tempfile.mkdtemp(prefix="ecp-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def headless(engine_args, socket_dir):
    """`engine core --listen ipc://...` running for the whole session: (process, address)."""
    address = f"ipc://{socket_dir}/headless.sock"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args.items()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve.cli", "core", "--listen", address, *flags]
    )
    with EngineCoreClient(address, startup_timeout=120):  # waits until it serves
        pass
    yield proc, address
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, "SIGTERM should stop the engine core cleanly"


@pytest.fixture
def address(headless) -> str:
    """The address of the session's headless engine core."""
    return headless[1]
