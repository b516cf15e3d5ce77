"""Where openai-harmony finds its vocabulary (o200k_base.tiktoken) on a machine that cannot reach
openaipublic.blob.core.windows.net.

openai-harmony reads the file from the folder TIKTOKEN_ENCODINGS_BASE names (and then checks its
sha256 against the official one), else downloads it. The vocabulary also sits in every gpt-oss
checkpoint: tokenizer.json's first 199,998 entries are o200k_base's ranks in byte-level form. So
the engine looks, in order: TIKTOKEN_ENCODINGS_BASE as the user set it; the model's own
tokenizer, written out as o200k_base.tiktoken (harmony's hash check proves it exact);
DEFAULT_VOCAB_DIR (where scripts/harmony_vocab.py puts it); harmony's download.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

VOCAB_FILE = "o200k_base.tiktoken"
# tiktoken's openai_public.py: the official file's sha256 (harmony checks the same).
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BASE_RANKS = 199_998  # ordinary tokens; ids from here on are special
ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"
DEFAULT_VOCAB_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "engine" / "tiktoken"
)


def tiktoken_lines(ranks: Mapping[bytes, int]) -> bytes:
    """A .tiktoken file's bytes: 'base64(token) rank' per line, by rank."""
    return b"".join(
        base64.b64encode(token) + b" %d\n" % rank
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    )


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE writes -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def ranks_from_vocab(vocab: Mapping[str, int]) -> dict[bytes, int] | None:
    """o200k_base's ranks from a byte-level tokenizer's vocabulary (token string -> id), or None
    when ids 0..199,997 are not all ordinary byte-level tokens (not an o200k tokenizer)."""
    decoder = _byte_decoder()
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        if token_id >= O200K_BASE_RANKS:
            continue
        try:
            ranks[bytes(decoder[c] for c in token)] = token_id
        except KeyError:
            return None
    return ranks if len(ranks) == O200K_BASE_RANKS else None


@contextlib.contextmanager
def _encodings_base(folder: str) -> Iterator[None]:
    """TIKTOKEN_ENCODINGS_BASE set to folder while harmony loads (it reads it only then)."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = folder
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = before


def load_gpt_oss_encoding(vocab: Mapping[str, int] | None = None) -> HarmonyEncoding:
    """harmony's gpt-oss encoding, its vocabulary found as the module docstring says; vocab is
    the model tokenizer's (token -> id). RuntimeError naming every place looked at when none
    holds it."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    name = HarmonyEncodingName.HARMONY_GPT_OSS
    if os.environ.get(ENV_VAR):
        try:
            return load_harmony_encoding(name)
        except Exception as e:  # harmony raises its own HarmonyError or a plain one
            raise RuntimeError(
                f"openai-harmony could not load {VOCAB_FILE} from {ENV_VAR}="
                f"{os.environ[ENV_VAR]}: {e}"
            ) from None
    ranks = ranks_from_vocab(vocab) if vocab is not None else None
    if ranks is not None:
        with tempfile.TemporaryDirectory(prefix="harmony-vocab-") as folder:
            Path(folder, VOCAB_FILE).write_bytes(tiktoken_lines(ranks))
            with _encodings_base(folder), contextlib.suppress(Exception):
                return load_harmony_encoding(name)  # a hash mismatch falls through
    if (DEFAULT_VOCAB_DIR / VOCAB_FILE).is_file():
        with _encodings_base(str(DEFAULT_VOCAB_DIR)), contextlib.suppress(Exception):
            return load_harmony_encoding(name)
    try:
        return load_harmony_encoding(name)  # harmony's own cache, else its download
    except Exception as e:
        raise RuntimeError(
            f"gpt-oss's chat format needs o200k_base's vocabulary ({VOCAB_FILE}): not in "
            f"{ENV_VAR} (unset), not derivable from the model's tokenizer, not in "
            f"{DEFAULT_VOCAB_DIR}, and openai-harmony's download failed ({e}). Put the file "
            f"in a folder and set {ENV_VAR} to it, or run scripts/harmony_vocab.py"
        ) from None
