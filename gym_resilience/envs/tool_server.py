"""A small calculator tool served over loopback HTTP, for the ``ToolUse`` env.

Why a real server: the resilience layer must be exercised by real network failures (refused
connections, resets, timeouts, a SIGKILLed or paused process), and only a real socket produces them.
The server runs in a thread (``ToolServer``) or as its own process (``ToolServerProcess``, or
``python -m gym_resilience.envs.tool_server --port N``, which prints its URL on stdout).

Endpoints (JSON in, JSON out, one request per connection):
    GET  /tools       the tool specs, for the prompt
    GET  /health      ``{"status": "ok"}``
    POST /calculate   ``{"expression": "3 * (4 + 5)"}`` -> ``{"expression": ..., "result": 27}``, or
                      ``{"expression": ..., "error": "..."}`` with status 200: a bad expression is
                      the tool's answer to the agent, not a protocol failure.
"""

from __future__ import annotations

import argparse
import ast
import enum
import json
import logging
import operator
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, Final, Self

from gym_resilience.lifecycle import Service

__all__ = ["TOOL_SPECS", "ToolServer", "ToolServerProcess", "evaluate", "main"]

_log = logging.getLogger(__name__)

TOOL_SPECS: Final = (
    {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {"expression": "string"},
    },
)
MAX_EXPRESSION_CHARS: Final = 200
MAX_BODY_BYTES: Final = 64 * 1024
MAX_RESULT: Final = 10**12

