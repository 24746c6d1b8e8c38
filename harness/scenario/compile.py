"""A scenario's runnable form: everything its names and paths point at, resolved once.

:func:`compile_parts` turns the valid parts of a scenario file into a :class:`CompiledScenario`: the
``RunnerConfig`` (``RunnerConfig.from_mapping``), the exception classes its faults raise and its
``expect`` names, the user's env factory, the tasks (generated, read from a ``.jsonl`` file, or
returned by the user's task loader), the user's pipeline, and the model folder. Replaying a scenario
uses these and checks nothing again. Every problem found on the way is returned, never raised, so a
file's problems are reported together.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import gymnasium

from gym_resilience import RunnerConfig, Task, UnsupportedConfigError
from gym_resilience.engines import Engine
from gym_resilience.task_gen import generate_tasks
from harness.scenario.kinds import kind_of
from harness.scenario.messages import Loc, Problem, error_text, show, split_import_path
from harness.scenario.names import add_import_folders, import_attribute, resolve_exception
from harness.scenario.rules import Known, rule_problems
from harness.scenario.source import read_input_file
from harness.scenario.spec import EngineFault, EnvFault, Fault, Scenario
from harness.scenario.validate import Parts

__all__ = ["MAX_TASKS_FILE_BYTES", "CompiledScenario", "EnvFactory", "Pipeline", "compile_parts"]

EnvFactory = Callable[[Task], gymnasium.Env[Any, Any]]
Pipeline = Callable[[list[Task], Callable[[Task], Any], Engine], Awaitable[Any]]

MAX_TASKS_FILE_BYTES: Final = 64 * 1024 * 1024
"""The largest ``.jsonl`` tasks file read."""


@dataclass(frozen=True)
class CompiledScenario:
    """A valid scenario, ready to run: its file's models and everything they name, resolved."""

    file: Path
    spec: Scenario
    config: RunnerConfig
    """The ``runner:`` settings as the file gives them (replay forces greedy decoding and logprobs)."""
    tasks: tuple[Task, ...]
    env_factory: EnvFactory | None
    """The user's env factory; None for the bundled env ``spec.batch.env`` (the tool env's factory
    needs the URL of the tool server the harness starts for each run)."""
    pipeline: Pipeline | None
    model_dir: Path | None
    """The model folder; None for the bundled tiny model."""
    exceptions: Mapping[int, type[BaseException]]
    """The class each ``raise`` fault raises, by the fault's index."""
    expected_error: type[BaseException] | None

    @property
    def title(self) -> str:
        return self.spec.title

    @property
    def faults(self) -> list[Fault]:
        return self.spec.faults

    @property
    def index_of(self) -> Mapping[str, int]:
        """Each task's index in the batch, by its ``instance_id``: the rollout index of its envs where
        nothing else says it, and the task of each trajectory of the batch."""
        return {task.instance_id: index for index, task in enumerate(self.tasks)}

    @property
    def interrupts(self) -> bool:
        """Whether a fault raises ``KeyboardInterrupt``, which the faulted run then reports as its outcome
        rather than ending the whole chaos run."""
        return any(kind_of(fault).interrupts for fault in self.faults)

    def rollouts_per_task(self, config: RunnerConfig) -> int:
        """Rollouts per task under ``config``: its samples per prompt, 1 for a user pipeline."""
        return 1 if self.pipeline is not None else config.n_samples_per_prompt

    def summary(self) -> str:
        """What would run, in one line: engine, model, env, tasks, who runs the batch, faults, probes."""
        engine = self.spec.engine
        if engine.kind == "vllm":
            serving = "in-process vLLM"
        elif engine.kind == "served":
            serving = f"{engine.servers} vllm serve process{'es' if engine.servers != 1 else ''}"
        else:
            serving = f"OpenAI endpoints {', '.join(engine.endpoints or [])}"
        model = str(self.model_dir) if self.model_dir is not None else "the bundled tiny model"
        runs = f"pipeline {self.spec.pipeline}" if self.spec.pipeline else "BatchRunner"
        cluster = self.spec.cluster
        on = f" on a {cluster.nodes}-node Ray cluster" if cluster is not None else ""
        return (
            f"{serving} serving {model}; env {self.spec.batch.env}, {_count(len(self.tasks), 'task')}; "
            f"{runs}{on}; {_count(len(self.faults), 'fault')}, {_count(len(self.spec.probes), 'probe')}"
        )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def compile_parts(
    parts: Parts, file: Path, folder: Path | None
) -> tuple[CompiledScenario | None, list[Problem]]:
    """The runnable form of a scenario's valid parts, and every problem found in them.

    ``folder`` is the scenario file's folder: relative paths start there, and it goes first on
    ``sys.path`` (for good, see ``harness.scenario.names.add_import_folders``) with ``python_path``'s
    folders, so
    the user's modules may sit next to the file. None: nothing is added, paths are relative to the
    working directory.
    """
    spec, valid = parts.spec, parts.valid
    base = folder if folder is not None else Path()
    problems: list[Problem] = []

    def attempt(loc: Loc, make: Callable[[], Any]) -> Any:
        """``make()``, or None and a problem at ``loc`` for the ``ValueError`` it raised."""
        try:
            return make()
        except ValueError as exc:
            problems.append(Problem(loc, str(exc)))
            return None

    extra = spec.python_path if "python_path" in valid else []
    found = [attempt(("python_path", i), _folder_of(base, entry)) for i, entry in enumerate(extra)]
    # None: nothing is added, and no folder is the scenario's own (see harness.scenario.names).
    add_import_folders([folder, *(path for path in found if path is not None)] if folder is not None else [])
    config = _runner_config(spec, problems) if "runner" in valid else None
    model_dir = attempt(("model",), lambda: _model_dir(base, spec.model)) if "model" in valid else None
    batch = spec.batch if "batch" in valid else None
    env_factory = tasks = None
    if batch is not None:
        if batch.bundled_env is None:
            env_factory = attempt(("batch", "env"), lambda: _callable(batch.env, "an env factory", 1))
        tasks = attempt(("batch", "tasks"), lambda: _tasks(spec, base))
    pipeline = attempt(("pipeline",), lambda: _pipeline(spec.pipeline)) if "pipeline" in valid else None
    exceptions = _fault_exceptions(parts.faults, problems)
    expected_error = None
    if "expect" in valid and spec.expect.error is not None:
        expected_error = attempt(("expect", "error"), lambda: resolve_exception(spec.expect.error or ""))
    known = Known(
        faults=parts.faults,
        config=config,
        batch=batch,
        engine=spec.engine if "engine" in valid else None,
        tasks=len(tasks) if tasks is not None else None,
        pipeline=spec.pipeline is not None if "pipeline" in valid else None,
        cluster=spec.cluster if "cluster" in valid else None,
        cluster_valid="cluster" in valid,
        probes=spec.probes if "probes" in valid else (),
    )
    problems.extend(rule_problems(known))
    if problems or not parts.complete or config is None or tasks is None:
        return None, problems
    compiled = CompiledScenario(
        file=file,
        spec=spec,
        config=config,
        tasks=tuple(tasks),
        env_factory=env_factory,
        pipeline=pipeline,
        model_dir=model_dir,
        exceptions=exceptions,
        expected_error=expected_error,
    )
    return compiled, []


