"""The first stage: a scenario file read (``source``), validated into typed models (``spec``,
``validate``), checked against its own rules (``rules``, ``kinds``), and compiled into a
``CompiledScenario`` with everything it names resolved (``compile``, ``names``); ``loader`` runs them in
order for a file or a suite, ``messages`` words every problem."""
