#!/usr/bin/env bash
# Installs everything and runs the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Lint, format and types first (seconds): pyproject.toml's [tool.ruff] and [tool.mypy].
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
python3 -m pytest tests -q "$@"