def _runner_config(spec: Scenario, problems: list[Problem]) -> RunnerConfig | None:
    try:
        return RunnerConfig.from_mapping(spec.runner, exceptions=resolve_exception)
    except UnsupportedConfigError as exc:
        problems.append(Problem(exc.path, exc.reason))
        return None


def _under(base: Path, name: str) -> Path:
    """The path a scenario names: relative to its folder ``base``, ``~`` for the home folder."""
    return base / Path(name).expanduser()


def _folder_of(base: Path, entry: str) -> Callable[[], Path]:
    def folder() -> Path:
        path = _under(base, entry)
        if not path.is_dir():
            raise ValueError(f"folder {entry!r} does not exist (looked for {path.absolute()})")
        return path

    return folder


def _model_dir(base: Path, model: str | None) -> Path | None:
    """The model folder ``model`` names (relative to ``base``), checked to look like a Hugging Face model."""
    if model is None:
        return None
    path = _under(base, model).absolute()
    if not path.is_dir():
        raise ValueError(f"model folder {model!r} does not exist (looked for {path})")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{model!r} is not a Hugging Face model folder: it has no config.json (looked in {path})"
        )
    return path


def _callable(import_path: str, what: str, arguments: int) -> Any:
    """The callable ``import_path`` names, checked to take ``arguments`` positional arguments; ``what``
    says what it should be (``an env factory``)."""
    module, name = split_import_path(import_path, what)
    found = import_attribute(module, name)
    if not callable(found):
        kind = "a module" if inspect.ismodule(found) else f"{type(found).__name__} {show(found)}"
        raise ValueError(f"{import_path!r} is not callable (it is {kind}); expected {what}")
    try:
        inspect.signature(found).bind(*([None] * arguments))
    except TypeError as exc:
        called = f"({', '.join(['task'] * arguments)})" if arguments else "()"
        raise ValueError(f"{import_path!r} cannot be called as {what} {called}: {exc}") from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass
    return found


def _pipeline(pipeline: str | None) -> Pipeline | None:
    if pipeline is None:
        return None
    module, name = split_import_path(pipeline, "pipeline")
    found = import_attribute(module, name)
    expected = f"expected async def {name.rpartition('.')[2]}(tasks, env_factory, engine)"
    if not inspect.iscoroutinefunction(found):
        raise ValueError(f"{pipeline!r} is not an async function; {expected}")
    try:
        inspect.signature(found).bind(None, None, None)
    except TypeError as exc:
        raise ValueError(
            f"{pipeline!r} cannot be called with (tasks, env_factory, engine): {exc}; {expected}"
        ) from None
    except ValueError:
        pass
    return found  # type: ignore[no-any-return]


# --- tasks ------------------------------------------------------------------------------------------------


