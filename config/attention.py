"""The attention capability table: which block sizes, head sizes and dtypes each device type's
attention backends run, checked when the configuration resolves."""

from __future__ import annotations

from dataclasses import dataclass

from config.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AttentionSupport:
    """The block sizes, head sizes and dtypes one attention backend runs; None: any value."""

    backend: str
    block_sizes: tuple[int, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[str, ...] | None = None

    def refusal(
        self, block_size: int, head_dim: int, dtype: str
    ) -> tuple[str, int | str, tuple[int | str, ...]] | None:
        """(field, value, supported values) of the first setting this backend cannot run, or
        None when it runs them all."""
        for name, value, allowed in (
            ("block_size", block_size, self.block_sizes),
            ("head_dim", head_dim, self.head_dims),
            ("dtype", dtype, self.dtypes),
        ):
            if allowed is not None and value not in allowed:
                return name, value, allowed
        return None


# Each device type's attention backends, most preferred first: gpu_worker/attention/select.py
# takes the first that runs a configuration (and whose code is usable there), and
# EngineConfig.resolve() refuses a configuration none of them runs. Derived from the kernels:
ATTENTION_BACKENDS: dict[str, tuple[AttentionSupport, ...]] = {
    "cuda": (
        # kernels/paged_attention.py and write_kv.py (Triton).
        AttentionSupport(
            "triton",
            # Powers of two <= 128: at 256, BLOCK_N = 256 makes head_dim-128 K+V tiles 128 KiB a
            # pipeline stage in bf16 (an H100 has 227 KiB) and the fp32 scores 128 regs a thread.
            block_sizes=(1, 8, 16, 32, 64, 128),
            # tl.dot needs a power of two >= 16; at 512 the [64, head_dim] fp32 accumulator alone
            # is 256 registers a thread at 4 warps (the limit is 255).
            head_dims=(16, 32, 64, 128, 256),
            dtypes=("float16", "bfloat16", "float32"),
        ),
    ),
    "cpu": (
        # kernels/cpu/paged_attention.c: compiled for these head sizes, 16 positions a step.
        AttentionSupport(
            "cpu", block_sizes=(16, 32, 64, 128, 256), head_dims=(64, 128), dtypes=("float32",)
        ),
        # gpu_worker/attention/torch_backend.py: gathers K/V into plain torch ops; runs anything.
        AttentionSupport("torch"),
    ),
}


def attention_support(backend: str) -> AttentionSupport:
    """The table's entry of the backend of that name (each backend class points to its own)."""
    for table in ATTENTION_BACKENDS.values():
        for support in table:
            if support.backend == backend:
                return support
    raise KeyError(f"no attention backend {backend!r} in ATTENTION_BACKENDS")


def attention_backends_for(
    device_type: str, block_size: int, head_dim: int, dtype: str
) -> list[str]:
    """The names of device_type's attention backends that run this block size, head size and
    dtype (a resolved name such as 'bfloat16'), most preferred first; raises ConfigError naming
    the supported values when none does. Needs no device of that type."""
    table = ATTENTION_BACKENDS.get(device_type)
    if table is None:
        raise ConfigError(
            f"no attention backend for device type {device_type!r}; "
            f"known: {', '.join(ATTENTION_BACKENDS)}"
        )
    names = [s.backend for s in table if s.refusal(block_size, head_dim, dtype) is None]
    if names:
        return names
    reasons = []
    for support in table:
        refusal = support.refusal(block_size, head_dim, dtype)
        assert refusal is not None  # none of them runs it (names is empty)
        name, value, allowed = refusal
        reasons.append(
            f"{name} {value} is not supported by the {support.backend} attention "
            f"kernels on {device_type}, which take {name} {_one_of(allowed)}"
        )
    raise ConfigError("; ".join(reasons))


def _one_of(values: tuple) -> str:
    """'1, 8 or 16'."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"
