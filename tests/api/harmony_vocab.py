"""The harmony tests' vocabulary: o200k_base.tiktoken where the engine looks for it
(TIKTOKEN_ENCODINGS_BASE, else frontend.harmony_vocab.DEFAULT_VOCAB_DIR, which
scripts/harmony_vocab.py fills from npm's tiktoken package); the tests skip without it."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from frontend.harmony_vocab import DEFAULT_VOCAB_DIR, ENV_VAR, VOCAB_FILE, load_gpt_oss_encoding

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding


def vocab_dir() -> Path:
    """The folder holding o200k_base.tiktoken; skips the test when there is none."""
    folder = Path(os.environ.get(ENV_VAR) or DEFAULT_VOCAB_DIR)
    if not (folder / VOCAB_FILE).is_file():
        pytest.skip(
            f"no {VOCAB_FILE} in {folder}: run `python3 scripts/harmony_vocab.py` "
            "(scripts/setup.sh --test does) to build it from npm's tiktoken package"
        )
    return folder


@functools.cache
def _encoding() -> HarmonyEncoding:
    return load_gpt_oss_encoding()


def encoding() -> HarmonyEncoding:
    """harmony's gpt-oss encoding; skips the test without the vocabulary."""
    vocab_dir()
    return _encoding()
