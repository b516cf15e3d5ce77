"""`engine serve` end to end on a GPU, without real weights: the processes, the HTTP API, CUDA
graphs in the engine core's own process, and /metrics.

The model is the Llama-3-8B shape of `engine bench device` with dummy bf16 weights and the
default model's tokenizer (its files copied from --tokenizer-dir; the vocabulary is set to the
tokenizer's). Checks a chat completion, one streamed completion (decode tok/s, read like
`curl -N`: scripts/lean_sse.py) and 64 streamed completions at once (output tok/s), then that
/metrics counts them. Prints one JSON object.

    python scripts/device_serve_check.py --tokenizer-dir .devmodel
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.device_shapes import write_model_dir
from scripts.lean_sse import completion_body, stream_raw
from scripts.llama_server_bench import free_port, start, stop, wait_healthy

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_dir(root: Path, tokenizer_dir: Path, vocab_size: int, shape: str) -> Path:
    root.mkdir(parents=True)
    write_model_dir(root, shape)
    config = json.loads((root / "config.json").read_text())
    config.update(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, root / name)
    return root


async def check(port: int, new_tokens: int, concurrent: int) -> dict:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    result: dict = {}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        chat = {
            "model": model,
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 16,
        }
        async with session.post(f"{base}/v1/chat/completions", json=chat) as resp:
            body = await resp.json()
            result["chat"] = {
                "status": resp.status,
                "completion_tokens": body["usage"]["completion_tokens"],
                "finish_reason": body["choices"][0]["finish_reason"],
            }

        def completion(prompt: list[int]) -> dict:
            return completion_body(model, prompt, new_tokens)

        await stream_raw("127.0.0.1", port, completion(list(range(100, 132))))  # warm
        result["single_stream"] = await stream_raw(
            "127.0.0.1", port, completion(list(range(200, 232)))
        )
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(
                stream_raw("127.0.0.1", port, completion(list(range(300 + i, 332 + i))))
                for i in range(concurrent)
            )
        )
        elapsed = time.perf_counter() - start
        tokens = sum(r["tokens"] for r in runs)
        result["concurrent"] = {
            "requests": concurrent,
            "output_tokens": tokens,
            "seconds": round(elapsed, 3),
            "output_tok_s": round(tokens / elapsed, 1),
        }
        async with session.get(f"{base}/metrics") as resp:
            metrics = await resp.text()
    wanted = ("vllm:generation_tokens_total", "vllm:request_success_total")
    result["metrics"] = {
        name: sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )
        for name in wanted
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, default=Path(".devmodel"))
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--shape", default="llama3-8b", help="bench/device.py's SHAPES")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("engine_args", nargs="*", help="more `engine serve` flags (after --)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="device-serve-"))
    model = model_dir(tmp / "model", args.tokenizer_dir, args.vocab_size, args.shape)
    port = free_port()
    log = tmp / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "serve.cli",
        "serve",
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--max-model-len",
        "4096",
        "--port",
        str(port),
        *args.engine_args,
    ]
    started = time.perf_counter()
    proc = start(cmd, log)
    try:
        wait_healthy("engine serve", f"http://127.0.0.1:{port}", proc, log, 600.0)
        ready_s = time.perf_counter() - started
        result = asyncio.run(check(port, args.new_tokens, args.concurrent))
        result["ready_s"] = round(ready_s, 1)
    finally:
        stop(proc)
    lines = log.read_text(errors="replace").splitlines()
    result["log"] = [line for line in lines if "CUDA graphs" in line or "profile run" in line]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
