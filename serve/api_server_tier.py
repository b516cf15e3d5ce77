"""The last tier `engine serve` starts: the HTTP API servers, which share one listening socket
the launcher binds first (so a port in use fails before anything loads, and port 0 resolves),
and each write a ready file once they serve."""

from __future__ import annotations

import socket

from frontend import api_server
from frontend.chat_args import ChatOptions
from frontend.http_options import HttpOptions
from ipc.process import spawn_module
from serve.child import Child, ChildSettings, LaunchError


class ApiServerTier:
    """The API servers of one launch: count processes on host:port (or --uds), started with
    the HTTP and chat flags."""

    def __init__(
        self,
        count: int,
        host: str,
        port: int,
        api_key: str | None,
        max_request_body: int,
        chat: ChatOptions,
        disable_ui: bool,
        http: HttpOptions,
    ) -> None:
        self.count = count
        self.host = host
        self.port = port
        self.api_key = api_key
        self.max_request_body = max_request_body
        self.chat = chat
        self.disable_ui = disable_ui
        self.http = http
        # Listening from listen() until the API servers have inherited it.
        self._port_socket: socket.socket | None = None

    def listen(self) -> None:
        """Bind the shared listening socket (port 0: a free one, then self.port); LaunchError
        when the port is in use. Nothing to bind without API servers or with --uds."""
        if not self.count or self.http.uds:
            return
        try:
            self._port_socket = api_server.listening_socket(self.host, self.port)
        except OSError as e:
            raise LaunchError(
                f"cannot listen on {self.host}:{self.port}: {e.strerror} "
                "(is another server using this port?)"
            ) from None
        self.port = self._port_socket.getsockname()[1]

    def start(
        self,
        settings: ChildSettings,
        ready_dir: str,
        serving_file: str,
        tokenizers: list[Child],
        engine_addresses: list[str],
        engine_pid: int | None,
    ) -> list[Child]:
        """Start every API server, connected to the tokenizers and told the engine cores'
        addresses; the listening socket is theirs afterwards (the port closes when they stop)."""
        children = [
            self._start_one(
                i, settings, ready_dir, serving_file, tokenizers, engine_addresses, engine_pid
            )
            for i in range(self.count)
        ]
        self.close()
        return children

    def _start_one(
        self,
        index: int,
        settings: ChildSettings,
        ready_dir: str,
        serving_file: str,
        tokenizers: list[Child],
        engine_addresses: list[str],
        engine_pid: int | None,
    ) -> Child:
        ready_file = f"{ready_dir}/api-{index}.ready"
        args = [
            "--index",
            str(index),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *settings.argv(),
            *(["--engine-pid", str(engine_pid)] if engine_pid else []),
            "--max-request-body",
            str(self.max_request_body),
            "--ready-file",
            ready_file,
            "--serving-file",
            serving_file,
            *self.chat.argv(settings.chat_template_file),
        ]
        if self.disable_ui:
            args.append("--disable-ui")
        for tokenizer in tokenizers:
            args += [
                "--tokenizer-address",
                tokenizer.address,
                "--tokenizer-pid",
                str(tokenizer.popen.pid),
            ]
        for address in engine_addresses:
            args += ["--engine-address", address]
        args += self.http.argv()
        fds: tuple[int, ...] = ()
        if self._port_socket is not None:
            fds = (self._port_socket.fileno(),)
            args += ["--listen-fd", str(fds[0])]
        # The key travels in the environment, not on the command line that ps shows.
        env = {"ENGINE_API_KEY": self.api_key} if self.api_key else {}
        # Each child in its own session, so Ctrl-C reaches only the launcher.
        popen = spawn_module(
            "frontend.api_server", args, extra_env=env, own_session=True, pass_fds=fds
        )
        return Child(api_server.process_name(index), popen, ready_file, [], {})

    def url(self) -> str:
        """Where clients reach the API servers."""
        return self.http.url(self.host, self.port)

    def close(self) -> None:
        """Close the listening socket, if this process still holds it."""
        if self._port_socket is not None:
            self._port_socket.close()
            self._port_socket = None
