"""A loopback TCP fault proxy: real network faults between a client and its server.

In the spirit of toxiproxy: ``FaultProxy`` listens on ``127.0.0.1`` (an ephemeral port) and forwards
each accepted connection to the one upstream it was given. It reads the HTTP/1.1 requests that cross
it, one by one (keep-alive included), and applies at most one network fault per request, chosen by
the rollout the request names in its ``x-gym-resilience-rollout`` header (see ``ConnectionTargeting``):
the same requests are hit on every run, whatever order their connections arrive in. A fault with
``nth_connection`` is decided per TCP connection instead, in accept order (0-based).

- ``latency``: every chunk of the request and of its answer is delayed ``latency_s``;
- ``reset_peer``: the proxy reads the request's head (so the client has sent its request: a reset
  mid-request), sends nothing upstream, and closes the client socket with ``SO_LINGER`` 0, which sends
  a TCP RST: the client sees ``ConnectionResetError`` (``ECONNRESET``), or ``BrokenPipeError`` if it
  was still sending;
- ``timeout``: the proxy reads and discards what the client sends and never answers, keeping the
  socket open until the client gives up (its own timeout fires) or the proxy stops.

Without a fault the bytes are forwarded unchanged, both directions at once, half-closes included;
traffic that is not HTTP/1.x (or a chunked request body) passes through as it is. If the upstream
refuses, the client's connection is reset, as a dead server's would be.

The proxy runs its own asyncio loop in a background thread, so it works beside any client, synchronous
(``http.client`` in the tool env) or asynchronous (``httpx`` in the served engine). It only ever
connects to its upstream, which must be a loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import ipaddress
import re
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Self
from urllib.parse import urlsplit, urlunsplit

from gym_resilience.lifecycle import Service
from gym_resilience.rollout_header import ROLLOUT_HEADER, RolloutIdentity, parse_rollout_header
from harness.faults.events import FaultFiring
from harness.faults.injectors import check_table
from harness.faults.plan import FaultPlan, connection_fires, request_fires
from harness.scenario.spec import NetworkFault

__all__ = ["NETWORK_INJECTORS", "FaultProxy", "NetworkInjector", "RequestHead", "parse_request_head"]

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


class FaultProxy(Service):
    """A TCP proxy on ``127.0.0.1`` in front of ``upstream`` that injects network faults per connection.

    Args:
        upstream: ``(host, port)`` or a URL (``http://127.0.0.1:8000/v1``); the host must be loopback.
        faults: ``(index in the scenario, fault)`` pairs; the first one, in this order, whose targeting
            picks a connection applies to it.
        plan: Where firings are reported (``plan.report``); None reports none (``firings`` still lists
            them).
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

    def _choose_request(self, identity: RolloutIdentity | None) -> tuple[int, NetworkFault] | None:
        for index, fault in self.faults:
            if request_fires(fault.when, seed=self.seed, fault_index=index, identity=identity):
                return index, fault
        return None

    def _fired(self, index: int, fault: NetworkFault, where: str, identity: RolloutIdentity | None) -> None:
        start = self.plan.start if self.plan is not None else self._started
        identity = identity or RolloutIdentity()
        firing = FaultFiring(
            fault=index,
            kind=fault.kind,
            target=fault.target,
            rollout=identity.rollout,
            attempt=identity.attempt,
            turn=identity.turn,
            detail=f"{fault.link} {where}: {NETWORK_INJECTORS[fault.kind].what(fault)}",
            at_s=time.time() - start,
        )
        if self.plan is not None:
            self.plan.report(firing)
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
                requests = functools.partial(self._requests, connection)
                reset = await self._forward(reader, writer, _Delay(), requests)
                return
            index, fault = chosen
            self._fired(index, fault, f"connection {connection}", None)
            reset = await NETWORK_INJECTORS[fault.kind].on_connection(self, reader, writer, fault)
        except (OSError, _ResetClient):
            reset = True
        finally:
            if reset:
                _reset(writer)
            else:
                writer.close()

    async def _forward(
        self,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        delay: _Delay,
        outbound_pump: _Pump,
    ) -> bool:
        """Pipe both directions until both end; True when the client's side should be reset."""
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            return True  # the upstream refused: the client sees a reset, as from a dead server
        outbound = asyncio.ensure_future(outbound_pump(client_reader, upstream_writer, delay))
        inbound = asyncio.ensure_future(_pump(upstream_reader, client_writer, delay))
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

    async def _requests(
        self, connection: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: _Delay
    ) -> None:
        """Forward the client's HTTP/1.1 requests one by one, deciding each one's fault by its rollout.

        Traffic that does not start as an HTTP request is decided once, as a request naming no
        rollout, and passed on as it is; so is everything after a request this cannot frame (a
        chunked body, a head over 64 KiB).
        """
        buffer = bytearray(await reader.read(_CHUNK))
        if buffer and not _HTTP_START.match(buffer):
            where = f"connection {connection}"
            if await self._apply(self._choose_request(None), where, None, reader, delay):
                await _send(writer, bytes(buffer), delay.s)
                await _pump(reader, writer, delay)
                return
            buffer.clear()  # swallowed: the loop below has nothing to forward
        while buffer:
            while (end := buffer.find(b"\r\n\r\n")) < 0 and len(buffer) <= _CHUNK:
                if not (more := await reader.read(_CHUNK)):
                    break
                buffer += more
            request = parse_request_head(bytes(buffer[: end + 4])) if end >= 0 else None
            if request is None:
                await _send(writer, bytes(buffer), delay.s)
                await _pump(reader, writer, delay)
                return
            where = f"{request.method} {request.path}"
            if not await self._apply(
                self._choose_request(request.identity), where, request.identity, reader, delay
            ):
                break
            if request.chunked:
                await _send(writer, bytes(buffer), delay.s)
                await _pump(reader, writer, delay)
                return
            size = end + 4 + request.content_length
            while len(buffer) < size and (more := await reader.read(_CHUNK)):
                buffer += more
            await _send(writer, bytes(buffer[:size]), delay.s)
            del buffer[:size]
            if not buffer:
                buffer += await reader.read(_CHUNK)
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()

    async def _apply(
        self,
        chosen: tuple[int, NetworkFault] | None,
        where: str,
        identity: RolloutIdentity | None,
        reader: asyncio.StreamReader,
        delay: _Delay,
    ) -> bool:
        """Apply a request's fault; False when nothing more is to be forwarded (a swallowed request)."""
        delay.s = 0.0
        if chosen is None:
            return True
        index, fault = chosen
        self._fired(index, fault, where, identity)
        return await NETWORK_INJECTORS[fault.kind].on_request(reader, delay, fault)


class _ResetClient(Exception):
    """A request-level ``reset_peer`` fired: the client's connection is reset."""


@dataclass
class _Delay:
    """The delay each chunk of a connection gets now; request-level latency changes it per request."""

    s: float = 0.0


_Pump = Callable[[asyncio.StreamReader, asyncio.StreamWriter, _Delay], Awaitable[None]]


@dataclass(frozen=True)
class NetworkInjector:
    """What a network fault kind does: to a whole connection (``nth_connection``; True: reset the
    client's side), and to one request (False: forward nothing more), and how a firing describes it."""

    what: Callable[[NetworkFault], str]
    on_connection: Callable[
        [FaultProxy, asyncio.StreamReader, asyncio.StreamWriter, NetworkFault], Awaitable[bool]
    ]
    on_request: Callable[[asyncio.StreamReader, _Delay, NetworkFault], Awaitable[bool]]


async def _latent_connection(
    proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fault: NetworkFault
) -> bool:
    return await proxy._forward(reader, writer, _Delay(fault.latency_s), _pump)


async def _latent_request(reader: asyncio.StreamReader, delay: _Delay, fault: NetworkFault) -> bool:
    delay.s = fault.latency_s
    return True


async def _reset_connection(
    proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fault: NetworkFault
) -> bool:
    await reader.read(_CHUNK)  # the client has sent its request: a reset mid-request
    return True


async def _reset_request(reader: asyncio.StreamReader, delay: _Delay, fault: NetworkFault) -> bool:
    raise _ResetClient


async def _silent_connection(
    proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fault: NetworkFault
) -> bool:
    await _discard(reader)  # swallow the request, never answer
    return False


async def _silent_request(reader: asyncio.StreamReader, delay: _Delay, fault: NetworkFault) -> bool:
    await _discard(reader)
    return False


NETWORK_INJECTORS: Final[Mapping[str, NetworkInjector]] = {
    "latency": NetworkInjector(lambda f: f"latency {f.latency_s:g} s", _latent_connection, _latent_request),
    "reset_peer": NetworkInjector(lambda f: "reset", _reset_connection, _reset_request),
    "timeout": NetworkInjector(lambda f: "timeout", _silent_connection, _silent_request),
}
"""What each network fault kind does to the connection or request it hits."""
check_table("network", NETWORK_INJECTORS)


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the proxy reads of an HTTP/1.1 request head to frame the request and target faults."""

    method: str
    path: str
    content_length: int
    chunked: bool
    identity: RolloutIdentity | None


_REQUEST_LINE: Final = re.compile(r"([A-Z]+) (\S+) HTTP/1\.[01]")
_HTTP_START: Final = re.compile(rb"[A-Z]{1,16}( |$)")


def parse_request_head(head: bytes) -> RequestHead | None:
    """The request in ``head`` (through the blank line), or None if it is not an HTTP/1.x request."""
    lines = head.decode("latin-1").split("\r\n")
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length", "0")
    if not length.isdigit():
        return None
    rollout = headers.get(ROLLOUT_HEADER)
    return RequestHead(
        method=match.group(1),
        path=match.group(2),
        content_length=int(length),
        chunked="chunked" in headers.get("transfer-encoding", "").lower(),
        identity=parse_rollout_header(rollout) if rollout is not None else None,
    )


async def _send(writer: asyncio.StreamWriter, data: bytes, delay_s: float) -> None:
    if not data:
        return
    if delay_s:
        await asyncio.sleep(delay_s)
    writer.write(data)
    await writer.drain()


async def _discard(reader: asyncio.StreamReader) -> None:
    """Read and drop what the client sends until it gives up: a request that is never answered."""
    while await reader.read(_CHUNK):
        pass


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: _Delay) -> None:
    """Copy ``reader`` to ``writer`` chunk by chunk, each delayed ``delay.s``; pass the EOF on."""
    while chunk := await reader.read(_CHUNK):
        await _send(writer, chunk, delay.s)
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()
