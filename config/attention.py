"""The attention capability table: which block sizes, head sizes, dtypes, attention features and
KV-cache dtypes each device type's attention backends run, checked when the configuration
resolves. Each backend class (gpu_worker/attention/) points to its entry here."""

from __future__ import annotations

from dataclasses import dataclass

from config.errors import ConfigError
from config.model_arch import ModelArchConfig


@dataclass(frozen=True, slots=True)
class AttentionFeatures:
    """What a model asks of attention beyond causal attention over the whole context with a KV
    cache in the model's dtype; AttentionSupport's fields of the same names say who runs it."""

    sliding_window: bool = False
    logits_soft_cap: bool = False
    sinks: bool = False
    mla: bool = False  # a latent (MLA) KV cache instead of per-head keys and values
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(
        cls, arch: ModelArchConfig, max_model_len: int, kv_cache_dtype: str = "auto"
    ) -> AttentionFeatures:
        """What the model needs at this context length: a sliding window only where a sequence
        can outgrow it (within the window, full causal attention computes the same); sinks where
        the family has them; logits soft-capping where config.json sets attn_logit_softcapping
        (Gemma 2, and Gemma 3 where a config sets it); the KV-cache dtype asked for
        (CacheConfig.kv_cache_dtype: auto or fp8)."""
        window = arch.sliding_window
        return cls(
            sliding_window=window is not None and window < max_model_len,
            logits_soft_cap=arch.hf_config.get("attn_logit_softcapping") is not None,
            sinks=arch.architecture in SINK_ARCHITECTURES,
            mla=arch.kv_latent_dim is not None,
            kv_cache_dtype=kv_cache_dtype,
        )


# Architectures whose attention layers carry a learned sink logit per head (gpt-oss's `sinks`);
# their model classes (gpu_worker/models/) read the same set.
SINK_ARCHITECTURES = frozenset({"GptOssForCausalLM"})


PLAIN_ATTENTION = AttentionFeatures()

# The boolean features, in a refusal's words.
_FEATURE_WORDS = {
    "sliding_window": "sliding-window attention",
    "logits_soft_cap": "attention logits soft-capping",
    "sinks": "attention sinks",
    "mla": "a latent (MLA) KV cache",
}


@dataclass(frozen=True, slots=True)
class AttentionSupport:
    """What one attention backend runs: block sizes, head sizes and dtypes (None: any value),
    the attention features it implements (False: refused) and the KV-cache dtypes it keeps."""

    backend: str
    block_sizes: tuple[int, ...] | None = None
    head_dims: tuple[int, ...] | range | None = None
    dtypes: tuple[str, ...] | None = None
    sliding_window: bool = False
    logits_soft_cap: bool = False
    sinks: bool = False
    # Runs multi-head latent attention over a latent cache, and only that (no per-head K/V).
    mla: bool = False
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def refusal(
        self,
        block_size: int,
        head_dim: int,
        dtype: str,
        features: AttentionFeatures = PLAIN_ATTENTION,
    ) -> tuple[str, str] | None:
        """(the first setting this backend cannot run, what it takes instead or ''), or None
        when it runs them all."""
        for name, value, allowed in (
            ("block_size", block_size, self.block_sizes),
            ("head_dim", head_dim, self.head_dims),
            ("dtype", dtype, self.dtypes),
            ("kv_cache_dtype", features.kv_cache_dtype, self.kv_cache_dtypes),
        ):
            if allowed is not None and value not in allowed:
                return f"{name} {value}", f", which take {name} {_one_of(allowed)}"
        for name, words in _FEATURE_WORDS.items():
            if getattr(features, name) and not getattr(self, name):
                return words, ""
        if self.mla and not features.mla:
            # A latent cache holds no per-head keys and values.
            return "per-head keys and values (a model without MLA)", ""
        return None


# Each device type's attention backends, most preferred first: gpu_worker/attention/select.py
# takes the first that runs a configuration (and whose code is usable there), and
# EngineConfig.resolve() refuses a configuration none of them runs. Derived from the kernels;
# each runs sliding windows, sinks and logits soft-capping (docs/models/attention-features.md,
# docs/models/gemma.md). The per-head backends keep an fp8 (e4m3) KV cache besides one in the
# model's dtype (docs/kv-cache-dtype.md); the MLA backends do not. MLA models run on the MLA
# backends alone, which run any head and block size: on CUDA kernels/triton/mla_attention.py
# (CUDA graphs), on the CPU gpu_worker/attention/mla_backend.py (plain torch ops, planned on the
# host).

