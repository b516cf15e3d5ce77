"""Reloading the C kernel library under other environment variables, for tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from kernels import cpu_library


@contextmanager
def library_env(**env: str) -> Iterator[None]:
    """Inside: the library loads anew with env set (ENGINE_CPU_KERNELS, CC, ENGINE_CACHE_DIR...).
    After: the variables are as before and the library loads anew again."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    cpu_library.load.cache_clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        cpu_library.load.cache_clear()
