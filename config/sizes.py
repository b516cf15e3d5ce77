"""Byte sizes as flags give them: '2GiB', '512MB', '1e9'."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MB' or '1e9'."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    try:
        number = float(m.group(1)) if m else None  # '1.2.3' or 'e' pass the pattern, not float()
    except ValueError:
        number = None
    unit = m.group(2).lower() if m else ""
    if number is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse size {value!r}; use bytes or a unit such as '2GiB' or '512MB'"
        )
    return int(number * _SIZE_UNITS[unit])
