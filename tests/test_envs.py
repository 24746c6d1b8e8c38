"""The bundled envs and the tool server: determinism, rewards, episode ends, real sockets, cleanup."""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import socket
import string
import struct
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from typing import Any

import gymnasium
import pytest
from gymnasium.error import ClosedEnvironmentError, ResetNeeded
from gymnasium.utils.env_checker import check_env

import gym_resilience.envs
from gym_resilience.envs import (
    TOOL_USE_ID,
    WORD_GAME_ID,
    ChatMessages,
    ToolServer,
    ToolServerProcess,
    ToolUseEnv,
    WordGameEnv,
    extract_expression,
)
from gym_resilience.envs import tool_server as tool_server_module
from gym_resilience.envs.tool_server import evaluate
from gym_resilience.tasks import Task


def random_replies(seed: int, count: int) -> list[str]:
    """Nonsense like a random-weight model's: short runs of letters, digits and punctuation."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " .,;!?-+*/()'\"\n"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def play(env: gymnasium.Env[Any, str], seed: int, replies: list[str]) -> list[Any]:
    """The whole transcript of one episode: the reset and every step until it ends."""
    transcript: list[Any] = [env.reset(seed=seed)]
    for reply in replies:
        step = env.step(reply)
        transcript.append(step)
        if step[2] or step[3]:
            break
    return transcript


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def tool_server() -> Iterator[ToolServer]:
    with ToolServer() as server:
        yield server


# --- WordGame -----------------------------------------------------------------------------------


def test_word_game_is_deterministic_per_seed() -> None:
    replies = random_replies(0, 8)
    runs = [play(WordGameEnv(), seed, replies) for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    # With one turn, the truncating hint reveals the word drawn from reset's seed.
    secrets = {play(WordGameEnv(max_turns=1), seed, ["?"])[-1][0][0]["content"] for seed in range(10)}
    assert len(secrets) > 1


def test_word_game_gives_random_text_both_zero_and_nonzero_rewards() -> None:
    rewards: list[float] = []
    totals: set[float] = set()
    for seed in range(20):
        steps = play(WordGameEnv(max_turns=8), seed, random_replies(seed, 8))[1:]
        rewards += [reward for _, reward, _, _, _ in steps]
        totals.add(round(sum(reward for _, reward, _, _, _ in steps), 6))
    assert 0.0 in rewards
    assert any(reward > 0.0 for reward in rewards)
    assert len(totals) > 2


def test_word_game_letter_rewards_sum_to_one_when_solved() -> None:
    env = WordGameEnv(secret="abba", max_turns=5)
    env.reset(seed=0)
    first = env.step("A!")
    second = env.step("a... b")
    assert first[1:4] == (0.5, False, False)
    assert first[0] == [{"role": "user", "content": "Yes, 'a' is in the word. Word: a _ _ a (4 turns left)."}]
    assert second[1:4] == (0.5, True, False)
    assert second[4] == {"turn": 2, "guess": "b", "board": "a b b a", "solved": True}


def test_word_game_terminates_when_the_reply_names_the_word() -> None:
    env = WordGameEnv(secret="cab", max_turns=4)
    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("Is it CAB?")
    assert (reward, terminated, truncated, info["guess"]) == (1.0, True, False, "cab")


def test_word_game_truncates_after_max_turns_and_not_before() -> None:
    env = WordGameEnv(secret="zzz", max_turns=3)
    env.reset(seed=0)
    flags = [env.step(reply)[2:4] for reply in ("x", "y", "...")]
    assert flags == [(False, False), (False, False), (False, True)]


def test_word_game_step_after_the_episode_ended_raises_reset_needed() -> None:
    env = WordGameEnv(secret="cab", max_turns=1)
    with pytest.raises(ResetNeeded, match=r"call reset\(\) before step\(\)"):
        env.step("a")
    env.reset(seed=0)
    env.step("q")
    with pytest.raises(ResetNeeded, match="the episode has ended"):
        env.step("a")


def test_word_game_reset_returns_the_task_prompt_with_the_board_and_uses_its_secret() -> None:
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Guess my word."}]
    task = Task(prompt=prompt, instance_id="t-0", env_kwargs={"secret": "tree", "max_turns": 2})
    env = WordGameEnv()
    messages, info = env.reset(seed=0, options={"task": task})
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Guess my word.\n\nWord: _ _ _ _ (4 letters, 2 turns)."},
    ]
    assert prompt[1]["content"] == "Guess my word."
    assert info == {"max_turns": 2}
    assert env.step("tree")[2] is True


def test_word_game_rejects_a_secret_that_is_not_lowercase_letters() -> None:
    with pytest.raises(ValueError, match="the secret must be lowercase ASCII letters, got 'Tree'"):
        WordGameEnv(secret="Tree")


def test_word_game_after_close_raises_closed_environment_error() -> None:
    env = WordGameEnv()
    env.reset(seed=0)
    env.close()
    env.close()
    with pytest.raises(ClosedEnvironmentError):
        env.step("a")
    with pytest.raises(ClosedEnvironmentError):
        env.reset(seed=0)


def test_chat_messages_space_contains_observations_and_rejects_other_shapes() -> None:
    space = ChatMessages(seed=0)
    assert [{"role": "tool", "content": "{}"}] in space
    assert space.sample() in space
    assert ({"role": "user", "content": "hi"},) not in space
    assert [{"role": "user", "content": "hi", "extra": "x"}] not in space
    assert [{"role": "narrator", "content": "hi"}] not in space
    assert [{"role": "user", "content": 3}] not in space


# --- Registration -------------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", [WORD_GAME_ID, TOOL_USE_ID])
def test_registered_envs_pass_gymnasium_check_env_without_warnings(env_id: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = gymnasium.make(env_id)
        try:
            env.reset(seed=0)
            env.step("3 + 4 and some letters")
            check_env(env.unwrapped)
            assert env.spec is not None and env.spec.id == env_id
        finally:
            env.close()


def test_importing_the_envs_again_registers_them_once_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(gym_resilience.envs)
    assert {WORD_GAME_ID, TOOL_USE_ID} <= set(gymnasium.registry)


# --- ToolUse ------------------------------------------------------------------------------------


def test_tool_use_step_returns_the_tool_answer_from_a_real_server(tool_server: ToolServer) -> None:
    env = ToolUseEnv(tool_server.url, target=444, timeout=5.0)
    messages, info = env.reset(seed=0)
    calls = tool_server.calls
    obs, reward, terminated, truncated, step_info = env.step("let me compute 37*12+0 first")
    assert tool_server.calls == calls + 1
    assert obs == [{"role": "tool", "content": '{"expression": "37*12+0", "result": 444}'}]
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert step_info["tool_answer"] == {"expression": "37*12+0", "result": 444}
    assert "calculator" in messages[0]["content"]
    assert info["tools"][0]["name"] == "calculator"


def test_tool_use_scores_wrong_results_and_errors_and_truncates(tool_server: ToolServer) -> None:
    env = ToolUseEnv(tool_server.url, target=10, max_turns=3)
    env.reset(seed=0)
    wrong = env.step("2+3")
    error = env.step("no numbers here")
    last = env.step("1/0")
    assert wrong[1:4] == (0.1, False, False)
    assert error[1:4] == (0.0, False, False)
    assert json.loads(error[0][0]["content"]) == {"expression": "", "error": "empty expression"}
    assert last[1:4] == (0.0, False, True)


def test_tool_use_is_deterministic_per_seed(tool_server: ToolServer) -> None:
    replies = random_replies(1, 4)
    runs = [play(ToolUseEnv(tool_server.url), seed, replies) for seed in (3, 3)]
    assert runs[0] == runs[1]
    questions = {play(ToolUseEnv(tool_server.url), seed, [])[0][0][1]["content"] for seed in range(5)}
    assert len(questions) > 1


def test_tool_use_gives_random_text_both_zero_and_nonzero_rewards(tool_server: ToolServer) -> None:
    env = ToolUseEnv(tool_server.url, max_turns=50)
    steps = play(env, 0, random_replies(2, 50))[1:]
    rewards = {reward for _, reward, _, _, _ in steps}
    assert 0.0 in rewards
    assert any(reward > 0.0 for reward in rewards)


def test_tool_use_step_against_a_stopped_server_raises_connection_error() -> None:
    server = ToolServer().start()
    env = ToolUseEnv(server.url, target=1)
    env.reset(seed=0)
    server.stop()
    with pytest.raises(ConnectionRefusedError):
        env.step("1")
    with pytest.raises(ConnectionRefusedError):
        env.reset(seed=0)


def test_a_failed_tool_step_leaves_the_episode_where_it_was() -> None:
    body = b'{"expression": "1", "result": 1}'
    answer = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    url, thread = _raw_server([_TOOLS_OK, None, answer])
    env = ToolUseEnv(url, target=1, max_turns=1)
    env.reset(seed=0)
    with pytest.raises(ConnectionError):
        env.step("1")
    _, reward, terminated, _, info = env.step("1")
    assert (reward, terminated, info["turn"]) == (1.0, True, 1)
    thread.join(5.0)


def _raw_server(responses: list[bytes | None]) -> tuple[str, threading.Thread]:
    """A listener answering one connection per canned response: bytes to send, or None to reset.

    It gives up after 10 s without a client, so a failing test leaves no thread blocked in accept().
    """
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10.0)

    def serve() -> None:
        with listener:
            for response in responses:
                try:
                    connection, _ = listener.accept()
                except TimeoutError:
                    return
                with connection, connection.makefile("rb") as reader:
                    length = 0
                    while (line := reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":", 1)[1])
                    reader.read(length)
                    if response is None:
                        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    else:
                        connection.sendall(response)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


_TOOLS_OK = b'HTTP/1.0 200 OK\r\nContent-Length: 24\r\n\r\n[{"name": "calculator"}]'


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(b'HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n{"resu', id="truncated body"),
        pytest.param(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", id="503"),
        pytest.param(b"garbage\r\n\r\n", id="not http"),
        pytest.param(None, id="connection reset"),
    ],
)
def test_tool_use_step_turns_broken_exchanges_into_connection_error(broken: bytes | None) -> None:
    url, thread = _raw_server([_TOOLS_OK, broken])
    env = ToolUseEnv(url, target=1, timeout=5.0)
    env.reset(seed=0)
    with pytest.raises(ConnectionError):
        env.step("1")
    thread.join(5.0)
    assert not thread.is_alive()


@pytest.mark.slow
def test_tool_use_step_against_a_paused_server_process_raises_timeout_error() -> None:
    with ToolServerProcess() as server:
        env = ToolUseEnv(server.url, target=1, timeout=0.3)
        env.reset(seed=0)
        server.process.send_signal(signal.SIGSTOP)
        with pytest.raises(TimeoutError):
            env.step("1")
    assert server.process.returncode == 0


def test_tool_use_leaves_no_client_socket_open_after_its_steps() -> None:
    with ToolServer() as server:
        env = ToolUseEnv(server.url)
        before = open_fds()
        play(env, 0, ["1+1"] * 4)
        env.close()
    # Stopping the server joined its handler threads, so any fd still open now is a client's.
    assert open_fds() - before == set()


def test_tool_use_close_stops_its_private_server_and_releases_everything() -> None:
    threads_before, fds_before = set(threading.enumerate()), open_fds()
    env = ToolUseEnv()
    play(env, 0, ["1+1", "2*3"])
    port = int(env.tool_url.rsplit(":", 1)[1])
    env.close()
    env.close()
    assert set(threading.enumerate()) - threads_before == set()
    assert open_fds() - fds_before == set()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    with pytest.raises(ClosedEnvironmentError):
        env.reset(seed=0)


def test_extract_expression_takes_the_first_arithmetic_run() -> None:
    assert extract_expression("so 37 * (2+1) = ?") == "37 * (2+1)"
    assert extract_expression("abc") == ""
    assert extract_expression("x-5y") == "-5"


# --- ToolServer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "answer"),
    [
        ("2 + 3 * 4", {"result": 14}),
        ("7/2", {"result": 3.5}),
        ("-(6/3)", {"result": -2}),
        ("1/0", {"error": "division by zero"}),
        ("  ", {"error": "empty expression"}),
        ("2**3", {"error": "invalid expression"}),
        ("__import__('os')", {"error": "invalid expression"}),
        ("99999999 * 99999999", {"error": "result out of range"}),
        ("1" * 201, {"error": "expression longer than 200 characters"}),
    ],
)
def test_calculator_evaluates_arithmetic_and_reports_errors(expression: str, answer: dict[str, Any]) -> None:
    assert evaluate(expression) == {"expression": expression, **answer}


def test_tool_server_answers_http_and_rejects_bad_requests(tool_server: ToolServer) -> None:
    with urllib.request.urlopen(f"{tool_server.url}/health", timeout=5) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    request = urllib.request.Request(f"{tool_server.url}/calculate", data=b'{"expr": 1}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=5)
    assert error.value.code == 400
    error.value.close()


def test_tool_server_stop_joins_its_thread_and_closes_its_socket() -> None:
    threads_before = set(threading.enumerate())
    with ToolServer() as server:
        port = int(server.url.rsplit(":", 1)[1])
        thread = server.thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()
    assert set(threading.enumerate()) - threads_before == set()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    server.stop()
    with pytest.raises(RuntimeError, match="a tool server starts once; this one is stopped"):
        server.start()


@pytest.mark.slow
def test_tool_server_process_answers_then_dies_on_sigkill_leaving_no_process() -> None:
    with ToolServerProcess() as server:
        env = ToolUseEnv(server.url, target=3)
        env.reset(seed=0)
        assert env.step("1+2")[1] == 1.0
        env.reset(seed=0)
        server.process.kill()
        server.process.wait(10)
        with pytest.raises(ConnectionError):
            env.step("1+2")
    assert server.process.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(server.process.pid, 0)


@pytest.mark.slow
def test_tool_server_process_exits_cleanly_on_sigterm() -> None:
    with ToolServerProcess() as server, urllib.request.urlopen(f"{server.url}/tools", timeout=5) as response:
        assert json.loads(response.read())[0]["name"] == "calculator"
    assert server.process.returncode == 0
    assert server.process.stdout is not None and server.process.stdout.closed


@pytest.mark.slow
def test_a_with_block_whose_start_is_interrupted_stops_the_child_it_already_spawned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted_wait(*_args: Any) -> Any:
        raise KeyboardInterrupt  # Ctrl-C while start() waits for the child's URL

    monkeypatch.setattr(tool_server_module.select, "select", interrupted_wait)
    server = ToolServerProcess()
    with pytest.raises(KeyboardInterrupt), server:
        pytest.fail("the block never runs")  # pragma: no cover
    assert server.process.poll() is not None  # stopped and reaped, not left serving
