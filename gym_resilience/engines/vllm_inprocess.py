"""``InProcessVLLMEngine``: vLLM's engine driven in this process from one thread of its own.

``VLLMEngine`` runs vLLM's async engine, whose core (scheduler and model) lives in a child process that
imports vLLM and torch all over again. This engine runs the core in this process instead, as vLLM's
offline ``LLM.generate`` does: one thread adds requests, steps the engine and hands finished outputs
back to the event loop through futures. On CPU it starts in about a quarter of the time (7 s rather
than 27 s warm, 1.6 s eager) and shuts down in 1 s rather than 3, at the same throughput within the
noise of a shared 2-core machine (README, Benchmarks). It keeps ``VLLMEngine``'s guarantees: cancelling
``generate`` aborts the request in vLLM (deadlines are cancellations), ``aclose`` aborts what is in
flight and leaves no thread behind, and failures are the same typed errors.

``make_vllm_engine`` (``engines/local.py``) picks the engine for the platform: this one on CPU.

Example:
    >>> async with InProcessVLLMEngine(build_tiny_model()) as engine:  # doctest: +SKIP
    ...     generation = await engine.generate(engine.tokenizer.encode("Hello"), Sampling(max_tokens=8))
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gym_resilience.cleanup import finish
from gym_resilience.engines.base import Generation, Sampling
from gym_resilience.engines.common import EngineState
from gym_resilience.engines.vllm_common import (
    LocalVLLMEngine,
    batch_usage,
    engine_args,
    map_vllm_errors,
    sampling_params,
    to_generation,
    tokens_prompt,
    vllm_platform,
)
from gym_resilience.errors import EngineDeadError, EngineError, UnsupportedConfigError

__all__ = ["InProcessVLLMEngine"]

logger = logging.getLogger(__name__)

# How long ``aclose`` waits for the engine thread to finish its step and shut vLLM down.
_JOIN_TIMEOUT_S = 60.0

BURST_MAX_S = 0.025
"""The longest an idle engine waits for the event loop to finish the pass that sent it a request."""


# --- What the event loop sends the engine thread. -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: Any
    params: Any
    future: asyncio.Future[Any]


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str
    done: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Stop

# What the engine thread hands back to the loop: a future and its result (an exception to raise).
_Delivery = list[tuple[asyncio.Future[Any], Any]]


class _Driver:
    """The engine thread: builds vLLM's ``LLMEngine``, then adds, aborts and steps until told to stop.

    Everything vLLM does happens on this one thread; the event loop only submits commands and awaits
    futures that this thread resolves (one ``call_soon_threadsafe`` per step). Every future submitted
    is resolved, whatever happens: a command that finds the thread gone is refused at ``submit``.
    """

    def __init__(
        self, build: Callable[[], Any], loop: asyncio.AbstractEventLoop, cpu_threads: int | None
    ) -> None:
        self._build = build
        self.loop = loop
        self._cpu_threads = cpu_threads
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._accepting = True
        # Passes of the event loop that submitted commands, numbered: begun (the loop's own count) and
        # ended, once the loop ran every callback that was ready when the pass's first command came.
        self._passes = threading.Condition()
        self._passes_begun = 0
        self._passes_ended = 0
        self._pass_pending = False  # an end of pass is scheduled on the loop (the loop's own flag)
        self._taken: collections.deque[_Command] = collections.deque()  # off the queue, not yet run
        self._futures: dict[str, asyncio.Future[Any]] = {}
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.engine: Any = None  # vLLM's LLMEngine while the thread serves, for inspection
        self.unfinished = 0
        self.dead = False
        self.thread = threading.Thread(target=self._run, name="gym-resilience-vllm", daemon=True)

    def submit(self, command: _Command) -> bool:
        """Queue ``command`` for the thread; False when the thread no longer takes commands (event loop
        thread only)."""
        with self._lock:
            if not self._accepting:
                return False
            if not self._pass_pending and not isinstance(command, _Stop):
                self._begin_pass()
            self._commands.put(command)
        return True

    def _begin_pass(self) -> None:
        """Schedule the end of this pass of the event loop, counted before its first command is queued
        (the thread that takes the command sees its pass)."""
        try:
            # Runs once every callback ready now has: the other requests of this pass are queued by then.
            self.loop.call_soon(self._end_pass, self._passes_begun + 1)
        except RuntimeError:  # the loop is closed: no pass to wait for (closing from another loop)
            return
        self._pass_pending = True
        self._passes_begun += 1

    def _end_pass(self, number: int) -> None:
        self._pass_pending = False
        with self._passes:
            self._passes_ended = number
            self._passes.notify_all()

    def _run(self) -> None:
        try:
            if self._cpu_threads is not None:
                # torch._C's is the real setter: vLLM's CPU worker replaces torch.set_num_threads with a
                # no-op once started.
                import torch

                torch._C.set_num_threads(self._cpu_threads)
            engine = self._build()
        except BaseException as exc:
            self._refuse_commands(None)
            self.ready.set_exception(exc)
            return
        self.engine = engine
        self.ready.set_result(None)
        outcome: EngineDeadError | None = None
        try:
            self._serve(engine)
        except Exception as exc:
            self.dead = True
            logger.error(
                "the vLLM engine thread failed; its requests fail with EngineDeadError", exc_info=True
            )
            outcome = EngineDeadError("the vLLM engine died; close it and start a new one")
            outcome.__cause__ = exc
        finally:
            delivery = [(future, outcome) for future in self._futures.values()]
            self._futures.clear()
            delivery += _refuse(list(self._taken), outcome) + self._refuse_commands(outcome)
            self._taken.clear()
            self._deliver(delivery)
            self.unfinished = 0
            self.engine = None
            engine.engine_core.shutdown()

    def _refuse_commands(self, outcome: EngineDeadError | None) -> _Delivery:
        """Stop taking commands; resolve those still queued (an add with ``outcome``)."""
        with self._lock:
            self._accepting = False
        return _refuse(_arrived(self._commands), outcome)

    def _serve(self, engine: Any) -> None:
        """Serve until a stop. Commands taken off the queue but not run when it returns or raises stay in
        ``_taken``, and what was resolved meanwhile is delivered: ``_run`` resolves the rest."""
        taken = self._taken
        while True:
            # Busy, take whatever arrived during the last step; idle, wait for the next burst.
            taken.extend(_arrived(self._commands) if engine.has_unfinished_requests() else self._burst())
            delivery: _Delivery = []
            try:
                while taken:
                    command = taken.popleft()
                    if isinstance(command, _Stop):
                        if self._futures:
                            engine.abort_request(list(self._futures))
                        return
                    self._apply(engine, command, delivery)
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished and (future := self._futures.pop(output.request_id, None)):
                            delivery.append((future, output))
                self.unfinished = engine.get_num_unfinished_requests()
            finally:
                self._deliver(delivery)

    def _apply(self, engine: Any, command: _Add | _Abort, delivery: _Delivery) -> None:
        if isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, command.prompt, command.params)
            except Exception as exc:  # this request is invalid; the engine goes on
                delivery.append((command.future, exc))
            else:
                self._futures[command.request_id] = command.future
            return
        delivery.append((command.done, None))  # done even if vLLM fails to abort: the engine is dead then
        if self._futures.pop(command.request_id, None) is not None:
            engine.abort_request([command.request_id])

    def _burst(self) -> list[_Command]:
        """Wait for a command, then for the event loop to end the pass that sent it (``BURST_MAX_S`` at
        most): the commands queued by then.

        A batch's first rollouts submit their requests in one pass of the loop (they wait for each
        other's envs at the runner's start line, and their prompts are encoded as one batch). Stepping
        at the first would hold the GIL beside the loop still submitting the rest, and delay them by
        more than the wait; waiting on a gap after the last would add the gap to every batch. Requests
        sent in later passes (a turn's steps ending one by one) join at the engine's next steps.
        """
        first = self._commands.get()
        if not isinstance(first, _Stop):
            begun = self._passes_begun  # the first command's pass, or a later one
            with self._passes:
                self._passes.wait_for(lambda: self._passes_ended >= begun, BURST_MAX_S)
        return [first, *_arrived(self._commands)]

    def _deliver(self, delivery: _Delivery) -> None:
        if not delivery:
            return
        try:
            self.loop.call_soon_threadsafe(_resolve, delivery)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            logger.debug("the event loop closed before %d vLLM results were delivered", len(delivery))


def _arrived(commands: queue.SimpleQueue[_Command]) -> list[_Command]:
    """The commands queued now, without waiting."""
    arrived = []
    with contextlib.suppress(queue.Empty):
        while True:
            arrived.append(commands.get_nowait())
    return arrived


def _refuse(commands: list[_Command], outcome: EngineDeadError | None) -> _Delivery:
    """Resolve commands the thread will not run: an add with ``outcome``, an abort as done."""
    delivery: _Delivery = []
    for command in commands:
        if isinstance(command, _Add):
            delivery.append((command.future, outcome))
        elif isinstance(command, _Abort):
            delivery.append((command.done, None))
    return delivery


def _resolve(delivery: _Delivery) -> None:
    for future, outcome in delivery:
        if future.done():  # cancelled meanwhile
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


# --- The engine. --------------------------------------------------------------------------------------

_running_lock = threading.Lock()
_running: InProcessVLLMEngine | None = None
"""The in-process engine of this process, from its start until its close: vLLM keeps its parallel state
(process groups) per process, and shutting one in-process engine down tears it down under any other."""


def in_process_engine_running() -> bool:
    """Whether an :class:`InProcessVLLMEngine` runs in this process (started, not yet closed)."""
    return _running is not None


def _claim(engine: InProcessVLLMEngine) -> None:
    global _running
    with _running_lock:
        if _running is not None:
            raise UnsupportedConfigError(
                f"another InProcessVLLMEngine ({_running.model_dir}) runs in this process: vLLM keeps its "
                "parallel state per process, and closing one in-process engine would break the other; "
                "close it first, or use VLLMEngine (its core runs in a process of its own), which "
                "make_vllm_engine picks while an in-process engine runs",
                option="engine",
            )
        _running = engine


def _release(engine: InProcessVLLMEngine) -> None:
    global _running
    with _running_lock:
        if _running is engine:
            _running = None


class InProcessVLLMEngine(LocalVLLMEngine):
    """vLLM's ``LLMEngine`` stepped by a thread of this process, behind the ``Engine`` protocol.

    Takes ``LocalVLLMEngine``'s arguments, as ``VLLMEngine`` does (the same defaults, from the same
    ``VLLMArgs``); ``cpu_threads`` sets the engine thread's torch threads. Threads that exist already
    (the one that started the engine among them) keep their setting, but torch gives the count to the
    threads started after it, even once the engine is closed, and vLLM's CPU worker leaves
    ``torch.set_num_threads`` a no-op (``torch._C.set_num_threads`` still sets a thread's own).

    Use it as ``async with InProcessVLLMEngine(model_dir) as engine:``. The engine is built on its
    thread while the event loop keeps running (15-35 s on CPU); no process is started.

    ``generate`` is safe to call concurrently from the event loop that started the engine; cancelling
    the awaiting task aborts the request inside vLLM before the cancellation propagates.
    """

    _driver: _Driver | None = None
    _starting: _Driver | None = None  # the engine thread while it builds the engine

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build vLLM's engine on the engine thread; the event loop keeps running meanwhile.

        Raises:
            DependencyNotInstalledError: vllm is not installed.
            BrokenDependencyError: a torch extension is installed but fails to import.
            UnsupportedConfigError: ``device`` names a platform vLLM did not detect, or vLLM
                rejected the engine arguments.
            EngineError: vLLM failed to start (its exception is ``__cause__``).
            EngineClosedError: the engine was started before or already closed.
            UnsupportedConfigError: another in-process engine runs in this process (``option`` is
                ``"engine"``).
        """
        self._check_new()
        _claim(self)
        try:
            await self._start()
        except BaseException:
            _release(self)
            raise

    async def _start(self) -> None:
        # Importing vLLM takes seconds: off the event loop, like the build itself.
        build, on_cpu = await asyncio.to_thread(self._builder)
        if self._closed():  # closed meanwhile: nothing was started
            raise self._closed_while_starting()
        driver = self._starting = _Driver(build, asyncio.get_running_loop(), self.args.threads(on_cpu=on_cpu))
        driver.thread.start()
        try:
            await asyncio.shield(asyncio.wrap_future(driver.ready))
        except BaseException as exc:
            # Cancelled, the thread finishes building first, then finds the stop and shuts the engine
            # down; failed, it is ending. Either way it is gone before this returns.
            await _stop(driver)
            if isinstance(exc, ValueError):
                raise UnsupportedConfigError("vLLM rejected them", option="engine arguments") from exc
            if isinstance(exc, Exception):
                raise EngineError(f"vLLM failed to start on {self.model_dir}") from exc
            raise
        finally:
            self._starting = None
        if self._closed():  # closed while building: that close stops the thread
            await _stop(driver)
            raise self._closed_while_starting()
        self._driver = driver
        self._state = EngineState.RUNNING

    def _builder(self) -> tuple[Callable[[], Any], bool]:
        """Check the platform and arguments here: what builds the engine on its thread, and whether
        vLLM runs on the CPU."""
        on_cpu = vllm_platform(self.args.device)
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        arguments = self.args.to_vllm(on_cpu=on_cpu)
        # A field of the async engine's arguments only: this engine logs no requests anyway.
        arguments.pop("enable_log_requests", None)
        parsed = engine_args(EngineArgs, arguments)

        def build() -> Any:
            config = parsed.create_engine_config(usage_context=batch_usage())
            # multiprocess_mode=False whatever VLLM_ENABLE_V1_MULTIPROCESSING says: the point of this
            # engine is that its core runs here.
            return LLMEngine(
                vllm_config=config,
                executor_class=Executor.get_class(config),
                log_stats=False,
                multiprocess_mode=False,
            )

        return build, on_cpu

    async def _close(self) -> None:
        """Abort requests in flight, stop the engine thread and shut vLLM's engine down; an engine still
        starting is stopped once built (``start`` then raises ``EngineClosedError``). ``generate`` calls
        still in flight return with finish reason ``"abort"`` (and no tokens: vLLM's offline engine
        reports nothing for an aborted request)."""
        driver, self._driver = self._driver or self._starting, None
        try:
            if driver is not None:
                await _stop(driver)
        finally:
            _release(self)

    # -- introspection -----------------------------------------------------------------------------

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread (None before ``start()`` and after ``aclose()``)."""
        return None if self._driver is None else self._driver.thread

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and ``aclose()`` while the engine thread is serving."""
        driver = self._driver
        return driver is not None and not driver.dead and driver.thread.is_alive()

    @property
    def num_unfinished_requests(self) -> int:
        """How many requests vLLM itself held after the engine thread's last step (0 when closed)."""
        driver = self._driver
        return 0 if driver is None else driver.unfinished

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        """Generate from ``prompt_ids``; cancelling the awaiting task aborts the request in vLLM.

        Raises:
            EngineClosedError: the engine is not started or already closed.
            UnsupportedConfigError: called from another event loop than the one the engine started in
                (``option`` is ``"event loop"``).
            EngineRequestError: vLLM rejected the request (e.g. too long for ``max_model_len``).
            EngineDeadError: the engine thread failed.
            EngineError: vLLM failed the request otherwise.
        """
        driver = self._driver
        if driver is None:
            raise self._not_running()
        loop = asyncio.get_running_loop()
        if loop is not driver.loop:
            raise UnsupportedConfigError(
                "generate() was called from another event loop than the one the engine started in: its "
                "thread hands every result to that loop; start the engine in the loop that uses it",
                option="event loop",
            )
        request_id = self._new_request_id()
        future: asyncio.Future[Any] = loop.create_future()
        with map_vllm_errors():
            command = _Add(request_id, tokens_prompt(prompt_ids), sampling_params(sampling), future)
        if not driver.submit(command):
            raise EngineDeadError("the vLLM engine died; close it and start a new one")
        self._in_flight.add(request_id)
        try:
            with map_vllm_errors():
                final = await future
        except asyncio.CancelledError:
            await _abort(driver, request_id, loop)
            raise
        finally:
            self._in_flight.discard(request_id)
        if final is None:
            return Generation(token_ids=[], logprobs=[] if sampling.logprobs else None, finish_reason="abort")
        return to_generation(final, sampling)


async def _abort(driver: _Driver, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
    """Abort ``request_id`` in vLLM and wait until the engine thread did, through cancellations."""
    done: asyncio.Future[None] = loop.create_future()
    if driver.submit(_Abort(request_id, done)):
        await finish(done)


async def _stop(driver: _Driver) -> None:
    """Stop the engine thread and wait for it, through cancellations (the thread must not outlive its
    engine's close)."""
    driver.submit(_Stop())
    await finish(asyncio.to_thread(driver.thread.join, _JOIN_TIMEOUT_S))
    if driver.thread.is_alive():
        logger.warning("the vLLM engine thread did not stop within %.0f s", _JOIN_TIMEOUT_S)
