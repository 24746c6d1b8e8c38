"""A user's own RL parts, as a project outside gym_resilience would write them: an env, a task loader and
a rollout pipeline. ``tests/chaos/scenario/test_user_parts.py``
copies this package next to its scenario files, under
another name, and the chaos harness faults these parts instead of its bundled ones."""
