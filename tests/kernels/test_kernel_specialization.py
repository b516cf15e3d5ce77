"""Values that change every step (batch size, block-table width, scratch strides, token count,
scale) must not make Triton compile a new kernel variant.

Triton keys its compile cache on every non-constexpr argument's specialisation: an integer equal
to 1 becomes a constant and one divisible by 16 gets an alignment hint, unless the argument is
listed in do_not_specialize; floats are never specialised. On CUDA the tests count the compiled
variants. The interpreter (CPU) compiles nothing, so there each launch's arguments go through
Triton's own specialisation function, honouring the kernel's do_not_specialize, and the keys of
two steps must be equal."""

from __future__ import annotations

import pytest
import torch

from kernels.triton import paged_attention as pa_module
from kernels.triton import paged_decode as pd_module
from kernels.triton import write_kv as kv_module
from kernels.triton.paged_attention import paged_attention
from kernels.triton.paged_decode import paged_decode_split
from kernels.triton.write_kv import write_kv
from tests.kernels.paged_inputs import make_batch

native = pytest.importorskip("triton._C.libtriton", reason="Triton's native module")
if not hasattr(native, "native_specialize_impl"):
    pytest.skip("this Triton has no native_specialize_impl", allow_module_level=True)
from triton.backends.compiler import BaseBackend  # noqa: E402


def declared_do_not_specialize(kernel) -> set:
    """The names or indices given to @triton.jit(do_not_specialize=...): a JITFunction keeps
    them as an attribute, the interpreter's InterpretedFunction in its kwargs."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    return set(names or ())


def specialization_key(kernel, args: tuple, kwargs: dict, honour_declared: bool = True) -> list:
    """What Triton's launcher keys its cache on: each positional argument's type and
    specialisation, plus the constexpr keywords."""
    dns = declared_do_not_specialize(kernel) if honour_declared else set()
    key = []
    for i, (name, value) in enumerate(zip(kernel.arg_names, args)):
        specialize = i not in dns and name not in dns
        key.append(native.native_specialize_impl(BaseBackend, value, False, specialize, True))
    key.append(sorted((k, repr(v)) for k, v in kwargs.items() if k not in ("grid", "warmup")))
    return key


def compiled_variants(kernel) -> int:
    """Kernels compiled so far for every device (CUDA); 0 under the interpreter."""
    caches = getattr(kernel, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())


class Launches:
    """Records the arguments of every launch of the given kernels."""

    def __init__(self, monkeypatch, *kernels):
        self.calls: dict[str, list[tuple[tuple, dict]]] = {}
        for kernel in kernels:
            self._wrap(monkeypatch, kernel)

    def _wrap(self, monkeypatch, kernel) -> None:
        original = kernel.run
        calls = self.calls.setdefault(kernel.__name__, [])

        def run(*args, **kwargs):
            calls.append((args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)


def scalars(args: tuple) -> list:
    return [a for a in args if not isinstance(a, torch.Tensor)]


def assert_one_variant(
    kernel, launches: Launches, step_a, step_b, scalars_differ: bool = True
) -> None:
    """step_a and step_b (callables launching kernel) share one specialisation key, and on CUDA
    the second compiles nothing new. scalars_differ: the steps pass different scalar values."""
    step_a()
    compiled = compiled_variants(kernel)
    step_b()
    assert compiled_variants(kernel) == compiled, f"{kernel.__name__} compiled a second variant"
    (args_a, kwargs_a), (args_b, kwargs_b) = launches.calls[kernel.__name__][-2:]
    if scalars_differ:
        assert scalars(args_a) != scalars(args_b), "the steps should differ in a per-step value"
    assert specialization_key(kernel, args_a, kwargs_a) == specialization_key(
        kernel, args_b, kwargs_b
    )


def test_declared_per_step_arguments():
    assert {"num_seqs", "stride_bt"} <= declared_do_not_specialize(
        pa_module._paged_attention_kernel
    )
    scratch = {"stride_ms", "stride_mh"}
    assert scratch | {"stride_bt"} <= declared_do_not_specialize(pd_module._decode_partition_kernel)
    assert scratch <= declared_do_not_specialize(pd_module._decode_reduce_kernel)


def test_paged_attention_one_variant_across_batch_sizes(monkeypatch, device):
    kernel = pa_module._paged_attention_kernel
    launches = Launches(monkeypatch, kernel)
    # num_seqs 1 then 3, block-table width 2 then 4, another scale; one decode tile size.
    step_a = make_batch([(5, 1)], 1, 2, 64, 16, torch.float32, device=device)
    step_b = make_batch([(5, 1), (40, 1), (20, 1)], 1, 2, 64, 16, torch.float32, device=device)
    assert_one_variant(
        kernel,
        launches,
        lambda: paged_attention(**step_a, scale=0.125, max_query_len=1),
        lambda: paged_attention(**step_b, scale=0.1, max_query_len=1),
    )
    # The check has teeth: without do_not_specialize, num_seqs == 1 would be a constant.
    (args_a, kwargs_a), (args_b, kwargs_b) = launches.calls[kernel.__name__][-2:]
    assert specialization_key(
        kernel, args_a, kwargs_a, honour_declared=False
    ) != specialization_key(kernel, args_b, kwargs_b, honour_declared=False)


def test_split_decode_one_variant_across_batches_and_lengths(monkeypatch, device):
    partition, reduce = pd_module._decode_partition_kernel, pd_module._decode_reduce_kernel
    launches = Launches(monkeypatch, partition, reduce)
    # 1 then 5 partitions: every scratch stride changes (one partition makes stride_mh 1), and so
    # does the table width.
    step_a = make_batch([(63, 1)], 1, 2, 64, 16, torch.float32, device=device)
    step_b = make_batch([(99, 1), (299, 1), (19, 1)], 1, 2, 64, 16, torch.float32, device=device)

    def run_a():
        paged_decode_split(**step_a, scale=0.125, max_seq_len=64, partition_size=64)

    def run_b():
        paged_decode_split(**step_b, scale=0.125, max_seq_len=300, partition_size=64)

    assert_one_variant(partition, launches, run_a, run_b)
    assert_one_variant(reduce, launches, run_a, run_b)


def test_write_kv_one_variant_across_token_counts(monkeypatch, device):
    # The token count is the grid, not an argument: nothing per-step reaches the key.
    kernel = kv_module._write_kv_kernel
    launches = Launches(monkeypatch, kernel)
    kv_cache = torch.zeros(2, 4, 16, 2, 64, device=device)

    def step(num_tokens: int):
        key = torch.randn(num_tokens, 2, 64, device=device)
        slots = torch.arange(num_tokens, device=device) * 3
        return lambda: write_kv(key, key, kv_cache[0], kv_cache[1], slots)

    assert_one_variant(kernel, launches, step(1), step(5), scalars_differ=False)
