"""Deprecated: :mod:`gym_resilience.backends.protocol` holds ``WorkerEnv`` now."""

from gym_resilience._moved import forward

__getattr__ = forward(__name__, "gym_resilience.backends.protocol")
