"""A GGUF file's tensors in the CPU kernels' packed layout, kept on disk between starts.

Packing (kernels.gguf_quant.pack: the blocks reordered for the kernels, q and k rows
un-permuted) cost the default model about half a second at every start. The packed bytes are
written once, per GGUF file and per version of the packing code, into the engine's cache as
safetensors; later starts map that file (no copy, no packing).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from config import gguf_convert
from config.default_model import cache_root
from kernels import gguf_quant

logger = logging.getLogger(__name__)

# Smaller packed weights pack in milliseconds: not worth a file in the cache.
MIN_CACHED_BYTES = 16 * 2**20

# What decides the packed bytes besides the GGUF file: the packers and the row order.
_PACKING_SOURCES = (
    Path(gguf_quant.__file__),
    Path(gguf_convert.__file__),
    Path(__file__).parent / "gguf_weights.py",
)


def cache_file(gguf_path: Path) -> Path:
    """Where gguf_path's packed tensors live: named by the file's path, keyed by its size and
    modification time and the packing code."""
    source = gguf_path.resolve()
    stat = source.stat()
    where = hashlib.sha256(str(source).encode()).hexdigest()[:8]
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    for path in _PACKING_SOURCES:
        key.update(path.read_bytes())
    return cache_root() / "packed" / f"{source.stem}-{where}-{key.hexdigest()[:16]}.safetensors"


class PackedCache:
    """The packed tensors stored for one GGUF file, and those packed since (saved by save())."""

    def __init__(self, gguf_path: Path) -> None:
        self.path = cache_file(gguf_path)
        self._stored: dict[str, torch.Tensor] = {}
        self._fresh: dict[str, torch.Tensor] = {}
        if self.path.is_file():
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                self._stored = load_file(str(self.path))  # a memory map of the file
            except (OSError, SafetensorError) as e:
                logger.warning(
                    "ignoring the packed weights in %s (%s); packing again", self.path, e
                )

    def get(self, name: str) -> torch.Tensor | None:
        """name's packed bytes as stored, None when they are not."""
        return self._stored.get(name)

    def put(self, name: str, data: torch.Tensor) -> None:
        """Packed bytes to store at save()."""
        self._fresh[name] = data

    def save(self) -> None:
        """Write what was packed since loading (with what was stored), atomically, and remove
        the file's older versions (same path, other size, time or code); a cache that cannot be
        written only costs the next start its packing. Below MIN_CACHED_BYTES nothing is kept."""
        if sum(t.numel() for t in self._fresh.values()) < MIN_CACHED_BYTES:
            return
        from safetensors.torch import save_file

        tensors = {**self._stored, **self._fresh}
        older = self.path.name.rsplit("-", 1)[0] + "-" + "?" * 16 + ".safetensors"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            os.close(fd)
            try:
                save_file(tensors, tmp)
                os.replace(tmp, self.path)  # concurrent starts each write a whole file
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            for old in self.path.parent.glob(older):
                if old != self.path:
                    old.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("cannot keep the packed weights in %s (%s)", self.path, e)
            return
        logger.info("packed weights kept in %s for the next start", self.path)
