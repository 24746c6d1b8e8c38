"""Engines generate token ids from token ids: real vLLM in-process or served, or a scripted double.

``VLLMEngine`` lives in ``gym_resilience.engines.vllm`` and imports vllm only when used.
"""

from gym_resilience.engines.base import Engine, FinishReason, Generation, Sampling, Tokenizer

__all__ = ["Engine", "FinishReason", "Generation", "Sampling", "Tokenizer", "VLLMEngine"]


def __getattr__(name: str) -> object:
    if name == "VLLMEngine":
        from gym_resilience.engines.vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
