"""A slow-loris HTTP server on 127.0.0.1: it answers, but one byte at a time, for as long as the client waits.

A client that times each read (httpx, urllib) never sees a read time out, because a byte always arrives in
time; only a deadline on the whole request ends the wait. A plain socket server in threads, so what goes over
the wire is exactly what is written here:

- ``trickle="body"``: the status line and headers at once (``200``, ``Content-Length`` of the whole body),
  then the body one byte every ``interval_s``;
- ``trickle="headers"``: the response head itself one byte every ``interval_s``.

Requests whose path is not in ``slow_paths`` get a quick ``200`` with ``quick_body`` (``{}``), so
one server can, say, pass its ``/health`` probe and trickle its completions.

    with SlowLorisServer(trickle="body", slow_paths={"/v1/completions"}) as server:
        ...  # server.url, server.requests
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Literal

Trickle = Literal["body", "headers"]

_BODY = b'{"choices": [{"token_ids": [1], "finish_reason": "stop"}]}' + b" " * 4000


class SlowLorisServer:
    """Serves every connection in its own thread; ``close()`` stops them all and joins them (bounded)."""

    def __init__(
        self,
        *,
        trickle: Trickle,
        slow_paths: set[str] | None = None,
        interval_s: float = 0.4,
        quick_body: bytes = b"{}",
    ) -> None:
        self.trickle = trickle
        self.quick_body = quick_body
        self.slow_paths = slow_paths
        self.interval_s = interval_s
        self.requests: list[str] = []
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="slowloris-accept")
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(connection,), name="slowloris-conn")
            self._threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            connection.settimeout(5.0)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = connection.recv(65536)
                if not chunk:
                    return
                request += chunk
            path = request.split(b" ", 2)[1].decode()
            self.requests.append(path)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            if self.slow_paths is not None and path not in self.slow_paths:
                connection.sendall(
                    head + b"Content-Length: %d\r\n\r\n" % len(self.quick_body) + self.quick_body
                )
                return
            head += b"Content-Length: %d\r\n\r\n" % len(_BODY)
            if self.trickle == "body":
                connection.sendall(head)
                self._drip(connection, _BODY)
            else:
                self._drip(connection, head + _BODY)

    def _drip(self, connection: socket.socket, data: bytes) -> None:
        """One byte per interval until the data ends, the client leaves, or the server closes."""
        for index in range(len(data)):
            if self._stop.wait(self.interval_s):
                return
            connection.sendall(data[index : index + 1])

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(5.0)
        self._listener.close()
        for thread in self._threads:
            thread.join(5.0)

    def __enter__(self) -> SlowLorisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