_OPERATORS: Final[dict[type[ast.AST], Callable[[Any, Any], Any]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate(expression: str) -> dict[str, Any]:
    """The calculator: ``{"expression", "result"}`` or ``{"expression", "error"}``, never an exception.

    Walks the AST itself instead of calling ``eval``: only integer literals, + - * / and unary signs
    are allowed, so no input can run code or grow without bound (no ``**``, and a length limit).
    """
    answer: dict[str, Any] = {"expression": expression}
    if not expression.strip():
        return answer | {"error": "empty expression"}
    if len(expression) > MAX_EXPRESSION_CHARS:
        return answer | {"error": f"expression longer than {MAX_EXPRESSION_CHARS} characters"}
    try:
        value = _evaluate_node(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return answer | {"error": "division by zero"}
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        return answer | {"error": "invalid expression"}
    if abs(value) > MAX_RESULT:
        return answer | {"error": "result out of range"}
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return answer | {"result": value}


def _evaluate_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        result: int | float = _OPERATORS[type(node.op)](_evaluate_node(node.left), _evaluate_node(node.right))
        return result
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0), so a fault proxy sees one TCP stream per tool call."""

    server_version = "gym-resilience-tool/1"
    server: _Server

    def setup(self) -> None:
        # A client that stalls mid-request (a paused peer, a proxy holding the stream) must not pin a
        # handler thread forever: stop() joins handler threads.
        super().setup()
        self.connection.settimeout(self.server.request_timeout)

    def do_GET(self) -> None:
        if self.path == "/tools":
            self._reply(200, list(TOOL_SPECS))
        elif self.path == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": f"no such endpoint: {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/calculate":
            self._reply(404, {"error": f"no such endpoint: {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            self._reply(400, {"error": f"the body must be 1 to {MAX_BODY_BYTES} bytes of JSON"})
            return
        try:
            request = json.loads(self.rfile.read(length))
        except ValueError:
            request = None
        if not (isinstance(request, dict) and isinstance(request.get("expression"), str)):
            self._reply(400, {"error": 'expected a JSON object {"expression": "<string>"}'})
            return
        with self.server.lock:
            self.server.calls += 1
        self._reply(200, evaluate(request["expression"]))

    def _reply(self, status: int, payload: Any) -> None:
        body = json.dumps(payload, sort_keys=True).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    # Non-daemon handler threads with block_on_close: server_close() joins them, so stop() leaves no
    # thread behind; request_timeout bounds how long that join can take.
    daemon_threads = False
    block_on_close = True

    def __init__(self, address: tuple[str, int], request_timeout: float | None) -> None:
        super().__init__(address, _Handler)
        self.request_timeout = request_timeout
        self.lock = threading.Lock()
        self.calls = 0

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanishes mid-request is routine under network faults, not a server bug.
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            _log.debug("client %s went away: %r", client_address, error)
        else:
            _log.exception("tool request from %s failed", client_address)


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class ToolServer(Service):
    """The calculator tool on a loopback port, served from a background thread.

    Example:
        >>> with ToolServer() as server:
        ...     server.url.startswith("http://127.0.0.1:")
        True
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, request_timeout: float | None = 10.0
    ) -> None:
        """``port=0`` picks a free ephemeral port; ``request_timeout`` bounds a stalled client's read."""
        self._address = (host, port)
        self._request_timeout = request_timeout
        self._state = _State.NEW
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        if self._server is None:
            raise RuntimeError("the tool server has not been started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def calls(self) -> int:
        """How many /calculate requests were answered: proof that requests crossed the socket."""
        return 0 if self._server is None else self._server.calls

    @property
    def thread(self) -> threading.Thread | None:
        """The serving thread, for tests that check nothing is left running."""
        return self._thread

    def start(self) -> Self:
        """Bind the socket and serve in a thread; a server starts once."""
        if self._state is not _State.NEW:
            raise RuntimeError(f"a tool server starts once; this one is {self._state.value}")
        self._server = _Server(self._address, self._request_timeout)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"ToolServer-{self._server.server_address[1]}",
            daemon=True,
        )
        self._thread.start()
        self._state = _State.RUNNING
        return self

    def stop(self) -> None:
        """Stop serving, join the threads and close the socket; idempotent."""
        was_running, self._state = self._state is _State.RUNNING, _State.STOPPED
        if not was_running or self._server is None or self._thread is None:
            return
        try:
            self._server.shutdown()
            self._thread.join()
        finally:
            self._server.server_close()


class ToolServerProcess(Service):
    """The tool server as a child process, so tests can SIGKILL, SIGSTOP or SIGTERM it.

    Example:
        >>> with ToolServerProcess() as server:
        ...     server.url.startswith("http://127.0.0.1:")
        True
    """

    def __init__(self, port: int = 0, *, startup_timeout: float = 30.0) -> None:
        self._port = port
        self._startup_timeout = startup_timeout
        self._process: subprocess.Popen[str] | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port`` as the child printed it."""
        if self._url is None:
            raise RuntimeError("the tool server process has not been started")
        return self._url

    @property
    def process(self) -> subprocess.Popen[str]:
        """The child, for sending it signals."""
        if self._process is None:
            raise RuntimeError("the tool server process has not been started")
        return self._process

    def start(self) -> Self:
        """Spawn the child and wait until it prints its URL (it is serving by then)."""
        if self._process is not None:
            raise RuntimeError("a tool server process starts once")
        # The child must import this same checkout, wherever the parent was started from.
        root = str(Path(__file__).resolve().parents[2])
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "gym_resilience.envs.tool_server", "--port", str(self._port)]
        self._process = process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        stdout = process.stdout
        ready = stdout is not None and select.select([stdout], [], [], self._startup_timeout)[0]
        line = stdout.readline().strip() if stdout is not None and ready else ""
        if not line.startswith("http://"):
            self.stop()
            raise RuntimeError(f"the tool server process did not start (first line: {line!r})")
        self._url = line
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the child, SIGKILL it after ``timeout`` seconds, and reap it; idempotent.

        A stopped (SIGSTOPped) child cannot handle SIGTERM, so it is continued first.
        """
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; print the URL first so a parent knows where to connect."""
    parser = argparse.ArgumentParser(prog="python -m gym_resilience.envs.tool_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--request-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    stopping = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with ToolServer(args.host, args.port, request_timeout=args.request_timeout) as server:
        print(server.url, flush=True)
        while not stopping.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
