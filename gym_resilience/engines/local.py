"""``make_vllm_engine``: the vLLM engine of this process that suits the platform, not started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_args import Device
from gym_resilience.engines.vllm_common import vllm_platform
from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine, in_process_engine_running

__all__ = ["make_vllm_engine"]


def make_vllm_engine(
    model_dir: str | Path, *, device: Device = "auto", **kwargs: Any
) -> InProcessVLLMEngine | VLLMEngine:
    """``InProcessVLLMEngine`` on CPU, ``VLLMEngine`` (vLLM's async engine, its core in a child process)
    on GPU, where the core's own process overlaps scheduling with the model and nothing here measured
    otherwise. On CPU the in-process engine starts in a third of the time at the same throughput
    (README, Benchmarks); while one already runs in this process, the next is a ``VLLMEngine``, since
    vLLM keeps an in-process engine's parallel state per process.

    ``kwargs`` go to the engine (both take the same ones). With ``device="auto"`` this imports vLLM to
    learn its platform.
    """
    on_cpu = device == "cpu" if device != "auto" else vllm_platform(device)
    # vLLM keeps one in-process engine's state per process: a second engine gets a process of its own.
    engine = InProcessVLLMEngine if on_cpu and not in_process_engine_running() else VLLMEngine
    return engine(model_dir, device=device, **kwargs)
