"""Deprecated: isolated envs live in :mod:`gym_resilience.backends.process` now (their worker in
``process_worker``, the requests and replies in ``protocol``)."""

from gym_resilience._moved import forward

__getattr__ = forward(
    __name__,
    "gym_resilience.backends.process",
    "gym_resilience.backends.protocol",
    "gym_resilience.backends.process_worker",
)
