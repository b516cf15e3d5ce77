"""A CPU engine never imports Triton (issue 38): only kernels/triton/ imports it, and only where
a Triton kernel is about to run (kernels/__init__.py). Importing Triton cost every CPU engine
process ~150-230 ms at start-up and left Triton IR objects alive at exit for nothing.

Checked three ways: `engine generate` on the default model with the interpreter's import trace
(PYTHONPROFILEIMPORTTIME=1, which the engine core's process inherits); LLM in this process's
child for the families with their own CPU paths (MoE, MLA, attention sinks and windows); and the
sources, so that a new top-level `import triton` fails here before any process starts.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# "import time:  self [us] | cumulative | <indent>module", one line per import, every process.
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| +(\S+)$")
# Modules that import the Triton kernels at their top: each is imported only when chosen for a
# CUDA device (gpu_worker/attention/select.py) or is a GPU-only script.
_TRITON_USERS = {
    "gpu_worker/attention/triton_backend.py",
    "gpu_worker/attention/mla_triton_backend.py",
    "scripts/bench_gguf_matmul.py",
}


_TRITON_OPS = ("kernels.triton",)


def _is_triton(module: str) -> bool:
    return module == "triton" or module.startswith(("triton.", *_TRITON_OPS))


def test_engine_generate_imports_no_triton() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "serve.cli", "generate", "The capital of France is"]
        + ["--max-tokens", "4", "--device", "cpu"],
        capture_output=True,
        text=True,
        env={**_ENV, "PYTHONPROFILEIMPORTTIME": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("The capital of France is")
    imported = [m.group(1) for m in map(_IMPORT_LINE.match, done.stderr.splitlines()) if m]
    # The engine core's process was traced too: the model runner is imported only there.
    assert "gpu_worker.model_runner" in imported
    assert not [m for m in imported if _is_triton(m)]


_PROBE = """
import json, sys
from config.default_model import resolve_model_path
from frontend.llm import LLM
from protocol.sampling_params import SamplingParams

found = {}
for model in sys.argv[1:]:
    llm = LLM(model, tokenizer=str(resolve_model_path(None)), engine_process=False,
              device="cpu", max_model_len=64, kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    tokens = llm.generate([[1, 5, 9, 13]], params)[0].outputs[0].token_ids
    triton = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")
                    or m.startswith("kernels.triton"))
    found[model] = {"tokens": len(tokens), "triton": triton}
print(json.dumps(found))
"""


def test_cpu_engine_for_moe_mla_and_sinks_imports_no_triton(tmp_path: Path) -> None:
    """Qwen3-MoE (the fused MoE's C path), DeepSeek-V3 (MLA on the torch backend), gpt-oss
    (MoE with biases, attention sinks and sliding windows): a generate step on the CPU each,
    in one process, and no Triton module in it afterwards."""
    models = [str(make_tiny_model(tmp_path / arch, arch)) for arch in ("qwen3_moe", "deepseek_v3")]
    models.append(str(make_tiny_model(tmp_path / "gpt_oss", "gpt_oss")))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *models],
        capture_output=True,
        text=True,
        env=_ENV,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert {model: entry["tokens"] for model, entry in found.items()} == dict.fromkeys(models, 3)
    assert {model: entry["triton"] for model, entry in found.items()} == dict.fromkeys(models, [])


def _top_level_imports(tree: ast.Module) -> list[str]:
    """The modules a file imports when it is imported: its module-level statements, including
    those under a top-level if/try (not those inside functions, which run on call)."""
    names: list[str] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    stack += child.body if isinstance(child, ast.ExceptHandler) else [child]
    return names


@pytest.mark.parametrize(
    "package",
    [
        "config",
        "engine_core",
        "executor",
        "frontend",
        "gpu_worker",
        "kernels",
        "protocol",
        "serve",
        "scripts",
        "bench",
    ],
)
def test_only_kernels_triton_imports_triton(package: str) -> None:
    """No module outside kernels/triton/ imports triton when it is imported, and none but the
    Triton attention backends (imported when selected) imports kernels.triton that way."""
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kernels/triton/"):
            continue
        names = _top_level_imports(ast.parse(path.read_text(), rel))
        bad = [n for n in names if n == "triton" or n.startswith("triton.")]
        if rel not in _TRITON_USERS:
            bad += [n for n in names if n.startswith(_TRITON_OPS)]
        if bad:
            offenders.append(f"{rel}: {', '.join(sorted(set(bad)))}")
    assert not offenders, "\n".join(offenders)
