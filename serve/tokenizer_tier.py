"""The second tier `engine serve` starts: the tokenizer processes, each connected to every
engine core, each answering the launcher's HELLO with READY."""

from __future__ import annotations

from ipc.handshake import hello_frames
from ipc.process import spawn_module
from protocol.tokenizer import TOKENIZER_PROTOCOL_VERSION, TokenizerHello, api_output_decoders
from serve.child import Child, ChildSettings
from tokenizer_proc.tokenizer_proc import process_name


def start_tokenizer(
    settings: ChildSettings,
    index: int,
    address: str,
    engine_addresses: list[str],
    engine_pids: list[int],
) -> Child:
    """Start tokenizer process index, listening on address, in its own session (Ctrl-C reaches
    only the launcher); it fails its requests when one of engine_pids exits."""
    template = (
        ["--chat-template", settings.chat_template_file] if settings.chat_template_file else []
    )
    engines = [a for engine in engine_addresses for a in ("--engine-address", engine)]
    pids = [a for pid in engine_pids for a in ("--engine-pid", str(pid))]
    popen = spawn_module(
        "tokenizer_proc.tokenizer_proc",
        [
            "--index",
            str(index),
            "--listen",
            address,
            *engines,
            *pids,
            *settings.argv(),
            *template,
        ],
        own_session=True,
    )
    return Child(
        process_name(index),
        popen,
        address,
        hello_frames(TokenizerHello(TOKENIZER_PROTOCOL_VERSION, "launcher")),
        api_output_decoders(),
    )
