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

Whatever the input, loading takes bounded time and memory: only regular files of at most
:data:`MAX_SCENARIO_BYTES` are read, the YAML may nest :data:`MAX_NESTING` levels and hold
:data:`MAX_VALUES` values with every alias expanded, integers fit in 64 bits, and a user module that a
scenario names may raise anything, ``SystemExit`` and ``KeyboardInterrupt`` included, while it is imported.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import math
import os
import stat
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
    "MAX_NESTING",
    "MAX_SCENARIO_BYTES",
    "MAX_VALUES",
    "SCENARIO_SUFFIXES",
    "field_path",
    "load_scenario",
    "load_scenarios",
    "parse_scenario",
    "read_input_file",
    "resolve_exception",
    "runner_config",
    "scenario_files",
]

SCENARIO_SUFFIXES = (".yaml", ".yml")
"""The files a directory given to :func:`load_scenarios` expands to."""

MAX_SCENARIO_BYTES = 256 * 1024
"""The largest scenario file read, 100 times the largest of the bundled suite; parsing YAML in pure Python
takes about a second per 256 KiB, so a larger file (a log pasted by mistake) gets its error quickly."""

MAX_NESTING = 32
"""How deeply a scenario's YAML may nest, aliases expanded; a scenario needs 6 levels
(``faults[0].when.rollouts[0]``)."""

MAX_VALUES = 20_000
"""How many values (scalars, lists, mappings) a scenario's YAML may hold with every alias expanded: a
few anchors that alias each other would otherwise expand to billions of values ("billion laughs")."""

_INT_LIMIT = 2**63
"""Integers in a scenario fit in a signed 64-bit integer, as the seeds and counts they feed must."""

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
        raw = read_input_file(path, max_bytes=MAX_SCENARIO_BYTES, what="scenario file")
    except ValueError as exc:
        raise ScenarioError(file=file, field="", reason=str(exc)) from None
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
            try:
                found = sorted(p for p in path.iterdir() if p.suffix in SCENARIO_SUFFIXES and p.is_file())
            except OSError as exc:
                reason = f"cannot list the directory: {exc.strerror}"
                raise ScenarioError(file=str(path), field="", reason=reason) from None
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


def read_input_file(path: str | Path, *, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, which holds at most ``max_bytes`` of them.

    The file's type is checked before it is opened, and it is opened without blocking, so a FIFO or a
    device (``/dev/zero``) is refused rather than read forever. ``what`` names the file in messages
    (``"scenario file"``).

    Raises:
        ValueError: the file is missing, not a regular file, too large or unreadable; the message says
            which, without the file's name.
    """
    try:
        _check_regular(os.stat(path).st_mode, what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except OSError as exc:
        raise ValueError(f"cannot read the file: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as stream:
        info = os.fstat(stream.fileno())
        _check_regular(info.st_mode, what)  # it may have been replaced since the first check
        if info.st_size > max_bytes:
            raise ValueError(_too_large(info.st_size, max_bytes, what))
        try:
            data = stream.read(max_bytes + 1)
        except OSError as exc:
            raise ValueError(f"cannot read the file: {exc.strerror}") from None
    if len(data) > max_bytes:  # it grew since fstat
        raise ValueError(_too_large(len(data), max_bytes, what))
    return data


def _check_regular(mode: int, what: str) -> None:
    if stat.S_ISDIR(mode):
        raise ValueError(f"is a directory, not a {what}")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise ValueError(f"is {kind}, not a regular file; give a {what}")


def _too_large(size: int, limit: int, what: str) -> str:
    readable = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
    return f"the file is {size:,} bytes; a {what} is at most {limit:,} bytes ({readable})"


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
        found: Any = _import_attribute(module_name, qualname, f" for exception {_show(name)}")
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


def _import_attribute(module_name: str, qualname: str, purpose: str = "") -> Any:
    """``module_name:qualname`` imported, for a scenario's ``pipeline`` or exception name.

    It is the user's code: importing it may raise anything, ``SystemExit`` and ``KeyboardInterrupt``
    included, and that is a problem of the scenario file that names it, not the end of the command.

    Raises:
        ValueError: the module does not import or has no such attribute; ``purpose`` (`` for exception
            'x'``) goes after the module's name in the message.
    """
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {_show(module_name)}{purpose}: {exc}") from None
    except BaseException as exc:  # the module's own code failed: say how, without its traceback
        raise ValueError(
            f"importing module {_show(module_name)}{purpose} raised {_error_text(exc)}"
        ) from None
    for part in qualname.split("."):
        try:
            found = getattr(found, part)
        except BaseException:  # AttributeError, or whatever a module's __getattr__ raises
            raise ValueError(f"module {_show(module_name)} has no attribute {_show(qualname)}") from None
    return found


def _error_text(exc: BaseException) -> str:
    """``SystemExit: 3``, or just ``KeyboardInterrupt`` when it has no message."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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
        raise ScenarioError(file=str(file), field=field_path(problem.loc), reason=problem.reason) from None


# --- step 1: parse ----------------------------------------------------------------------------------------


def _parse(text: str, file: str) -> tuple[Any, yaml.Node | None]:
    """``yaml.safe_load(text)``, and the document's root node (None for an empty document)."""
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text)  # the reader rejects control characters already here
        root = loader.get_single_node()
        if root is None:
            return None, None
        _check_nodes(loader, root, file)
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
    except _TooBig as exc:
        raise ScenarioError(file=file, field="", reason=str(exc), line=exc.line) from None
    finally:
        if loader is not None:
            loader.dispose()


