"""A loopback TCP fault proxy: real network faults between a client and its server (DESIGN.md §6).

In the spirit of toxiproxy: ``FaultProxy`` listens on ``127.0.0.1`` (an ephemeral port), forwards each
accepted connection to the one upstream it was given, and applies at most one network fault per
connection, chosen in accept order (0-based) by each fault's ``ConnectionTargeting``:

- ``latency``: every chunk, in both directions, is delayed ``latency_s`` before it is passed on;
- ``reset_peer``: the proxy waits for the request's first bytes (so the client has sent its request:
  a reset mid-request), never contacts the upstream, and closes the client socket with ``SO_LINGER``
  0, which sends a TCP RST: the client sees ``ConnectionResetError`` (``ECONNRESET``), or
  ``BrokenPipeError`` if it was still sending;
- ``timeout``: the proxy reads and discards what the client sends and never answers, keeping the
  socket open until the client gives up (its own timeout fires) or the proxy stops.

Without a fault the connection is forwarded transparently, both directions at once, half-closes
included. If the upstream refuses, the client's connection is reset, as a dead server's would be.

The proxy runs its own asyncio loop in a background thread, so it works beside any client, synchronous
(``http.client`` in the tool env) or asynchronous (``httpx`` in the served engine). It only ever
connects to its upstream, which must be a loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Literal, Self
from urllib.parse import urlsplit, urlunsplit

from harness.faults import FaultPlan, connection_fires
from harness.results import FaultFiring
from harness.spec import NetworkFault

__all__ = ["FaultProxy"]

_CHUNK = 64 * 1024


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (``SO_LINGER`` 0), so the peer sees ``ECONNRESET`` rather than an EOF."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """A TCP proxy on ``127.0.0.1`` in front of ``upstream`` that injects network faults per connection.

    Args:
        upstream: ``(host, port)`` or a URL (``http://127.0.0.1:8000/v1``); the host must be loopback.
        faults: ``(index in the scenario, fault)`` pairs; the first one, in this order, whose targeting
            picks a connection applies to it.
        plan: Where firings are logged (``plan.log``); None logs none (``firings`` still lists them).
        seed: Seeds ``probability`` draws; defaults to the plan's seed, else 0.

    Attributes:
        firings: Every firing of this proxy, in accept order.

    Raises:
        ValueError: the upstream is not a loopback address with a port.

    Example:
        >>> from gym_resilience.envs import ToolServer
        >>> with ToolServer() as server, FaultProxy(server.url) as proxy:  # doctest: +SKIP
        ...     env = ToolUseEnv(proxy.url)  # every tool call now crosses the proxy
    """

    def __init__(
        self,
        upstream: str | tuple[str, int],
        faults: Sequence[tuple[int, NetworkFault]] = (),
        plan: FaultPlan | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        if isinstance(upstream, str):
            parts = urlsplit(upstream)
            host, port = parts.hostname, parts.port
            self._scheme, self._path = parts.scheme or "http", parts.path
        else:
            host, port = upstream
            self._scheme, self._path = "http", ""
        if not host or not port or not _is_loopback(host):
            raise ValueError(f"the upstream must be a loopback host with a port, got {upstream!r}")
        self.upstream: tuple[str, int] = (host, port)
        self.faults = list(faults)
        self.plan = plan
        self.seed = seed if seed is not None else plan.seed if plan is not None else 0
        self.firings: list[FaultFiring] = []
        self._state = _State.NEW
        self._accepted = 0
        self._address: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = 0.0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    # --- The public surface. -------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the proxy listens on."""
        if self._address is None:
            raise RuntimeError("the fault proxy has not been started")
        return self._address

    @property
    def url(self) -> str:
        """The upstream's URL (scheme and path) with the proxy's host and port."""
        host, port = self.address
        return urlunsplit((self._scheme, f"{host}:{port}", self._path, "", ""))

    @property
    def connections(self) -> int:
        """How many client connections were accepted so far."""
        return self._accepted

    @property
    def thread(self) -> threading.Thread | None:
        """The thread running the proxy's loop, for tests that check nothing is left running."""
        return self._thread

    def start(self, timeout: float = 10.0) -> Self:
        """Start listening; returns once the port is bound. A proxy starts once."""
        if self._state is not _State.NEW:
            raise RuntimeError(f"a fault proxy starts once; this one is {self._state.value}")
        self._state = _State.RUNNING
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, name="FaultProxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"the fault proxy did not start within {timeout:g} s")
        if self._error is not None:
            self.stop()
            raise RuntimeError("the fault proxy could not listen") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection and the listening socket, and join the thread; idempotent."""
        was_running, self._state = self._state is _State.RUNNING, _State.STOPPED
        if not was_running or self._thread is None:
            return
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended (a startup failure)
                loop.call_soon_threadsafe(stopping.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the fault proxy's thread did not stop within {timeout:g} s")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        self.stop()
        return False

    # --- The loop thread. ----------------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start() if it is still waiting for it
            self._error = exc
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = server.sockets[0].getsockname()[:2]
        self._address = (str(host), int(port))
        if self._thread is not None:
            self._thread.name = f"FaultProxy-{port}"
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            handlers = list(self._handlers)
            for handler in handlers:
                handler.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await server.wait_closed()
            # Closed transports release their sockets on the loop's next iterations.
            for _ in range(3):
                await asyncio.sleep(0)

    def _choose(self, connection: int) -> tuple[int, NetworkFault] | None:
        for index, fault in self.faults:
            if connection_fires(fault.when, seed=self.seed, fault_index=index, connection=connection):
                return index, fault
        return None

    def _fired(self, index: int, fault: NetworkFault, connection: int) -> None:
        what = {"latency": f"latency {fault.latency_s:g} s", "reset_peer": "reset", "timeout": "timeout"}
        start = self.plan.start if self.plan is not None else self._started
        firing = FaultFiring(
            fault=index,
            kind=fault.kind,
            target=fault.target,
            rollout=None,
            attempt=None,
            turn=None,
            detail=f"{fault.link} connection {connection}: {what[fault.kind]}",
            at_s=time.time() - start,
        )
        if self.plan is not None:
            self.plan.log(firing)
        self.firings.append(firing)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback that spawns the connection's task: stop() cancels that task, and Python
        # 3.11's stream machinery logs a spurious error for a cancelled callback task of its own.
        connection, self._accepted = self._accepted, self._accepted + 1
        handler = asyncio.ensure_future(self._handle(connection, reader, writer))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    async def _handle(
        self, connection: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        chosen = self._choose(connection)
        reset = False
        try:
            if chosen is None:
                reset = await self._forward(reader, writer, delay_s=0.0)
                return
            index, fault = chosen
            self._fired(index, fault, connection)
            if fault.kind == "latency":
                reset = await self._forward(reader, writer, delay_s=fault.latency_s)
            elif fault.kind == "reset_peer":
                await reader.read(_CHUNK)
                reset = True
            else:  # timeout: swallow the request, never answer
                while await reader.read(_CHUNK):
                    pass
        except OSError:
            reset = True
        finally:
            if reset:
                _reset(writer)
            else:
                writer.close()

    async def _forward(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, *, delay_s: float
    ) -> bool:
        """Pipe both directions until both end; True when the client's side should be reset."""
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            return True  # the upstream refused: the client sees a reset, as from a dead server
        outbound = asyncio.ensure_future(_pump(client_reader, upstream_writer, delay_s))
        inbound = asyncio.ensure_future(_pump(upstream_reader, client_writer, delay_s))
        try:
            # When one direction breaks, the other has nothing left to wait for.
            await asyncio.wait({outbound, inbound}, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for pump in (outbound, inbound):
                pump.cancel()
            await asyncio.gather(outbound, inbound, return_exceptions=True)
            upstream_writer.transport.abort()
        for pump in (outbound, inbound):
            error = None if pump.cancelled() else pump.exception()
            if error is not None and not isinstance(error, OSError):
                raise error
        # The upstream broke off (a reset, a SIGKILLed server): pass the breakage on to the client.
        return not inbound.cancelled() and isinstance(inbound.exception(), OSError)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer`` chunk by chunk, each delayed ``delay_s``; pass the EOF on."""
    while chunk := await reader.read(_CHUNK):
        if delay_s:
            await asyncio.sleep(delay_s)
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()
