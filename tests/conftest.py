"""Test-session set-up: Triton kernels run under the interpreter when no GPU is present."""

from __future__ import annotations

import os

import torch

# Must happen before triton is imported by the kernel modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
