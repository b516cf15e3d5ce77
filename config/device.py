"""DeviceConfig: which device runs the model."""

from __future__ import annotations

import os
from dataclasses import dataclass

from config.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
# Without one of these (NVIDIA's driver, ROCm's, WSL's) torch.cuda.is_available() is False.
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


@dataclass(slots=True)
class DeviceConfig:
    """Which device runs the model: auto picks CUDA when present."""

    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")

    def resolved(self) -> str:
        """'cuda' or 'cpu'."""
        if self.device != "auto":
            return self.device
        if not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
            return "cpu"  # no GPU driver: torch would say the same after seconds of importing
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
