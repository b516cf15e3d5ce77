"""Output structs of the tokenizer process."""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """One token's log probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
