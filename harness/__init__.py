"""The chaos harness: YAML scenarios that inject real faults into real vLLM generation (DESIGN.md §6).

It uses gym_resilience's public API only; the library never imports it.
"""
