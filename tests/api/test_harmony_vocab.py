"""frontend/harmony_vocab.py and scripts/harmony_vocab.py: o200k_base's ranks read from npm's
compact form and from a byte-level tokenizer's vocabulary write the official file (sha256), and
harmony loads from the model's tokenizer when nothing else holds the file; with nothing at all
the refusal names where it looked."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from frontend import harmony_vocab
from frontend.harmony_vocab import (
    O200K_BASE_SHA256,
    load_gpt_oss_encoding,
    ranks_from_vocab,
    tiktoken_lines,
)
from scripts.harmony_vocab import ranks_from_npm_json
from tests.api.harmony_vocab import vocab_dir


def _ranks() -> dict[bytes, int]:
    ranks = {}
    for line in (vocab_dir() / "o200k_base.tiktoken").read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_level_vocab(ranks: dict[bytes, int]) -> dict[str, int]:
    """The vocabulary a byte-level BPE tokenizer (gpt-oss's tokenizer.json) holds."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    return {"".join(chars[b] for b in token): rank for token, rank in ranks.items()}


def test_npm_compact_form():
    compact = "! 0 YQ== Yg== YWI=\n! 3 Yw=="
    assert ranks_from_npm_json(compact) == {b"a": 0, b"b": 1, b"ab": 2, b"c": 3}
    assert tiktoken_lines({b"b": 1, b"a": 0}) == b"YQ== 0\nYg== 1\n"


def test_a_tokenizers_vocabulary_gives_the_official_file():
    vocab = _byte_level_vocab(_ranks())
    vocab.update({"<|return|>": 200002, "<|call|>": 200012})  # special tokens are skipped
    ranks = ranks_from_vocab(vocab)
    assert ranks is not None
    assert hashlib.sha256(tiktoken_lines(ranks)).hexdigest() == O200K_BASE_SHA256
    assert ranks_from_vocab({"a": 0, "b": 1}) is None  # not o200k


def test_harmony_loads_from_the_model_tokenizer_alone(tmp_path, monkeypatch):
    vocab = _byte_level_vocab(_ranks())
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", str(tmp_path / "empty-cache"))
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"):  # harmony's download must fail
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")
    monkeypatch.setattr(harmony_vocab, "DEFAULT_VOCAB_DIR", Path(tmp_path / "none"))
    enc = load_gpt_oss_encoding(vocab)
    assert enc.encode("<|channel|>final", allowed_special="all") == [200005, 17196]
    with pytest.raises(RuntimeError, match="set TIKTOKEN_ENCODINGS_BASE to it"):
        load_gpt_oss_encoding(None)
    with pytest.raises(RuntimeError, match="not derivable from the model's tokenizer"):
        load_gpt_oss_encoding({"a": 0})
