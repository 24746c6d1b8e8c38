"""Adapters that run other frameworks' environments under ``BatchRunner``.

``gym_resilience.adapters.skyrl_gym``: skyrl-gym environments (the ``[skyrl]`` extra).
"""
