"""The chaos harness: YAML scenarios that inject real faults into real vLLM generation, on the bundled parts
or the user's own (env, tasks, model, engine endpoints, pipeline).

Loading a scenario (``loader``): ``source`` reads the file within bounds and keeps each field's line,
``validate`` checks it against the models of ``spec``, ``compile`` resolves what it names into a
``CompiledScenario``, ``rules`` checks its fields against each other, ``messages`` and ``names`` word
every problem and resolve names. Running it: ``replay`` (with ``faults``, ``proxy``, ``ledger``), judged
by ``probes`` and ``compare``, reported by ``reports`` from the records in ``results``; ``cli`` is the
command line, ``pytest_plugin`` the pytest entry point.

It uses gym_resilience's public API only; the library never imports it.
"""
