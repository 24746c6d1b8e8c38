"""A multi-turn tool-use env whose every step is a real HTTP call to the calculator tool.

Why real HTTP: the failures that kill agentic rollouts are network failures (a tool server that
refuses, resets, stalls or dies), and the resilience layer classifies them by their standard types.
So this env lets them surface as they are: ``ConnectionError`` (refused, reset, an HTTP exchange cut
short, a 5xx), ``TimeoutError`` (a socket operation ran past ``timeout``), other ``OSError``s.
Each call opens and closes its own connection, so a fault proxy in between sees one stream per call
and a failed call leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import gymnasium
from gymnasium.error import ClosedEnvironmentError

from gym_resilience.envs.tool_server import ToolServer
from gym_resilience.envs.word_game import (
    ChatMessages,
    EpisodeState,
    check_can_step,
    reply_space,
    task_from_options,
)
from gym_resilience.errors import describe_exception
from gym_resilience.rollout_header import ROLLOUT_HEADER, RolloutIdentity, format_rollout_header
from gym_resilience.tasks import ChatMessage

__all__ = ["FORMAT_REWARD", "SOLVED_REWARD", "ToolUseEnv", "extract_expression"]

SOLVED_REWARD: Final = 1.0
FORMAT_REWARD: Final = 0.1
"""Reward for a reply the calculator could evaluate, right or wrong, as tool-use RL setups often give."""

_EXPRESSION: Final = re.compile(r"[-+*/() \d]*\d[-+*/() \d]*")


def extract_expression(reply: str) -> str:
    """The query sent to the calculator: the first run of digits, operators, parentheses and spaces.

    Deterministic and total: a reply with no digit gives ``""``, which the tool answers with an error,
    so every step still makes its request.
    """
    match = _EXPRESSION.search(reply)
    return match.group().strip() if match else ""


class ToolUseEnv(gymnasium.Env[list[ChatMessage], str]):
    """Make the calculator tool return the target number.

    ``reset`` fetches the tool specs (``GET /tools``) and returns the opening chat messages: the task's
    prompt (or a default question drawn from ``reset``'s ``seed``) with the specs appended to the system
    message. Each ``step`` sends ``extract_expression(reply)`` to ``POST /calculate`` and returns one message
    ``{"role": "tool", "content": <the tool's JSON answer>}``. Reward: ``SOLVED_REWARD`` and
    ``terminated`` when the result equals the target, ``FORMAT_REWARD`` for any other result, 0.0 for
    an error answer; ``truncated`` after ``max_turns`` turns. A step that raises changes no state.

    Args:
        tool_url: ``http://host:port`` of a ``ToolServer``; None starts a private one, stopped by ``close``.
        target: the number to reach; the task's ``env_kwargs["target"]`` wins, else one is drawn.
        max_turns: turns before truncation (the task's ``env_kwargs["max_turns"]`` wins).
        timeout: seconds each socket operation (connect, send, each read) may take; None waits forever.

    Example:
        >>> env = ToolUseEnv(target=42)
        >>> messages, info = env.reset(seed=0)
        >>> env.step("6 * 7")[1:3]
        (1.0, True)
        >>> env.close()
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's own annotation

    def __init__(
        self,
        tool_url: str | None = None,
        *,
        target: int | None = None,
        max_turns: int = 4,
        timeout: float | None = 5.0,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive or None, got {timeout}")
        parts = urlsplit(tool_url or "http://127.0.0.1")
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"tool_url must be http://host:port, got {tool_url!r}")
        self.observation_space = ChatMessages()
        self.action_space = reply_space()
        self._default_target = target
        self._default_max_turns = max_turns
        self._timeout = timeout
        self._state = EpisodeState.NEEDS_RESET
        self._target = 0
        self._max_turns = max_turns
        self._turn = 0
        self._rollout: int | None = None
        self._attempt: int | None = None
        # Started last, so that no invalid argument can leave a private server running.
        self._own_server = ToolServer().start() if tool_url is None else None
        self.tool_url: str = self._own_server.url if self._own_server is not None else str(tool_url)
        parts = urlsplit(self.tool_url)
        self._host, self._port, self._prefix = parts.hostname or "", parts.port or 80, parts.path.rstrip("/")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        """Start an episode; ``options={"task": task}`` supplies the prompt, target and turn limit."""
        if self._state is EpisodeState.CLOSED:
            raise ClosedEnvironmentError("reset() called on a closed environment")
        super().reset(seed=seed)
        self._state = EpisodeState.NEEDS_RESET
        task = task_from_options(options)
        kwargs = task.env_kwargs if task is not None else {}
        question = None
        target = kwargs.get("target", self._default_target)
        if target is None:
            question, target = self._draw_question()
        self._rollout = _option_int(options, "rollout_index")
        self._attempt = _option_int(options, "attempt")
        tools = self._request("GET", "/tools", turn=None)
        if not isinstance(tools, list):
            raise ValueError(f"GET /tools answered {tools!r:.80}, expected a JSON list")
        self._target = int(target)
        self._max_turns = int(kwargs.get("max_turns", self._default_max_turns))
        self._turn = 0
        self._state = EpisodeState.RUNNING
        prompt = task.prompt if task is not None else self._default_prompt(question)
        messages = _with_tools(prompt, json.dumps(tools, sort_keys=True))
        return messages, {"max_turns": self._max_turns, "tools": tools}

    def step(self, action: str) -> tuple[list[ChatMessage], float, bool, bool, dict[str, Any]]:
        """Send the reply's expression to the calculator and score the tool's answer."""
        check_can_step(self._state)
        if not isinstance(action, str):
            raise TypeError(f"the action must be a str, got {type(action).__name__}")
        expression = extract_expression(action)
        answer = self._request("POST", "/calculate", {"expression": expression}, turn=self._turn)
        if not isinstance(answer, dict):
            raise ValueError(f"POST /calculate answered {answer!r:.80}, expected a JSON object")
        self._turn += 1
        result = answer.get("result")
        solved = "result" in answer and result == self._target
        reward = SOLVED_REWARD if solved else FORMAT_REWARD if "result" in answer else 0.0
        truncated = not solved and self._turn >= self._max_turns
        if solved or truncated:
            self._state = EpisodeState.DONE
        observation = [{"role": "tool", "content": json.dumps(answer, sort_keys=True)}]
        info = {"turn": self._turn, "expression": expression, "tool_answer": answer, "solved": solved}
        return observation, reward, solved, truncated, info

    def close(self) -> None:
        """Stop the private tool server, if any; idempotent. Later calls raise ``ClosedEnvironmentError``."""
        self._state = EpisodeState.CLOSED
        if self._own_server is not None:
            self._own_server.stop()

    def _request(self, method: str, path: str, payload: Any = None, *, turn: int | None) -> Any:
        """One HTTP exchange on a fresh connection; failures keep (or get) a standard network type.

        It names its rollout, attempt and turn in the ``x-gym-resilience-rollout`` header, so a fault
        proxy can hit the same calls on every run.
        """
        body = None if payload is None else json.dumps(payload).encode()
        identity = RolloutIdentity(self._rollout, self._attempt, turn)
        headers = {
            "Connection": "close",
            "Accept": "application/json",
            ROLLOUT_HEADER: format_rollout_header(identity),
        }
        if body is not None:
            headers["Content-Type"] = "application/json"
        where = f"{self.tool_url}{path}"
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        watchdog = None
        try:
            connection.connect()
            # The socket timeout bounds the connect and each read; the watchdog bounds the whole
            # exchange, so a server that trickles its answer cannot hold the step past ``timeout``.
            # It holds the socket itself: http.client drops its own reference once the answer is
            # known to end with the connection.
            watchdog = _Watchdog(connection.sock, self._timeout)
            connection.request(method, self._prefix + path, body=body, headers=headers)
            response = connection.getresponse()
            status, data = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            if watchdog is not None and watchdog.fired:
                raise TimeoutError(
                    f"{method} {where}: no complete answer within {self._timeout:g} s"
                ) from exc
            if isinstance(exc, OSError):
                raise  # already ConnectionError / TimeoutError / OSError (RemoteDisconnected included)
            # IncompleteRead, BadStatusLine, ...: the exchange was cut or garbled on the way.
            raise ConnectionError(
                f"{method} {where}: the HTTP exchange broke: {describe_exception(exc)}"
            ) from exc
        finally:
            if watchdog is not None:
                watchdog.cancel()
            connection.close()
        if status >= 500:
            raise ConnectionError(f"{method} {where}: the tool server answered {status}")
        if status != 200:
            raise RuntimeError(f"{method} {where}: the tool server answered {status}: {data[:200]!r}")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ValueError(f"{method} {where}: the answer is not JSON: {data[:200]!r}") from exc

    def _draw_question(self) -> tuple[str, int]:
        a, b = (int(n) for n in self.np_random.integers(2, 100, size=2))
        op = "+-*"[int(self.np_random.integers(3))]
        target = a + b if op == "+" else a - b if op == "-" else a * b
        return f"What is {a} {op} {b}?", target

    def _default_prompt(self, question: str | None) -> list[ChatMessage]:
        ask = question or f"Make the calculator return {self._target}."
        return [
            {"role": "system", "content": "You can use a calculator: write an arithmetic expression."},
            {"role": "user", "content": f"{ask} Use the calculator."},
        ]


class _Watchdog:
    """Cuts ``sock`` once ``timeout`` seconds have passed (None: never), so a blocked read returns."""

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self.fired = False
        self._sock = sock
        self._timer = threading.Timer(timeout, self._cut) if timeout is not None else None
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()

    def _cut(self) -> None:
        self.fired = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()


def _option_int(options: dict[str, Any] | None, key: str) -> int | None:
    value = (options or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _with_tools(prompt: Sequence[ChatMessage], tools_json: str) -> list[ChatMessage]:
    """Copies of ``prompt`` with the tool specs appended to the first system message (or a new one)."""
    addendum = f"Available tools (JSON): {tools_json}"
    messages = [dict(m) for m in prompt]
    for message in messages:
        if message["role"] == "system":
            message["content"] = f"{message['content']}\n\n{addendum}"
            return messages
    return [{"role": "system", "content": addendum}, *messages]
