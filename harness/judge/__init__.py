"""The fourth stage: a scenario's two runs compared (``compare``), observed by its probes (``probes``),
drawn rollout by rollout (``rollouts``) and judged (``verdict``) into the ``results`` every report reads."""