ATTENTION_BACKENDS: dict[str, tuple[AttentionSupport, ...]] = {
    "cuda": (
        # kernels/triton/paged_attention.py and write_kv.py.
        AttentionSupport(
            "triton",
            # Powers of two <= 128: at 256, BLOCK_N = 256 makes head_dim-128 K+V tiles 128 KiB a
            # pipeline stage in bf16 (an H100 has 227 KiB) and the fp32 scores 128 regs a thread.
            block_sizes=(1, 8, 16, 32, 64, 128),
            # The kernels pad the head dimension to the next power of two (tl.dot takes >= 16)
            # with masked loads and stores, so 96 runs in 128 lanes. Multiples of 8 keep each
            # cache row 16-byte aligned in 16-bit dtypes. Up to 256: at 512 lanes the
            # [64, head_dim] fp32 accumulator alone is 256 registers a thread at 4 warps (the
            # limit is 255). Checked under the interpreter at 48, 80 and 96 besides the powers
            # of two (tests/kernels/test_head_padding_triton.py).
            head_dims=range(16, 257, 8),
            dtypes=("float16", "bfloat16", "float32"),
            sliding_window=True,
            logits_soft_cap=True,
            sinks=True,
            kv_cache_dtypes=("auto", "fp8"),
        ),
        AttentionSupport("mla_triton", dtypes=("float16", "bfloat16", "float32"), mla=True),
    ),
    "cpu": (
        # kernels/cpu/paged_attention.c: compiled for these head sizes, 16 positions a step.
        AttentionSupport(
            "cpu",
            block_sizes=(16, 32, 64, 128, 256),
            head_dims=(64, 128),
            dtypes=("float32",),
            sliding_window=True,
            logits_soft_cap=True,
            sinks=True,
            kv_cache_dtypes=("auto", "fp8"),
        ),
        # gpu_worker/attention/torch_backend.py: gathers K/V into plain torch ops; runs anything.
        AttentionSupport(
            "torch",
            sliding_window=True,
            logits_soft_cap=True,
            sinks=True,
            kv_cache_dtypes=("auto", "fp8"),
        ),
        AttentionSupport("mla_torch", mla=True),
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
    device_type: str,
    block_size: int,
    head_dim: int,
    dtype: str,
    features: AttentionFeatures = PLAIN_ATTENTION,
) -> list[str]:
    """The names of device_type's attention backends that run this block size, head size,
    dtype (a resolved name such as 'bfloat16') and features, most preferred first; raises
    ConfigError naming each backend and what it cannot run when none does. Needs no device of
    that type."""
    table = ATTENTION_BACKENDS.get(device_type)
    if table is None:
        raise ConfigError(
            f"no attention backend for device type {device_type!r}; "
            f"known: {', '.join(ATTENTION_BACKENDS)}"
        )
    names = [s.backend for s in table if s.refusal(block_size, head_dim, dtype, features) is None]
    if names:
        return names
    reasons = []
    for support in table:
        if support.mla and not features.mla:
            continue  # an MLA-only backend is no candidate for per-head attention
        refusal = support.refusal(block_size, head_dim, dtype, features)
        assert refusal is not None  # none of them runs it (names is empty)
        setting, instead = refusal
        reasons.append(
            f"{setting} is not supported by the {support.backend} attention "
            f"kernels on {device_type}{instead}"
        )
    plain = (s.refusal(block_size, head_dim, dtype) is None for s in table)
    if features.sliding_window and any(plain):
        reasons.append("a max_model_len within the model's sliding window needs none")
    raise ConfigError("; ".join(reasons))


def _one_of(values: tuple | range) -> str:
    """'1, 8 or 16', or 'a multiple of 8 from 16 to 256' for a range."""
    if isinstance(values, range):
        return f"a multiple of {values.step} from {values.start} to {values[-1]}"
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"
