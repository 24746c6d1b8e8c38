"""Deprecated: :mod:`gym_resilience.engines.vllm_server` starts and stops vLLM servers now."""

from gym_resilience._moved import forward

__getattr__ = forward(__name__, "gym_resilience.engines.vllm_server")
