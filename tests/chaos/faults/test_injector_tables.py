"""Each fault kind's effect is one entry of its target's injector table, and the tables agree with the
kinds registry (``harness.scenario.kinds``)."""

from __future__ import annotations

import pytest

from harness.faults import ENGINE_INJECTORS, ENV_INJECTORS, NETWORK_INJECTORS
from harness.faults.injectors import check_table
from harness.scenario.kinds import KINDS


def test_every_env_engine_and_network_kind_has_exactly_one_injector() -> None:
    tables = {"env": ENV_INJECTORS, "engine": ENGINE_INJECTORS, "network": NETWORK_INJECTORS}
    assert {(target, kind) for target, table in tables.items() for kind in table} == {
        key
        for key in KINDS
        if key[0] != "ray"  # each ray kind has an injector of its own: see below
    }
    assert {key for key in KINDS if key[0] == "ray"} == {("ray", "kill_actor"), ("ray", "kill_node")}


def test_the_phases_keep_the_order_faults_apply_in() -> None:
    assert {kind: injector.phase for kind, injector in ENV_INJECTORS.items()} == {
        "delay": "before",
        "raise": "instead",
        "interrupt": "instead",
        "hang": "instead",
        "bad_output": "instead",
    }
    assert {kind: injector.phase for kind, injector in ENGINE_INJECTORS.items()} == {
        "delay": "before",
        "kill": "before",
        "raise": "instead",
        "abort": "after",
    }
    assert [kind for kind, injector in ENGINE_INJECTORS.items() if injector.gate is not None] == ["kill"]


def test_a_table_that_misses_a_kind_or_has_one_too_many_is_refused_naming_them() -> None:
    table = {kind: None for kind in ENV_INJECTORS if kind != "hang"} | {"melt": None}
    with pytest.raises(LookupError) as caught:
        check_table("env", table)
    assert str(caught.value) == (
        "the env injectors do not match the env fault kinds: no injector for ['hang'], no kind for ['melt']"
    )
