"""Load scenario files: YAML in, a typed, frozen :class:`~harness.spec.Scenario` out, or one clear error.

Loading and validating are separate steps (STYLE.md "Scenario files"):

1. parse: the text becomes plain data with ``yaml.safe_load`` semantics (the same ``SafeLoader``), and the
   YAML node tree is kept beside it, because only the nodes know line numbers;
2. validate: the data becomes a :class:`Scenario` (the models in ``harness.spec``), then the checks the
   models cannot make on their own run: exception names resolve, ``runner:`` builds a ``RunnerConfig``,
   ``pipeline:`` imports, and every fault fits the engine, env and runner it is meant to hit.

Every problem surfaces as one :class:`~gym_resilience.ScenarioError` naming the file, the line, the field
path (``faults[2].kind``) and what was expected; when a file has several problems, the first in the file
is reported. The library raises and never prints: the command line turns the error into exit code 2.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import sys
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

import gym_resilience
from gym_resilience import errors as gym_errors
from gym_resilience.config import RunnerConfig
from gym_resilience.errors import ScenarioError, UnsupportedConfigError
from gym_resilience.retry import RetryPolicy
from harness.spec import EngineFault, EnvFault, NetworkFault, Scenario

__all__ = [
    "SCENARIO_SUFFIXES",
    "load_scenario",
    "load_scenarios",
    "parse_scenario",
    "resolve_exception",
    "runner_config",
    "scenario_files",
]

SCENARIO_SUFFIXES = (".yaml", ".yml")
"""The files a directory given to :func:`load_scenarios` expands to."""

Loc = tuple[str | int, ...]
"""A path into the scenario data: mapping keys and list indices, ``("faults", 2, "kind")``."""

_TAG = "target"
"""The field that tells the members of the one tagged union of the models (``Fault``) apart."""

# RetryPolicy fields a file cannot set: how a retry sleeps is for tests to inject, not for scenarios.
_RETRY_FIELDS_NOT_IN_FILES = frozenset({"sleep", "async_sleep"})


class _Problem(Exception):
    """One problem at a path in the data, before the file and line are attached (internal)."""

    def __init__(self, loc: Loc, reason: str, *, anchor: Loc | None = None) -> None:
        super().__init__(reason)
        self.loc = loc
        self.reason = reason
        self.anchor = loc if anchor is None else anchor  # where in the file to point, if not at loc


# --- public API -------------------------------------------------------------------------------------------


def load_scenario(path: str | Path) -> Scenario:
    """Loads and validates one scenario file. A ``pipeline`` module may sit next to it (its folder goes on
    ``sys.path`` while the pipeline is imported, as the harness does when it runs the scenario).

    Raises:
        ScenarioError: the file cannot be read, is not YAML, or is not a valid scenario; ``str(error)`` is
            ``file:line at field: reason``.
    """
    path = Path(path)
    file = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ScenarioError(file=file, field="", reason="no such file") from None
    except IsADirectoryError:
        raise ScenarioError(file=file, field="", reason="is a directory, not a scenario file") from None
    except OSError as exc:
        raise ScenarioError(file=file, field="", reason=f"cannot read the file: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        reason = f"not UTF-8 text (byte {raw[exc.start]:#04x})"
        raise ScenarioError(file=file, field="", reason=reason, line=line) from None
    return parse_scenario(text, file=file, folder=path.parent)


def parse_scenario(text: str, *, file: str = "<string>", folder: str | Path | None = None) -> Scenario:
    """Validates scenario YAML given as text; ``file`` is the name errors give. See :func:`load_scenario`.

    ``folder`` is where the scenario file lives: a ``pipeline`` (and a ``module:Name`` exception) may be a
    module in it, as the harness imports pipelines with the scenario's folder on ``sys.path``.
    """
    data, root = _parse(text, file)
    return _validate(data, root, file, None if folder is None else Path(folder))


def scenario_files(paths: Sequence[str | Path]) -> list[Path]:
    """The scenario files ``paths`` name: files as given, directories expanded to their ``*.yaml`` and
    ``*.yml`` files (not recursive), sorted by name; a file named twice is listed once.

    Raises:
        ScenarioError: a path does not exist, or a directory holds no scenario file.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in SCENARIO_SUFFIXES and p.is_file())
            if not found:
                reason = "no scenario files (*.yaml, *.yml) in this directory"
                raise ScenarioError(file=str(path), field="", reason=reason)
        elif path.exists():
            found = [path]
        else:
            raise ScenarioError(file=str(path), field="", reason="no such file or directory")
        for file in found:
            key = file.resolve()
            if key not in seen:
                seen.add(key)
                files.append(file)
    return files


