"""Convert an EAGLE / EAGLE-3 head published as PyTorch pickles into the safetensors folder the
engine loads (--speculative-config '{"method": "eagle3", "model": DST, ...}').

The EAGLE authors publish their heads as pytorch_model.bin (yuhuili/EAGLE-LLaMA3-Instruct-8B,
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B); the engine loads no pickles. This reads them with
torch.load(weights_only=True) (tensors only, no code runs), writes every tensor unchanged to
DST/model.safetensors and copies config.json (and generation_config.json where there is one).

    python -m scripts.convert_eagle_head SRC_FOLDER DST_FOLDER
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def convert(src: Path, dst: Path) -> Path:
    """DST/model.safetensors from SRC's *.bin / *.pt files; returns its path."""
    pickles = sorted(src.glob("*.bin")) + sorted(src.glob("*.pt"))
    if not pickles:
        raise SystemExit(f"{src}: no *.bin or *.pt weights to convert")
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src}: no config.json")
    tensors: dict[str, torch.Tensor] = {}
    for path in pickles:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, tensor in state.items():
            if name in tensors:
                raise SystemExit(f"{path}: tensor {name!r} appears in two files")
            # A copy of its own: safetensors refuses tensors that share storage.
            tensors[name] = tensor.detach().contiguous().clone()
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    out = dst / "model.safetensors"
    save_file(tensors, str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="the head's folder (config.json, *.bin)")
    parser.add_argument("dst", type=Path, help="the folder to write")
    args = parser.parse_args(argv)
    out = convert(args.src, args.dst)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
