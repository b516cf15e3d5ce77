"""`engine generate` ends cleanly: its stderr holds the engine's own log lines and nothing else
(no "nanobind: leaked ..." lines from Triton's bindings at interpreter exit, no tracebacks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

# The log format of every engine process: date, time, logger, level, message.
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [\w.]+ (DEBUG|INFO|WARNING) ")


def test_generate_stderr_holds_only_log_lines() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "serve.cli",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is")
    stray = [line for line in done.stderr.splitlines() if not _LOG_LINE.match(line)]
    assert not stray, "stderr lines that are not the engine's log:\n" + "\n".join(stray[:10])