def load_scenarios(paths: Sequence[str | Path]) -> list[tuple[Path, Scenario]]:
    """Loads every scenario file ``paths`` name (see :func:`scenario_files`), in that order.

    Raises:
        ScenarioError: for the first path or file that is invalid. To report every invalid file, call
            :func:`load_scenario` on each of :func:`scenario_files` instead.
    """
    return [(file, load_scenario(file)) for file in scenario_files(paths)]


def resolve_exception(name: str) -> type[BaseException]:
    """The exception class a scenario names: a built-in (``ConnectionError``), a name gym_resilience
    exports (``EnvStepError``, ``EngineDeadError``), or ``package.module:Name`` (imported).

    Raises:
        ValueError: the name resolves to nothing, or to something that is not a ``BaseException`` subclass;
            the message says which.
    """
    if ":" in name:
        module_name, _, qualname = name.partition(":")
        if not module_name or not qualname:
            raise ValueError(f"exception {name!r} must be module:Name")
        try:
            found: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import module {module_name!r} for exception {name!r}: {exc}") from None
        except Exception as exc:  # the module's own code failed: say how, without its traceback
            raise ValueError(
                f"importing module {module_name!r} for exception {name!r} raised {type(exc).__name__}: {exc}"
            ) from None
        for part in qualname.split("."):
            if not hasattr(found, part):
                raise ValueError(f"module {module_name!r} has no attribute {qualname!r}")
            found = getattr(found, part)
    else:
        candidates = _named_exceptions()
        if name not in candidates:
            reason = (
                f"unknown exception {name!r}: "
                "expected a built-in exception, a gym_resilience error, or module:Name"
            )
            if "." in name:
                module_name, _, attribute = name.rpartition(".")
                reason += f"; did you mean '{module_name}:{attribute}'?"
            else:
                reason += _did_you_mean(name, candidates)
            raise ValueError(reason)
        found = candidates[name]
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        raise ValueError(f"{name!r} is not an exception class")
    return found


def runner_config(scenario: Scenario, *, file: str | Path = "<scenario>") -> RunnerConfig:
    """The ``RunnerConfig`` the scenario's ``runner:`` mapping describes (``retry:`` as a RetryPolicy).

    A scenario from :func:`load_scenario` always has a valid one.

    Raises:
        ScenarioError: an unknown option, a value of the wrong type, or a combination ``RunnerConfig`` or
            ``RetryPolicy`` rejects (``field`` is ``runner.<option>``; no line: the scenario has no file).
    """
    try:
        return _build_runner_config(scenario.runner)
    except _Problem as problem:
        raise ScenarioError(file=str(file), field=_field_path(problem.loc), reason=problem.reason) from None


# --- step 1: parse ----------------------------------------------------------------------------------------


