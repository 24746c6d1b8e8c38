"""Envs that report the worker they ran in and what the envs before them left there, for the worker pool's
tests (an importable module: a worker process or a Ray actor imports these by reference).

``LeavingEnv`` steps once and reports, as numbers in ``info`` (so in ``env_metrics``): its worker's pid,
whether ``LEFT_BY_AN_ENV`` is in the environment, ``MODULE_STATE["steps"]``, the steps that envs of the
same process made before it, and the process state an env can leave to the next (SIGTERM ignored, signals
blocked, an alarm set, the open-files limit, the open file descriptors). Its task's ``env_kwargs["leave"]``
says what it leaves behind at its step: an environment variable, a process, a process in a session of its
own (``sleep`` with the task's ``env_kwargs["marker"]`` as its argument, to find it by), a daemon (the same
``sleep``, double-forked into a session of its own), a thread, one of those process states, a failing
close, a hang, a process in a session of its own and then a hang, or a wait until the file ``marker``
names exists. An env that finds an alarm set waits until it fires, as a longer rollout would.

``LedgerEnv`` is a ``LeavingEnv`` that writes to a ledger file, one line each, every build (its own id,
its worker's pid, its task's instance id and the env workers alive then) and every call of its close.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from gymnasium import spaces

from gym_resilience import Task
from gym_resilience.testing import ScriptableEnv

ENV_VARIABLE = "LEFT_BY_AN_ENV"
MODULE_STATE = {"steps": 0}
"""A module global that envs change: a reused worker keeps it from one env to the next."""
_LEFT_OPEN: list[socket.socket] = []


class LeavingEnv(ScriptableEnv):
    def __init__(self, leave: str, marker: str = "600") -> None:
        super().__init__(observation_space=spaces.Text(32), action_space=spaces.Text(4096))
        self.leave = leave
        self.marker = marker

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        alarm_s = signal.getitimer(signal.ITIMER_REAL)[0]
        info = {
            "pid": float(os.getpid()),
            "saw_variable": float(ENV_VARIABLE in os.environ),
            "module_steps": float(MODULE_STATE["steps"]),
            "sigterm_ignored": float(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN),
            "signals_blocked": float(len(signal.pthread_sigmask(signal.SIG_BLOCK, []))),
            "alarm_s": alarm_s,
            "open_files_limit": float(resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
            "open_fds": float(len(os.listdir("/proc/self/fd"))),
        }
        if alarm_s:
            time.sleep(alarm_s + 1.0)
        MODULE_STATE["steps"] += 1
        if self.leave == "variable":
            os.environ[ENV_VARIABLE] = "1"
        elif self.leave == "signal handler":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif self.leave == "blocked signal":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        elif self.leave == "alarm":
            signal.alarm(5)  # SIGALRM's default action ends the process
        elif self.leave == "resource limit":
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft // 2, hard))
        elif self.leave == "listening socket":
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen()
            _LEFT_OPEN.append(server)
        elif self.leave == "daemon":  # sh starts sleep in the background and exits: init would adopt it
            subprocess.run(["sh", "-c", f"sleep {self.marker} &"], start_new_session=True, check=True)
        elif self.leave == "process":
            subprocess.Popen(["sleep", "600"])
        elif self.leave.startswith("session"):  # a sandbox server started apart, as many envs start one
            subprocess.Popen(["sleep", self.marker], start_new_session=True)
            if self.leave == "session then hang":
                time.sleep(600)
        elif self.leave == "thread":
            threading.Thread(target=time.sleep, args=(600,), name="left-behind", daemon=True).start()
        elif self.leave == "hang":
            time.sleep(600)
        elif self.leave == "wait":  # until the test lets it go on
            while not os.path.exists(self.marker):
                time.sleep(0.01)
        return "done", 1.0, True, False, info

    def close(self) -> None:
        super().close()
        if self.leave == "failing close":
            raise OSError("the sandbox was gone already")


def leaving_env(task: Task) -> LeavingEnv:
    return LeavingEnv(str(task.env_kwargs.get("leave", "")), str(task.env_kwargs.get("marker", "600")))


class LedgerEnv(LeavingEnv):
    def __init__(self, ledger: str, instance_id: str, runner_pid: int, leave: str, marker: str) -> None:
        super().__init__(leave, marker)
        self.ledger = ledger
        self.env_id = uuid.uuid4().hex  # not id(self): a later env of the same worker may get its address
        workers = len(workers_of(runner_pid))
        self.write(f"built {self.env_id} {os.getpid()} {instance_id} {workers}")

    def write(self, line: str) -> None:
        with open(self.ledger, "a") as ledger:  # one short append: whole lines, whichever process writes
            ledger.write(line + "\n")

    def close(self) -> None:
        self.write(f"closed {self.env_id}")
        super().close()


def ledger_env(task: Task) -> LedgerEnv:
    kwargs = task.env_kwargs
    return LedgerEnv(
        str(kwargs["ledger"]),
        task.instance_id,
        int(kwargs["runner_pid"]),
        str(kwargs["leave"]),
        str(kwargs["marker"]),
    )


def ledger_tasks(ledger: Path, *leaves: str, marker: str = "600") -> list[Task]:
    """:func:`leaving_tasks` whose :class:`LedgerEnv` write to ``ledger``, counting the workers of this
    process."""
    return leaving_tasks(*leaves, marker=marker, ledger=str(ledger), runner_pid=os.getpid())


def read_ledger(ledger: Path) -> tuple[list[list[str]], list[str]]:
    """The builds in ``ledger`` (env id, pid, instance id, workers alive), and the env ids of its closes."""
    lines = [line.split() for line in ledger.read_text().splitlines()] if ledger.exists() else []
    builds = [line[1:] for line in lines if line[0] == "built"]
    return builds, [line[1] for line in lines if line[0] == "closed"]


def workers_of(runner_pid: int) -> set[int]:
    """The env worker processes of process ``runner_pid`` alive now: its grandchildren through the fork
    server, zombies not counted."""
    found = set()
    for child in psutil.Process(runner_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.ppid() != runner_pid and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
    return found


def leaving_tasks(*leaves: str, marker: str = "600", **env_kwargs: Any) -> list[Task]:
    """One task per entry: what its env leaves behind ("" for nothing); ``marker``, the argument of the
    ``sleep`` it leaves in a session of its own (or the file it waits for); ``env_kwargs``, more."""
    return [
        Task(
            prompt=[{"role": "user", "content": f"t{i}"}],
            instance_id=f"t{i}",
            env_kwargs={"leave": leave, "marker": marker, **env_kwargs},
        )
        for i, leave in enumerate(leaves)
    ]


@contextlib.contextmanager
def session_sleeps(salt: float) -> Iterator[str]:
    """A marker for the ``sleep`` processes envs leave in sessions of their own (unique to this process
    and ``salt``); any still running at the end are killed."""
    marker = f"{600 + os.getpid() % 1000 / 1000 + salt / 1e5:.6f}"
    try:
        yield marker
    finally:
        for pid in sleeping(marker):
            os.kill(pid, signal.SIGKILL)


def sleeping(marker: str) -> list[int]:
    """The pids of the ``sleep marker`` processes still running (a zombie has ended)."""
    return [
        process.pid
        for process in psutil.process_iter(["cmdline", "status"])
        if process.info["cmdline"] == ["sleep", marker] and process.info["status"] != psutil.STATUS_ZOMBIE
    ]
