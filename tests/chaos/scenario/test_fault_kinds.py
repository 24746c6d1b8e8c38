"""One registry entry per fault kind a scenario file can name, and nothing else."""

from __future__ import annotations

import typing

from harness.scenario.kinds import KINDS
from harness.scenario.spec import EngineFault, EnvFault, NetworkFault, RayFault


def test_the_registry_has_one_entry_per_kind_the_models_accept() -> None:
    accepted = {
        (typing.get_args(model.model_fields["target"].annotation)[0], kind)
        for model in (EnvFault, EngineFault, NetworkFault, RayFault)
        for kind in typing.get_args(model.model_fields["kind"].annotation)
    }
    assert set(KINDS) == accepted


def test_only_the_kinds_that_break_a_call_blame_a_failed_rollout() -> None:
    failing = {key for key, kind in KINDS.items() if kind.fails_call}
    assert failing == {
        ("env", "raise"),
        ("env", "hang"),
        ("env", "interrupt"),
        ("env", "bad_output"),
        ("engine", "raise"),
        ("network", "reset_peer"),
        ("network", "timeout"),
        ("ray", "kill_actor"),
    }