def _tasks(spec: Scenario, base: Path) -> list[Task]:
    batch = spec.batch
    if isinstance(batch.tasks, int):
        if batch.bundled_env is None:
            raise ValueError(
                f"a number of tasks makes tasks for the bundled envs, and batch.env is a user's env "
                f"factory ({batch.env}); name a task loader 'module:name' or a .jsonl file of tasks"
            )
        seed = batch.seed if batch.seed is not None else spec.seed
        return generate_tasks(batch.tasks, seed=seed, env=batch.bundled_env)
    if batch.tasks.endswith(".jsonl"):
        return _checked_tasks(list(_read_tasks(base, batch.tasks)), f"the tasks in {batch.tasks}")
    loader = _callable(batch.tasks, "a task loader", 0)
    try:
        loaded = loader()
    except BaseException as exc:  # the user's code: whatever it raises is this field's problem
        raise ValueError(f"calling {batch.tasks}() raised {error_text(exc)}") from None
    if not isinstance(loaded, list | tuple):
        raise ValueError(f"{batch.tasks}() returned {show(loaded)}; expected a list of gym_resilience.Task")
    return _checked_tasks(list(loaded), f"what {batch.tasks}() returned")


def _checked_tasks(tasks: Sequence[Any], source: str) -> list[Task]:
    if not tasks:
        raise ValueError(f"{source} holds no task; a batch needs at least one")
    seen: set[str] = set()
    for index, task in enumerate(tasks):
        if not isinstance(task, Task):
            raise ValueError(f"{source}: item {index} is a {type(task).__name__}, not a gym_resilience.Task")
        if task.instance_id in seen:
            raise ValueError(
                f"{source}: instance_id {task.instance_id!r} is given twice (items are rollouts' names)"
            )
        seen.add(task.instance_id)
    return list(tasks)


def _read_tasks(base: Path, name: str) -> Iterator[Task]:
    """The tasks of a ``.jsonl`` file: one JSON object per line, ``instance_id``, ``prompt`` (chat
    messages) and optionally ``env_kwargs``; blank lines are skipped."""
    path = _under(base, name)
    try:
        raw = read_input_file(path, max_bytes=MAX_TASKS_FILE_BYTES, what="tasks file")
        text = raw.decode("utf-8")
    except (ValueError, UnicodeDecodeError) as exc:  # UnicodeDecodeError is a ValueError: say which
        reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise ValueError(f"tasks file {name!r}: {reason} (looked for {path.absolute()})") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield _task_from_json(line, f"{name}:{number}")


def _task_from_json(line: str, where: str) -> Task:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object with instance_id, prompt and env_kwargs")
    unknown = sorted(set(data) - {"instance_id", "prompt", "env_kwargs"})
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; expected instance_id, prompt, env_kwargs")
    instance_id, prompt, env_kwargs = data.get("instance_id"), data.get("prompt"), data.get("env_kwargs", {})
    if not isinstance(instance_id, str) or not instance_id:
        raise ValueError(f"{where}: instance_id must be a non-empty string")
    if not isinstance(prompt, list) or not all(_is_message(message) for message in prompt):
        raise ValueError(f'{where}: prompt must be a list of chat messages ({{"role": ..., "content": ...}})')
    if not isinstance(env_kwargs, dict):
        raise ValueError(f"{where}: env_kwargs must be an object")
    return Task(prompt=prompt, instance_id=instance_id, env_kwargs=env_kwargs)


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and set(message) == {"role", "content"}
        and all(isinstance(value, str) for value in message.values())
    )


# --- exceptions -------------------------------------------------------------------------------------------


def _fault_exceptions(
    faults: Sequence[tuple[int, Fault]], problems: list[Problem]
) -> dict[int, type[Exception]]:
    """The class each ``raise`` fault raises, checked to be an ``Exception`` buildable from the fault's
    message alone."""
    classes: dict[int, type[Exception]] = {}
    for index, fault in faults:
        if not isinstance(fault, EnvFault | EngineFault) or not kind_of(fault).raises:
            continue
        at: Loc = ("faults", index, "exception")
        try:
            exception = _raisable(fault.exception)
        except ValueError as exc:
            problems.append(Problem(at, str(exc)))
            continue
        try:
            exception(fault.message)
        except BaseException as exc:  # a user's exception class runs its own code
            problems.append(
                Problem(
                    at,
                    f"exception {fault.exception!r} cannot be raised with a message: "
                    f"{fault.exception}(message) raised {error_text(exc)}; "
                    "name one that takes a single message argument",
                )
            )
            continue
        classes[index] = exception
    return classes


def _raisable(name: str) -> type[Exception]:
    """The ``Exception`` subclass a ``raise`` fault names.

    A BaseException that is not an Exception (SystemExit, GeneratorExit, CancelledError) is never
    contained as a rollout failure: it would end the whole run, with no reports.

    Raises:
        ValueError: the name resolves to nothing, or to a class that is not an ``Exception`` subclass.
    """
    exception = resolve_exception(name)
    if not issubclass(exception, Exception):
        raise ValueError(
            f"{name!r} cannot be raised by a fault: raise faults take Exception subclasses, and a "
            "BaseException that is not one (SystemExit, GeneratorExit, CancelledError) would end the "
            "whole run; to interrupt the batch, use the env fault kind 'interrupt'"
        )
    return exception
