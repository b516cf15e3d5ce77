"""The kernel tests' device: CUDA when there is a GPU, else the CPU under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_inputs import DEVICE


@pytest.fixture
def device() -> torch.device:
    return torch.device(DEVICE)
