"""Engines generate token ids from token ids: real vLLM in-process or served, or a scripted double.

``VLLMEngine`` (in-process vLLM), ``OpenAIEngine`` (served vLLM endpoints with failover) and
``VLLMServer`` load lazily: vllm and httpx are imported only when used.
"""

from typing import TYPE_CHECKING

from gym_resilience.engines.base import Engine, FinishReason, Generation, Sampling, Tokenizer

if TYPE_CHECKING:  # type checkers see the lazy names' real types (``__getattr__`` returns ``object``)
    from gym_resilience.engines.openai import OpenAIEngine, OpenAIEngineStats
    from gym_resilience.engines.servers import VLLMServer, aservers, servers
    from gym_resilience.engines.vllm import VLLMEngine

__all__ = [
    "Engine",
    "FinishReason",
    "Generation",
    "OpenAIEngine",
    "OpenAIEngineStats",
    "Sampling",
    "Tokenizer",
    "VLLMEngine",
    "VLLMServer",
    "aservers",
    "servers",
]

_LAZY = {
    "VLLMEngine": "gym_resilience.engines.vllm",
    "OpenAIEngine": "gym_resilience.engines.openai",
    "OpenAIEngineStats": "gym_resilience.engines.openai",
    "VLLMServer": "gym_resilience.engines.servers",
    "servers": "gym_resilience.engines.servers",
    "aservers": "gym_resilience.engines.servers",
}


def __getattr__(name: str) -> object:
    """Engines load on first use, so importing this package pulls in neither vllm nor httpx."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
