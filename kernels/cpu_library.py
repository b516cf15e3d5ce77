"""Builds the C kernels in kernels/cpu/ once per machine and loads them with ctypes.

The library is compiled with the system C compiler (-O3 -march=native, OpenMP) into the engine's
cache, keyed by the sources, the flags, the compiler and the CPU, so a second start loads it at
once. It links the libgomp torch has already loaded, so its threads are torch's threads. When no
compiler is found or the build fails, load() returns None and callers keep their torch path;
ENGINE_CPU_KERNELS=0 forces that path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).parent / "cpu"
_SOURCES = sorted(_SOURCE_DIR.glob("*.c"))
_HEADERS = sorted(_SOURCE_DIR.glob("*.h"))
# Compiled with -ffast-math, linked without it: at link time the flag makes GCC add crtfastmath.o,
# whose constructor turns on flush-to-zero for the whole process that loads the library (a
# user's Python floats would lose their subnormals). The kernels flush subnormals themselves,
# per thread and for their own span (vec.h: ftz_enter/ftz_leave).
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _compile_flags() -> list[str]:
    """_FLAGS, and a -D for each name in $ENGINE_CPU_KERNEL_DEFINES (measurement builds, e.g.
    DECODE_STACK_PROFILE: the fused decode step's per-part timing); part of the build key."""
    defines = os.environ.get("ENGINE_CPU_KERNEL_DEFINES", "").split()
    return _FLAGS + [f"-D{name}" for name in defines]


_I64, _I32, _F32, _P = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "paged_attention_f32": (
        ctypes.c_int,
        # q..seq_lens, num_reqs..block_size, scale, window, sinks, soft_cap, kv_fp8, k_scale,
        # v_scale, num_threads
        [_P, _I64, _P, _I64, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32]
        + [_F32, _I32, _P, _F32, _I32, _F32, _F32, _I32],
    ),
    "linear_f32": (None, [_P, _I64, _P, _P, _P, _I64, _I64, _I32, _I32, _I32]),
    "swiglu_f32": (None, [_P, _I64, _P, _P, _I64, _I64, _I32, _I32, _I32]),
    "swiglu_tile_rows": (_I32, []),
    "write_kv_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I32, _I32, _I32, _I32]),
    "write_kv_fp8": (
        None,
        [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I32, _I32, _I32, _F32, _F32, _I32],
    ),
    "silu_and_mul_f32": (None, [_P, _I64, _P, _I64, _I64, _I64, _I32]),
    "add_rms_norm_f32": (None, [_P, _P, _P, _P, _I64, _I64, _F32, _I32]),
    "rotary_f32": (None, [_P, _I64, _I64, _I32, _I32, _I32, _P, _P, _I32]),
    "qk_norm_rotary_f32": (
        None,
        [_P, _I64, _I64, _I32, _I32, _I32, _P, _P, _F32, _P, _P, _I32],
    ),
    "quant_linear_f32": (_I32, [_I32, _P, _I64, _P, _P, _P, _I64, _I64, _I32, _I32, _I32]),
    "quant_dequantize_f32": (_I32, [_I32, _P, _P, _I64, _I32, _I32, _I32]),
    "quant_rows_f32": (_I32, [_I32, _P, _I32, _I32, _P, _I64, _P, _I32]),
    "quant_block_bytes": (_I64, [_I32, _I32]),
    "quant_few_rows": (_I32, []),
    "quant_linear_argmax_f32": (_I32, [_I32, _P, _I64, _P, _I64, _I32, _I32, _I32, _P, _I32]),
    "decode_stack_work_floats": (_I64, [_P, _I64, _I32]),
    "decode_stack_profile": (_I32, [_P]),
    "decode_stack_f32": (_I32, [_P, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _I32]),
    "prepare_inputs_i64": (
        None,
        [_P, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _P],
    ),
    "post_update_i64": (None, [_P, _P, _I64, _P, _P, _I64, _P, _P, _P, _I64, _P]),
    "ngram_propose_i64": (None, [_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _P, _I32]),
    "argmax_rows_f32": (None, [_P, _I64, _I64, _I64, _P, _I32]),
    "linear_argmax_f32": (None, [_P, _I64, _P, _I64, _I32, _I32, _I32, _P, _I32]),
    "apply_token_bitmask_f32": (None, [_P, _I64, _P, _I64, _P, _I64, _I64, _I32]),
    "fused_moe_f32": (
        _I32,
        [_P, _I64, _I64, _I32, _P, _P, _I32, _P, _I64, _P, _P, _P, _P]
        + [_I32, _I32, _I32, _I32, _F32, _P, _I64, _I32],
    ),
}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    """kernels/ under the engine's cache: $ENGINE_CACHE_DIR, else $XDG_CACHE_HOME/engine, else
    ~/.cache/engine (as the model cache)."""
    if explicit := os.environ.get("ENGINE_CACHE_DIR"):
        return Path(explicit).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "engine" / "kernels"


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed:\n{result.stderr[-2000:]}")


@functools.cache
def _build_key(cc: str, flags: str) -> str:
    """This machine's build: a hash of the sources, flags, compiler and CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in [
        *(p.read_bytes() for p in _SOURCES + _HEADERS),
        flags.encode(),
        version.encode(),
        _cpu_id().encode(),
    ]:
        key.update(part)
    return key.hexdigest()[:16]


def _target(cc: str) -> Path:
    """Where this machine's build lives, under the cache directory of the moment."""
    key = _build_key(cc, " ".join(_compile_flags() + _LINK_FLAGS))
    return _cache_dir() / f"libenginecpu-{key}.so"


def _build(cc: str) -> Path:
    target = _target(cc)
    if target.is_file():
        return target
    logger.info("building the CPU kernels into %s (once per machine)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        objects = []
        for source in _SOURCES:
            obj = Path(tmp) / f"{source.stem}.o"
            _run([cc, *_compile_flags(), f"-I{_SOURCE_DIR}", "-c", "-o", str(obj), str(source)])
            objects.append(str(obj))
        _run([cc, *_LINK_FLAGS, "-o", str(out), *objects, "-lm"])
        os.replace(out, target)  # atomic: concurrent builders each write a whole file
    return target


def available() -> bool:
    """Whether load() gives the library here; answered without loading it (or torch) when this
    machine's build is in the cache, so that a process which only resolves the configuration
    (a tokenizer process, an API server) stays light."""
    if os.environ.get("ENGINE_CPU_KERNELS", "1") == "0":
        return False
    cc = _compiler()
    if cc is not None and _target(cc).is_file():
        return True
    return load() is not None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None when it cannot be built here (callers then use torch ops)."""
    if os.environ.get("ENGINE_CPU_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU kernels disabled, using torch ops")
        return None
    import torch  # noqa: F401  (loads libgomp first, so the library shares torch's OpenMP runtime)

    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError) as e:
        logger.warning("CPU kernels could not be built (%s); using torch ops", e)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
