"""What the isolated-env tests share: envs whose step or reset hangs, the worker process of an env, and a
call timed until it raises."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil
from doubles import Fault, env_fn

from gym_resilience.backends.process import IsolatedEnv
from gym_resilience.backends.resilient import ResilientEnv

HANGING_STEP = env_fn(Fault(kind="hang"))
HANGING_RESET = env_fn(Fault(kind="hang", phase="reset"))


def worker_of(env: ResilientEnv[Any, Any]) -> psutil.Process:
    """The env's worker process (psutil tells a reused pid from the original by its start time)."""
    isolated = env.env
    assert isinstance(isolated, IsolatedEnv)
    return psutil.Process(isolated.pid)


def timed(call: Callable[[], object]) -> tuple[BaseException, float]:
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:
        return exc, time.monotonic() - start
    raise AssertionError("expected the call to raise")
