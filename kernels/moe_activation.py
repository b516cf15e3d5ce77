"""The mixture-of-experts activations by name, and the code each kernel switches on: shared by
kernels/fused_moe.py (the torch and C paths) and kernels/triton/fused_moe.py."""

from __future__ import annotations

ACTIVATIONS = ("silu", "swigluoai")
# The kernels' code for each (kernels/cpu/fused_moe.c's enum, the Triton kernel's ACTIVATION).
ACTIVATION_CODES = {"silu": 0, "swigluoai": 1}
