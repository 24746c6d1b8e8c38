"""Where an env runs and how it is called: the env concept of the library, one module per part.

- :mod:`~gym_resilience.backends.resilient`: ``ResilientEnv``, the wrapper every env is called through.
- :mod:`~gym_resilience.backends.protocol`: the requests and replies of an env that lives elsewhere, and
  ``RemoteEnv``, its local stand-in, written once for every backend.
- :mod:`~gym_resilience.backends.process`, :mod:`~gym_resilience.backends.process_worker`: an env in a
  worker process (``IsolatedEnv``) and that worker's main loop.
- :mod:`~gym_resilience.backends.ray`: an env in a Ray actor (``RayEnv``).
- :mod:`~gym_resilience.backends.choice`: ``make_env``, which picks the backend from the config.
- :mod:`~gym_resilience.backends.deadlines`: the one check of a number of seconds.

Names are imported from their modules: this package imports none of them, so that importing one (say
``deadlines`` from ``retry``) never imports the rest, nor Ray.
"""
