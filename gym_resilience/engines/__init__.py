"""Engines generate token ids from token ids: real vLLM in-process or served, or a scripted double.

``VLLMEngine`` (vLLM's async engine), ``InProcessVLLMEngine`` (vLLM's engine stepped by a thread of
this process; ``make_vllm_engine`` picks it on CPU) and ``OpenAIEngine`` (served vLLM endpoints with
failover) load lazily: vllm and httpx are imported only when used. ``VLLMArgs`` is the one description
of a vLLM engine's arguments. Servers to serve vLLM from are started by
``gym_resilience.engines.vllm_server``. ``await check_engine(engine)`` checks that an engine of your own
keeps the contract the runner relies on.
"""

from typing import TYPE_CHECKING

from gym_resilience.engines.base import Engine, FinishReason, Generation, Sampling, Tokenizer
from gym_resilience.engines.vllm_args import VLLMArgs

if TYPE_CHECKING:  # type checkers see the lazy names' real types (``__getattr__`` returns ``object``)
    from gym_resilience.engines.check import check_engine
    from gym_resilience.engines.local import make_vllm_engine
    from gym_resilience.engines.openai import OpenAIEngine, OpenAIEngineStats
    from gym_resilience.engines.vllm import VLLMEngine
    from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine

__all__ = [
    "Engine",
    "FinishReason",
    "Generation",
    "InProcessVLLMEngine",
    "OpenAIEngine",
    "OpenAIEngineStats",
    "Sampling",
    "Tokenizer",
    "VLLMArgs",
    "VLLMEngine",
    "check_engine",
    "make_vllm_engine",
]

_LAZY = {
    "VLLMEngine": "gym_resilience.engines.vllm",
    "InProcessVLLMEngine": "gym_resilience.engines.vllm_inprocess",
    "make_vllm_engine": "gym_resilience.engines.local",
    "check_engine": "gym_resilience.engines.check",
    "OpenAIEngine": "gym_resilience.engines.openai",
    "OpenAIEngineStats": "gym_resilience.engines.openai",
}


def __getattr__(name: str) -> object:
    """Engines load on first use, so importing this package pulls in neither vllm nor httpx."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
