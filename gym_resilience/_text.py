"""Deprecated: :func:`gym_resilience.errors.show` names a value in an error message now."""

from gym_resilience._moved import forward

__getattr__ = forward(__name__, "gym_resilience.errors")
