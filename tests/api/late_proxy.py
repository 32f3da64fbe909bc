"""A TCP proxy on 127.0.0.1 whose connections deliver the client's first bytes `delay_s` late.

What the client sends in its first `delay_s` reaches the server at once after it; from then on
both directions pass through unchanged. So a call reaches the server `delay_s` after the client
started its deadline's clock, while the client's cancellation arrives as soon as it is sent:
the client's deadline runs `delay_s` ahead of the server's, as a call's one-way latency does
on a busy machine (`sitsd.api.deadlines`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class LateStartProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream_port`; see the module docstring."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self._upstream_port = upstream_port
        self._delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> LateStartProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream_port))
            self._sockets += [client, upstream]
            held_from = time.monotonic()
            for args in ((client, upstream, held_from), (upstream, client, None)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, held_from: float | None) -> None:
        """Copy `source` to `sink` until EOF; from the client, only `delay_s` after the start."""
        if held_from is not None:
            # The delay is the mechanism under test (a slow network), not a wait for a condition.
            time.sleep(max(0.0, held_from + self._delay_s - time.monotonic()))
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
