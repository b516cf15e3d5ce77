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


def test_unsupported_architecture_is_one_line_and_status_2(tmp_path, capsys) -> None:
    """A model the engine cannot run is refused before any process starts: one line naming
    the model, the architecture and what is supported, exit status 2 (as flag errors)."""
    import transformers

    from serve.cli import main

    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "bert")
    capsys.readouterr()  # transformers' own progress bar
    assert main(["generate", "hi", "--model", str(tmp_path / "bert")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("engine: error: model bert: architecture 'BertModel' is not supported")
    assert "LlamaForCausalLM" in err[0]
