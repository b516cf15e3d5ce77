"""Shared fixtures: the default model's tokenizer, loaded once."""

from __future__ import annotations

import os

import pytest

from config.default_model import resolve_model_path
from tokenizer_proc.tokenizer import load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's (SmolLM2) fast tokenizer."""
    return load_tokenizer(resolve_model_path(None))