class _TooBig(Exception):
    """The YAML nests too deeply or holds too many values, aliases expanded (internal)."""

    def __init__(self, reason: str, mark: Any) -> None:  # a yaml Mark, from the pure or the C parser
        super().__init__(reason)
        self.line: int | None = mark.line + 1 if mark is not None else None


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` that stops composing past :data:`MAX_NESTING` levels or :data:`MAX_VALUES` values,
    counting what every alias expands to, so neither a deep nor an exponentially aliased document
    ("billion laughs") costs more than the limits before it is refused."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._values = 0
        self._open: list[str] = []  # anchors of the nodes being composed: an alias to one is recursive
        self._expanded: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth), aliases expanded

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event: Any = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise _TooBig(
                    f"alias *{event.anchor} is inside the node it names, so it would expand forever",
                    event.start_mark,
                )
            if event.anchor in self.anchors:  # else the composer's own "undefined alias" error
                self._count(*self._expansion(self.anchors[event.anchor]), event.start_mark)
            return super().compose_node(parent, index)
        self._count(1, 1, event.start_mark)
        anchor = getattr(event, "anchor", None)
        self._depth += 1
        self._open.append(anchor or "")
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()
            self._depth -= 1

    def _count(self, values: int, depth: int, mark: Any) -> None:
        self._values += values
        if self._depth + depth > MAX_NESTING:
            raise _TooBig(f"the YAML nests deeper than {MAX_NESTING} levels (aliases expanded)", mark)
        if self._values > MAX_VALUES:
            raise _TooBig(f"the YAML holds more than {MAX_VALUES} values (aliases expanded)", mark)

    def _expansion(self, node: yaml.Node) -> tuple[int, int]:
        """(values, depth) of ``node`` with every alias in it expanded; linear in the distinct nodes."""
        key = id(node)  # every node stays referenced by the document while it loads: ids are stable
        if key not in self._expanded:
            children: list[yaml.Node] = []
            if isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            elif isinstance(node, yaml.MappingNode):
                children = [item for pair in node.value for item in pair]
            sizes = [self._expansion(child) for child in children]
            values = 1 + sum(size for size, _ in sizes)
            self._expanded[key] = (values, 1 + max((depth for _, depth in sizes), default=0))
        return self._expanded[key]


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


_TAG_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "timestamp": "a date"}


def _check_nodes(loader: yaml.SafeLoader, root: yaml.Node, file: str) -> None:
    """What ``safe_load`` would get wrong or fail on, named at its field: a key given twice (safe_load
    keeps the last, which in a scenario drops half a fault list), a scalar its tag cannot read
    (``2024-13-01`` is a malformed date, not a string), an integer beyond 64 bits."""
    seen_nodes: set[int] = set()

    def visit(node: yaml.Node, loc: Loc) -> None:
        if id(node) in seen_nodes:  # an alias
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            _check_scalar(loader, node, file, loc)
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[str, int] = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
                    visit(value, loc)
                    continue
                _check_scalar(loader, key, file, loc)
                line = key.start_mark.line + 1
                if key.value in first_line:
                    reason = f"duplicate field {key.value!r} (first given on line {first_line[key.value]})"
                    field = field_path((*loc, key.value))
                    raise ScenarioError(file=file, field=field, reason=reason, line=line)
                first_line[key.value] = line
                visit(value, (*loc, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                visit(item, (*loc, index))

    visit(root, ())


def _check_scalar(loader: yaml.SafeLoader, node: yaml.ScalarNode, file: str, loc: Loc) -> None:
    """Constructs ``node`` (the loader keeps the value for the document) or raises at its field."""
    kind = node.tag.rpartition(":")[2]
    line = node.start_mark.line + 1
    digits = node.value if len(node.value) <= 30 else f"{node.value[:20]}... ({len(node.value)} characters)"
    out_of_range = f"integer {digits} is out of range: integers in a scenario fit in 64 bits"
    if kind == "int" and len(node.value) > 100:  # int() of thousands of digits is slow, then refused
        raise ScenarioError(file=file, field=field_path(loc), reason=out_of_range, line=line)
    try:
        value = loader.construct_object(node)
    except yaml.MarkedYAMLError:
        raise
    except Exception as exc:  # a malformed value for its tag: ValueError, KeyError, OverflowError
        detail = f": {exc}" if isinstance(exc, ValueError) and str(exc) else ""
        reason = (
            f"cannot read {_show(node.value)} as {_TAG_WORDS.get(kind, node.tag)}{detail}; "
            "quote it to make it a string"
        )
        raise ScenarioError(file=file, field=field_path(loc), reason=reason, line=line) from None
    if isinstance(value, int) and not isinstance(value, bool) and not -_INT_LIMIT <= value < _INT_LIMIT:
        raise ScenarioError(file=file, field=field_path(loc), reason=out_of_range, line=line)


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
    keys: _KeyIndex = {}
    located = [
        (_locate(root, problem.anchor, keys), order, problem) for order, problem in enumerate(problems)
    ]
    (line, _column), _, first = min(located, key=lambda item: (item[0], item[1]))
    raise ScenarioError(file=file, field=field_path(first.loc), reason=first.reason, line=line)


_KeyIndex = dict[int, dict[str, tuple[yaml.Node, yaml.Node]]]
"""id(mapping node) -> its (key, value) nodes by key: a file with thousands of problems is located in
linear time."""


def _locate(root: yaml.Node, loc: Loc, index: _KeyIndex) -> tuple[int, int]:
    """The (line, column) of the field at ``loc``: its key's position in a mapping, its item's position in a
    list, or the nearest enclosing one that the file has (a missing field is reported at its parent)."""
    node = root
    mark = root.start_mark
    for item in loc:
        if isinstance(node, yaml.MappingNode):
            if id(node) not in index:
                # Later pairs win, as in the loader, whose merge (<<) puts merged keys first.
                index[id(node)] = {
                    key.value: (key, value) for key, value in node.value if isinstance(key, yaml.ScalarNode)
                }
            found = index[id(node)].get(str(item))
            if found is None:
                break
            key, node = found
            mark = key.start_mark
        elif isinstance(node, yaml.SequenceNode) and isinstance(item, int) and 0 <= item < len(node.value):
            node = node.value[item]
            mark = node.start_mark
        else:
            break
    return mark.line + 1, mark.column


def field_path(loc: Sequence[str | int]) -> str:
    """``("faults", 2, "kind")`` -> ``faults[2].kind``: a path into YAML or JSON data as messages give it."""
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
            continue
        name = item if item.isprintable() else repr(item)  # a line break in a key must not split the message
        path += f".{name}" if path else name
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
    if kind == "finite_number":
        return _Problem(loc, f"expected a finite number, got {_show(value)}")
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
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"
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
    return f"unknown field {_show(name)}" + (
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
            except BaseException as exc:  # a user's exception class runs its own code
                yield _Problem(
                    (*at, "exception"),
                    f"exception {fault.exception!r} cannot be raised with a message: "
                    f"{fault.exception}(message) raised {_error_text(exc)}; "
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
        found = _import_attribute(module_name, qualname)
    except ValueError as exc:
        yield _Problem(at, str(exc))
        return
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
            if not math.isfinite(value):  # an infinite deadline is no deadline: null says that
                raise _Problem(loc, f"expected a finite number, got {_show(value)}")
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
