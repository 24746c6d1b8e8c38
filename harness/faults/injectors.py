"""What an injector table is: for each fault kind of a target, the function that applies it and when.

Each target's injector keeps one table, keyed by kind name, beside the kinds' entries in
``harness.scenario.kinds`` (which say what a kind is; the table says what it does to a call): a new kind
is its entry there plus its function here, and ``harness.faults.INJECTORS`` checks that the two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from harness.scenario.kinds import KINDS

__all__ = ["Injector", "Phase", "check_table"]

Phase = Literal["before", "instead", "after"]
"""When a kind acts on a call it hit: ``before`` it (each one that fired, in scenario order: a delay, a
kill), ``instead`` of it (the first one that fired, alone: a raise, a hang), or ``after`` it, on its
result (the first one that fired, unless an ``instead`` one did: an abort)."""

C = TypeVar("C")


@dataclass(frozen=True)
class Injector(Generic[C]):
    """How one fault kind acts on a call of its target: ``apply(call, fault_index, fault)``, and, for a
    kind that fires under conditions of its own, ``gate(call, fault_index, fault)``: whether it may fire
    on this call at all, asked before the plan decides (so a gated-out call counts for no ``nth_call``)."""

    phase: Phase
    apply: Callable[[C, int, Any], Any]
    gate: Callable[[C, int, Any], bool] | None = None


def check_table(target: str, table: Mapping[str, object]) -> None:
    """Raise unless ``table`` has one entry per kind of ``target`` in the kinds registry, and no other.

    Raises:
        LookupError: a kind has no injector, or an injector no kind; the message names them.
    """
    kinds = {name for (of, name) in KINDS if of == target}
    if set(table) != kinds:
        missing, extra = sorted(kinds - set(table)), sorted(set(table) - kinds)
        raise LookupError(
            f"the {target} injectors do not match the {target} fault kinds: no injector for "
            f"{missing}, no kind for {extra}"
        )
