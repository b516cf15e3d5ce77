"""Our top-level package names must not be mistaken for the third-party packages of the same name.

Why this test exists: the project installs (pip install -e .) top-level packages with short,
common names -- `kernels`, `frontend`, `metrics` -- which are importable from anywhere once
installed. transformers probes for optional integrations by import name: e.g.
`is_kernels_available()` asks importlib whether a module called `kernels` exists (Hugging Face's
`kernels` hub library) and which version its distribution has. Our `kernels` package answers
that probe; if transformers took it for Hugging Face's, it would `from kernels import
get_kernel, ...` and every `from_pretrained` would fail with an ImportError. (Today the probe
says False only because it finds our distribution's version, 0.1.0, below the range it wants:
raising the project's version into that range would break this silently elsewhere.)

The check runs in a subprocess started from an empty temporary directory, so the repository root
is on sys.path only the way the installed project puts it there, exactly as for a user running
the engine (or transformers) from their own directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys
from pathlib import Path

repo, model_dir, order = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
on_path = [p for p in sys.path if p and Path(p).resolve() == repo]
assert not on_path, f"the repository root is on sys.path directly: {on_path}"

if order == "ours-first":
    import frontend, kernels, kernels.paged_attention, metrics  # noqa: E401

import torch
import transformers
from transformers.utils.import_utils import is_kernels_available

assert not is_kernels_available(), "transformers mistakes our `kernels` package for Hugging Face's"

import frontend, kernels, kernels.paged_attention, metrics  # noqa: E401,F811

# Ours: each sits beside engine_core/ in one project checkout (the installed one, which in a
# scratch clone may differ from the clone that runs the test).
roots = {Path(m.__file__).resolve().parent.parent
         for m in (kernels, kernels.paged_attention, frontend, metrics)}
assert len(roots) == 1 and (roots.pop() / "engine_core" / "engine_core.py").is_file(), \
    f"not this project's packages: {[m.__file__ for m in (kernels, frontend, metrics)]}"
assert callable(kernels.paged_attention.paged_attention_ref)

model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.inference_mode():
    logits = model(torch.tensor([[1, 5, 9, 42]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    generated = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False,
                               pad_token_id=0)
    assert generated.shape == (1, 6)
print("import-collision-ok")
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.parametrize("order", ["transformers-first", "ours-first"])
def test_transformers_does_not_mistake_our_packages(tmp_path, tiny_model, order):
    try:
        importlib.metadata.distribution("engine")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the project is not installed (pip install -e .)")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO), str(tiny_model), order],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    assert "import-collision-ok" in proc.stdout