def _parse(text: str, file: str) -> tuple[Any, yaml.Node | None]:
    """``yaml.safe_load(text)``, and the document's root node (None for an empty document)."""
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # the reader rejects control characters already here
        root = loader.get_single_node()
        if root is None:
            return None, None
        _reject_duplicate_keys(root, file)
        return loader.construct_document(root), root
    except yaml.MarkedYAMLError as exc:
        raise _yaml_error(exc, file) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        reason = f"invalid YAML: unacceptable character {character}: {exc.reason}"
        raise ScenarioError(file=file, field="", reason=reason, line=line) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(file=file, field="", reason=f"invalid YAML: {exc}") from None
    except RecursionError:
        raise ScenarioError(file=file, field="", reason="invalid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def _yaml_error(exc: yaml.MarkedYAMLError, file: str) -> ScenarioError:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else None
    problem = exc.problem or "cannot parse"
    if exc.context == "expected a single document in the stream":
        reason = "a scenario file holds one YAML document, found a second one"
    elif exc.context and exc.context_mark is not None and exc.context_mark is not exc.problem_mark:
        reason = f"{problem} ({exc.context} started on line {exc.context_mark.line + 1})"
    else:
        reason = problem
    return ScenarioError(file=file, field="", reason=f"invalid YAML: {reason}", line=line)


def _reject_duplicate_keys(root: yaml.Node, file: str) -> None:
    """safe_load keeps the last of two equal keys silently; in a scenario that drops half a fault list."""
    seen_nodes: set[int] = set()

    def visit(node: yaml.Node, loc: Loc) -> None:
        if id(node) in seen_nodes:  # an alias, possibly recursive
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first_line: dict[str, int] = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
                    visit(value, loc)
                    continue
                line = key.start_mark.line + 1
                if key.value in first_line:
                    reason = f"duplicate field {key.value!r} (first given on line {first_line[key.value]})"
                    field = _field_path((*loc, key.value))
                    raise ScenarioError(file=file, field=field, reason=reason, line=line)
                first_line[key.value] = line
                visit(value, (*loc, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                visit(item, (*loc, index))

    visit(root, ())


# --- step 2: validate -------------------------------------------------------------------------------------


def _validate(data: Any, root: yaml.Node | None, file: str, folder: Path | None) -> Scenario:
    if root is None:
        reason = "the file is empty; expected a mapping of scenario fields (title, faults, probes, ...)"
        raise ScenarioError(file=file, field="", reason=reason)
    if not isinstance(data, dict):
        reason = (
            "expected a mapping of scenario fields (title, faults, probes, ...) at the top level, "
            f"got {_show(data)}"
        )
        raise ScenarioError(file=file, field="", reason=reason, line=root.start_mark.line + 1)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        problems = [_problem_from_pydantic(error) for error in exc.errors(include_url=False)]
    else:
        with _importable_from(folder):
            problems = list(_semantic_problems(scenario))
    if not problems:
        return scenario
    # The first problem in the file, so that fixing a file top to bottom meets the errors in order.
    located = [(_locate(root, problem.anchor), order, problem) for order, problem in enumerate(problems)]
    (line, _column), _, first = min(located, key=lambda item: (item[0], item[1]))
    raise ScenarioError(file=file, field=_field_path(first.loc), reason=first.reason, line=line)


def _locate(root: yaml.Node, loc: Loc) -> tuple[int, int]:
    """The (line, column) of the field at ``loc``: its key's position in a mapping, its item's position in a
    list, or the nearest enclosing one that the file has (a missing field is reported at its parent)."""
    node = root
    mark = root.start_mark
    for item in loc:
        if isinstance(node, yaml.MappingNode):
            # Last match: the loader's merge (<<) puts merged keys first, and later keys win.
            for key, value in reversed(node.value):
                if isinstance(key, yaml.ScalarNode) and key.value == str(item):
                    mark, node = key.start_mark, value
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(item, int) and 0 <= item < len(node.value):
            node = node.value[item]
            mark = node.start_mark
        else:
            break
    return mark.line + 1, mark.column


def _field_path(loc: Loc) -> str:
    """``("faults", 2, "kind")`` -> ``faults[2].kind``."""
    path = ""
    for item in loc:
        path += f"[{item}]" if isinstance(item, int) else (f".{item}" if path else item)
    return path


# --- pydantic errors as messages --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spot:
    """What the models expect at a path: the annotation, its constraints, the model it is a field of."""

    loc: Loc
    annotation: Any
    constraints: tuple[Any, ...] = ()
    owner: type[BaseModel] | None = None


def _walk(loc: tuple[str | int, ...]) -> _Spot:
    """Follows pydantic's error ``loc`` through the models: drops the tags pydantic inserts for tagged and
    plain unions (``faults.0.env.kind`` is ``faults[0].kind`` in the file) and finds the expected type."""
    annotation: Any = Scenario
    constraints: tuple[Any, ...] = ()
    owner: type[BaseModel] | None = None
    path: list[str | int] = []
    for item in loc:
        annotation, extra = _strip(annotation)
        constraints += extra
        members = _union_members(annotation)
        if members is not None:
            tagged = _tagged_member(members, item)
            if tagged is not None:
                annotation, constraints = tagged, ()
                continue
            if isinstance(item, str) and not _is_model(annotation):
                # A plain union's member label (``eq.int``): the union as a whole is what was expected.
                break
        if _is_model(annotation):
            owner = annotation
            field = _model_field(annotation, item)
            path.append(item)
            if field is None:
                annotation, constraints = None, ()
                break
            annotation, constraints = field.annotation, tuple(field.metadata)
        elif typing.get_origin(annotation) in (list, tuple, dict) and isinstance(item, int | str):
            path.append(item)
            args = typing.get_args(annotation)
            if typing.get_origin(annotation) is dict:
                annotation = args[1]
            elif typing.get_origin(annotation) is tuple and Ellipsis not in args and isinstance(item, int):
                annotation = args[item] if 0 <= item < len(args) else None
            else:
                annotation = args[0]
            constraints = ()
        else:
            path.append(item)
            annotation, constraints = None, ()
    if annotation is not None:
        annotation, extra = _strip(annotation)
        constraints += extra
    return _Spot(tuple(path), annotation, constraints, owner)


def _strip(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    """``Annotated[X, ...]`` -> (X, its constraints); a union ``X | None`` of one type -> X."""
    constraints: tuple[Any, ...] = ()
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            args = typing.get_args(annotation)
            annotation = args[0]
            constraints += tuple(args[1:])
            continue
        members = _union_members(annotation)
        if members is not None:
            not_none = [member for member in members if member is not type(None)]
            if len(not_none) == 1 and len(members) == 2:
                annotation = not_none[0]  # pydantic reports X | None as X: no union tag in the loc
                continue
        return annotation, constraints


def _union_members(annotation: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return None


def _is_model(annotation: Any) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tagged_member(members: tuple[Any, ...], tag: str | int) -> type[BaseModel] | None:
    """The member of a tagged union (``Fault``, tagged by ``target``) that ``tag`` selects, if any."""
    for member in members:
        if _is_model(member):
            target = member.model_fields.get(_TAG)
            if target is not None and tag in typing.get_args(target.annotation):
                return member
    return None


def _model_field(model: type[BaseModel], key: str | int) -> FieldInfo | None:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _field_names(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _problem_from_pydantic(error: ErrorDetails) -> _Problem:
    kind = error["type"]
    ctx = error.get("ctx", {})
    value = error.get("input")
    spot = _walk(tuple(error["loc"]))
    loc, expected = spot.loc, spot.annotation
    if kind == "missing":
        parent = _walk(tuple(error["loc"][:-1]))
        if typing.get_origin(parent.annotation) is tuple:
            return _Problem(parent.loc, f"expected {_describe(parent.annotation)}, got {_count(value)}")
        return _Problem(loc, f"missing required field {loc[-1]!r}")
    if kind == "extra_forbidden":
        known = _field_names(spot.owner) if spot.owner is not None else []
        return _Problem(loc, _unknown_field(str(loc[-1]), known))
    if kind == "invalid_key":
        return _Problem(loc[:-1], f"expected field names to be strings, got {_show(value)}", anchor=loc)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        discriminator = str(ctx.get("discriminator", _TAG)).strip("'")
        members = _union_members(_strip(expected)[0]) or ()
        tags = [
            tag for member in members if _is_model(member) for tag in _literal_values(member, discriminator)
        ]
        choices = ", ".join(repr(tag) for tag in tags)
        if kind == "union_tag_not_found":
            if not isinstance(value, dict):
                return _Problem(loc, f"expected a mapping, got {_show(value)}")
            return _Problem(
                (*loc, discriminator), f"missing required field {discriminator!r}; expected one of {choices}"
            )
        tag = value.get(discriminator) if isinstance(value, dict) else None
        return _Problem((*loc, discriminator), f"expected one of {choices}, got {_show(tag)}")
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return _Problem(loc, str(ctx["error"]))
    if kind in ("too_short", "too_long") and typing.get_origin(expected) is tuple:
        return _Problem(loc, f"expected {_describe(expected)}, got {_count(value)}")
    if expected is None:
        return _Problem(loc, f"invalid value {_show(value)}")
    return _Problem(loc, f"expected {_describe(expected, spot.constraints)}, got {_show(value)}")


def _count(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"{len(value)} item{'' if len(value) == 1 else 's'}"
    return _show(value)


def _literal_values(model: type[BaseModel], name: str) -> tuple[Any, ...]:
    field = model.model_fields.get(name)
    return typing.get_args(field.annotation) if field is not None else ()


def _describe(annotation: Any, constraints: Sequence[Any] = ()) -> str:
    """What an annotation accepts, in the words of a YAML file: ``an integer >= 0``, ``one of 'a', 'b'``."""
    extra: tuple[Any, ...] = ()
    while typing.get_origin(annotation) is typing.Annotated:  # keeps ``| None``: null may be expected
        annotation, *metadata = typing.get_args(annotation)
        extra += tuple(metadata)
    bounds = _bounds([*constraints, *extra])
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(value) for value in typing.get_args(annotation))
    members = _union_members(annotation)
    if members is not None:
        words = [_describe(member) for member in members]
        if "a number" in words and "an integer" in words:
            words.remove("an integer")
        words = list(dict.fromkeys(words))
        if len(words) <= 2:
            return " or ".join(words)
        return ", ".join(words[:-1]) + f", or {words[-1]}"
    if origin is tuple:
        args = typing.get_args(annotation)
        if Ellipsis not in args:
            return f"a list of {len(args)} {_plural(_describe(args[0]))}"
        return "a list"
    if origin is list:
        return f"a list of {_plural(_describe(typing.get_args(annotation)[0]))}"
    if origin is dict or _is_model(annotation) or annotation is dict:
        return "a mapping"
    word = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return word.get(annotation, "a value") + bounds


def _plural(words: str) -> str:
    for article in ("an ", "a "):
        if words.startswith(article):
            noun, _, rest = words[len(article) :].partition(" ")
            return f"{noun}s" + (f" {rest}" if rest else "")
    return words


def _bounds(constraints: Sequence[Any]) -> str:
    flat: list[Any] = []
    for constraint in constraints:
        flat.extend(constraint.metadata if isinstance(constraint, FieldInfo) else [constraint])
    low = next((c for c in flat if isinstance(c, annotated_types.Ge | annotated_types.Gt)), None)
    high = next((c for c in flat if isinstance(c, annotated_types.Le | annotated_types.Lt)), None)
    if isinstance(low, annotated_types.Ge) and isinstance(high, annotated_types.Le):
        return f" in [{low.ge:g}, {high.le:g}]"
    words = []
    if isinstance(low, annotated_types.Ge):
        words.append(f">= {low.ge:g}")
    elif isinstance(low, annotated_types.Gt):
        words.append(f"> {low.gt:g}")
    if isinstance(high, annotated_types.Le):
        words.append(f"<= {high.le:g}")
    elif isinstance(high, annotated_types.Lt):
        words.append(f"< {high.lt:g}")
    return f" {' and '.join(words)}" if words else ""


def _show(value: Any) -> str:
    """A value as a scenario file writes it: ``'three'``, ``3``, ``true``, ``null``, ``a list``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _unknown_field(name: str, known: Sequence[str]) -> str:
    return f"unknown field {name!r}" + (
        _did_you_mean(name, known) or (f"; expected one of {', '.join(known)}" if known else "")
    )


def _did_you_mean(name: str, known: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


# --- step 2, continued: what the models cannot check ------------------------------------------------------


@contextlib.contextmanager
def _importable_from(folder: Path | None) -> Iterator[None]:
    """``folder`` first on ``sys.path`` meanwhile; the harness puts it there for good when it runs."""
    entry = None if folder is None else str(folder.resolve())
    if entry is None or entry in sys.path:
        yield
        return
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def _semantic_problems(scenario: Scenario) -> Iterator[_Problem]:
    try:
        config: RunnerConfig | None = _build_runner_config(scenario.runner)
    except _Problem as problem:
        config = None
        yield problem
    if scenario.pipeline is not None:
        yield from _pipeline_problems(scenario.pipeline)
    for index, fault in enumerate(scenario.faults):
        yield from _fault_problems(scenario, config, index, fault)
    if scenario.expect.error is not None:
        try:
            resolve_exception(scenario.expect.error)
        except ValueError as exc:
            yield _Problem(("expect", "error"), str(exc))


def _fault_problems(
    scenario: Scenario, config: RunnerConfig | None, index: int, fault: EnvFault | EngineFault | NetworkFault
) -> Iterator[_Problem]:
    at: Loc = ("faults", index)
    if isinstance(fault, EnvFault | EngineFault) and fault.kind == "raise":
        try:
            exception = resolve_exception(fault.exception)
        except ValueError as exc:
            yield _Problem((*at, "exception"), str(exc))
        else:
            try:
                exception(fault.message)
            except Exception as exc:
                yield _Problem(
                    (*at, "exception"),
                    f"exception {fault.exception!r} cannot be raised with a message: "
                    f"{fault.exception}(message) raised {type(exc).__name__}: {exc}; "
                    "name one that takes a single message argument",
                )
    if isinstance(fault, EnvFault) and fault.kind == "bad_output" and fault.method == "close":
        yield _Problem(
            (*at, "method"),
            "bad_output cannot target close: close() returns nothing, so the fault would do nothing",
        )
    if isinstance(fault, EngineFault) and fault.kind == "kill":
        if scenario.engine.kind != "served":
            yield _Problem(
                (*at, "kind"),
                "a kill fault needs a served engine (engine.kind: served): it SIGKILLs a vllm serve "
                f"process, and engine.kind is {scenario.engine.kind!r}",
            )
        elif fault.server >= scenario.engine.servers:
            yield _Problem(
                (*at, "server"),
                f"server {fault.server} does not exist: engine.servers is {scenario.engine.servers} "
                "(servers are numbered from 0)",
            )
    if isinstance(fault, NetworkFault):
        if fault.link == "engine" and scenario.engine.kind != "served":
            yield _Problem(
                (*at, "link"),
                "link 'engine' needs a served engine (engine.kind: served): the fault proxy sits on the "
                f"HTTP connection to vllm serve, and engine.kind is {scenario.engine.kind!r}",
            )
        if (
            fault.link == "engine"
            and fault.endpoint is not None
            and fault.endpoint >= scenario.engine.servers
        ):
            yield _Problem(
                (*at, "endpoint"),
                f"endpoint {fault.endpoint} does not exist: engine.servers is {scenario.engine.servers} "
                "(endpoints are numbered from 0)",
            )
        if fault.link == "tool" and fault.endpoint is not None:
            yield _Problem((*at, "endpoint"), "endpoint only goes with link 'engine': the tool server is one")
        if fault.link == "tool" and scenario.batch.env != "tool_use":
            yield _Problem(
                (*at, "link"),
                "link 'tool' needs batch.env: tool_use: only that env talks to a tool server, "
                f"and batch.env is {scenario.batch.env!r}",
            )
    if isinstance(fault, EnvFault) and fault.kind == "hang" and config is not None:
        deadline = {"step": "env_step_timeout_s", "reset": "env_reset_timeout_s"}.get(fault.method)
        if deadline is None and not config.isolate_envs:
            yield _Problem(
                (*at, "kind"),
                "a hang in close needs runner.isolate_envs: true: only an isolated env's close is killed "
                "at its deadline, and a close that never returns would hang the run",
            )
        elif deadline is not None and not (config.isolate_envs and getattr(config, deadline) is not None):
            yield _Problem(
                (*at, "kind"),
                f"a hang in {fault.method} needs runner.isolate_envs: true and runner.{deadline} set: only a "
                "deadline that kills the env's process stops a hung call, and without one the run would hang",
            )
    if not isinstance(fault, NetworkFault) and config is not None:
        yield from _targeting_problems(scenario, config, at, fault)


def _targeting_problems(
    scenario: Scenario, config: RunnerConfig, at: Loc, fault: EnvFault | EngineFault
) -> Iterator[_Problem]:
    """A filter naming a rollout, turn or attempt the batch never has makes a fault that never fires, and
    a scenario whose fault never fires holds without testing anything (see ``harness.faults`` for where
    each call is: a filter never matches a call whose coordinate is unknown)."""
    when = fault.when
    if scenario.pipeline is not None and isinstance(fault, EngineFault):
        for name in ("rollouts", "attempts", "turns"):
            if getattr(when, name) is not None:
                yield _Problem(
                    (*at, "when", name),
                    f"{name} never match here: in a user pipeline an engine call has no rollout, attempt "
                    "or turn; target it with nth_call or probability",
                )
        return
    if isinstance(fault, EnvFault) and fault.method == "reset" and when.turns is not None:
        yield _Problem(
            (*at, "when", "turns"),
            "turns never match a reset fault: reset has no turn (turns count the steps since reset)",
        )
    limits: dict[str, tuple[int, str]]
    if scenario.pipeline is not None:
        limits = {
            "rollouts": (
                scenario.batch.tasks,
                f"in a user pipeline an env's rollout is its task's index, and batch.tasks is "
                f"{scenario.batch.tasks} (numbered from 0)",
            ),
            "attempts": (1, "in a user pipeline every env call is attempt 0"),
        }
    else:
        rollouts = scenario.batch.tasks * config.n_samples_per_prompt
        attempts = config.retry.attempts if config.retry is not None else 1
        limits = {
            "rollouts": (
                rollouts,
                f"the batch has {rollouts} rollouts (batch.tasks {scenario.batch.tasks} x "
                f"runner.n_samples_per_prompt {config.n_samples_per_prompt}), numbered from 0",
            ),
            "attempts": (
                attempts,
                f"a rollout gets {attempts} attempt{'s' if attempts != 1 else ''} "
                "(runner.retry.attempts, 1 without retry), numbered from 0",
            ),
            "turns": (
                config.max_turns,
                f"runner.max_turns is {config.max_turns} (turns are numbered from 0)",
            ),
        }
    for name, (limit, why) in limits.items():
        values: list[int] | None = getattr(fault.when, name)
        for position, value in enumerate(values or []):
            if value >= limit:
                singular = name.removesuffix("s")
                yield _Problem((*at, "when", name, position), f"{singular} {value} never happens: {why}")


def _pipeline_problems(spec: str) -> Iterator[_Problem]:
    at: Loc = ("pipeline",)
    module_name, _, qualname = spec.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        yield _Problem(at, f"cannot import module {module_name!r}: {exc}")
        return
    except Exception as exc:  # the module's own code failed: say how, without its traceback
        yield _Problem(at, f"importing module {module_name!r} raised {type(exc).__name__}: {exc}")
        return
    for part in qualname.split("."):
        if not hasattr(found, part):
            yield _Problem(at, f"module {module_name!r} has no attribute {qualname!r}")
            return
        found = getattr(found, part)
    expected = f"expected async def {qualname.rpartition('.')[2]}(tasks, env_factory, engine)"
    if not inspect.iscoroutinefunction(found):
        yield _Problem(at, f"{spec!r} is not an async function; {expected}")
        return
    try:
        inspect.signature(found).bind(None, None, None)
    except TypeError as exc:
        yield _Problem(at, f"{spec!r} cannot be called with (tasks, env_factory, engine): {exc}; {expected}")
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass


# --- runner: -> RunnerConfig ------------------------------------------------------------------------------


def _build_runner_config(runner: Mapping[str, Any]) -> RunnerConfig:
    """``RunnerConfig(**runner)`` with every key and type checked first, in the file's order."""
    hints = typing.get_type_hints(RunnerConfig)
    known = [field.name for field in dataclasses.fields(RunnerConfig) if field.init]
    kwargs: dict[str, Any] = {}
    for key, value in runner.items():
        loc: Loc = ("runner", key)
        if key not in known:
            raise _Problem(loc, _unknown_field(key, known))
        if key == "retry":
            kwargs[key] = None if value is None else _build_retry_policy(value)
        else:
            kwargs[key] = _checked(loc, value, hints[key])
    try:
        return RunnerConfig(**kwargs)
    except UnsupportedConfigError as exc:
        raise _option_problem(exc) from None
    except (TypeError, ValueError) as exc:  # a field this loader does not know how to check
        raise _Problem(("runner",), str(exc)) from None


def _build_retry_policy(value: Any) -> RetryPolicy:
    loc: Loc = ("runner", "retry")
    hints = typing.get_type_hints(RetryPolicy)
    known = [
        field.name
        for field in dataclasses.fields(RetryPolicy)
        if field.init and field.name not in _RETRY_FIELDS_NOT_IN_FILES
    ]
    if not isinstance(value, dict):
        raise _Problem(
            loc, f"expected null or a mapping of RetryPolicy fields ({', '.join(known)}), got {_show(value)}"
        )
    kwargs: dict[str, Any] = {}
    for key, item in value.items():
        if key not in known:
            raise _Problem((*loc, key), _unknown_field(str(key), known))
        if key == "retry_on":
            kwargs[key] = _retry_on((*loc, key), item)
        else:
            kwargs[key] = _checked((*loc, key), item, hints[key])
    try:
        return RetryPolicy(**kwargs)
    except UnsupportedConfigError as exc:
        raise _option_problem(exc) from None
    except (TypeError, ValueError) as exc:
        raise _Problem(loc, str(exc)) from None


def _retry_on(loc: Loc, value: Any) -> tuple[type[Exception], ...]:
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise _Problem(loc, f"expected a list of exception names, got {_show(value)}")
    kinds: list[type[Exception]] = []
    for index, name in enumerate(value):
        try:
            kind = resolve_exception(name)
        except ValueError as exc:
            raise _Problem((*loc, index), str(exc)) from None
        if not issubclass(kind, Exception):
            raise _Problem(
                (*loc, index),
                f"{name!r} cannot be retried: retry_on takes Exception subclasses, and cancellation and "
                "KeyboardInterrupt always propagate",
            )
        kinds.append(kind)
    return tuple(kinds)


def _checked(loc: Loc, value: Any, annotation: Any) -> Any:
    """``value`` if it has a type ``annotation`` allows (an int is a float), else a problem at ``loc``."""
    members = _union_members(annotation) or (annotation,)
    simple = {bool, int, float, str, type(None)}
    if not all(member in simple for member in members):
        return value  # not a YAML scalar type: the dataclass checks it
    for member in members:
        if member is type(None) and value is None:
            return None
        if member is bool and isinstance(value, bool):
            return value
        if member is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if member is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if member is str and isinstance(value, str):
            return value
    raise _Problem(loc, f"expected {_describe(annotation)}, got {_show(value)}")


def _option_problem(exc: UnsupportedConfigError) -> _Problem:
    """``UnsupportedConfigError(option="RetryPolicy.attempts")`` -> a problem at ``runner.retry.attempts``."""
    message = str(exc).removeprefix(f"{exc.option}: ")
    parts = exc.option.split(".")
    loc: Loc = ("runner", "retry", *parts[1:]) if parts[0] == "RetryPolicy" else ("runner", *parts)
    return _Problem(loc, message)


def _named_exceptions() -> dict[str, Any]:
    """Every exception a bare name may mean: built-ins, then what gym_resilience exports."""
    names: dict[str, Any] = {
        name: value
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    for module in (gym_errors, gym_resilience):
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name, None)
            if isinstance(value, type) and issubclass(value, BaseException):
                names[name] = value
    return names
