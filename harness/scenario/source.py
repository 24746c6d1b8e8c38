"""Reading scenario files: which files a path names, their bytes within bounds, their YAML with the line
of every field.

Whatever the input, reading takes bounded time and memory: only regular files of at most
:data:`MAX_SCENARIO_BYTES` are read, the YAML may nest :data:`MAX_NESTING` levels and hold
:data:`MAX_VALUES` values with every alias expanded, and integers fit in 64 bits.

The text becomes plain data with ``yaml.safe_load`` semantics (the same ``SafeLoader``), and the YAML node
tree is kept beside it, because only the nodes know line numbers (:func:`locate`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.errors import ScenarioError
from harness.scenario.messages import Loc, field_path, show

__all__ = [
    "MAX_NESTING",
    "MAX_SCENARIO_BYTES",
    "MAX_VALUES",
    "SCENARIO_SUFFIXES",
    "Document",
    "locate",
    "parse_yaml",
    "read_input_file",
    "read_scenario_text",
    "scenario_files",
]

SCENARIO_SUFFIXES = (".yaml", ".yml")
"""The files a directory given to :func:`scenario_files` expands to."""

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


# --- files ------------------------------------------------------------------------------------------------


def scenario_files(paths: Sequence[str | Path]) -> tuple[list[Path], list[ScenarioError]]:
    """The scenario files ``paths`` name, and a problem for each path that names none.

    Files are taken as given, directories expand to their ``*.yaml`` and ``*.yml`` files (not recursive),
    sorted by name; a file named twice is listed once. A path that does not exist, a directory that
    cannot be listed or holds no scenario file is a problem, and the other paths are still expanded.
    """
    files: list[Path] = []
    problems: list[ScenarioError] = []
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        try:
            found = _expand(path)
        except ScenarioError as problem:
            problems.append(problem)
            continue
        for file in found:
            key = file.resolve()
            if key not in seen:
                seen.add(key)
                files.append(file)
    return files, problems


def _expand(path: Path) -> list[Path]:
    if path.is_dir():
        try:
            found = sorted(p for p in path.iterdir() if p.suffix in SCENARIO_SUFFIXES and p.is_file())
        except OSError as exc:
            reason = f"cannot list the directory: {exc.strerror}"
            raise ScenarioError(file=str(path), field="", reason=reason) from None
        if not found:
            reason = "no scenario files (*.yaml, *.yml) in this directory"
            raise ScenarioError(file=str(path), field="", reason=reason)
        return found
    if path.exists():
        return [path]
    raise ScenarioError(file=str(path), field="", reason="no such file or directory")


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


def read_scenario_text(path: Path) -> str:
    """The text of the scenario file ``path``.

    Raises:
        ScenarioError: the file cannot be read (see :func:`read_input_file`) or is not UTF-8.
    """
    file = str(path)
    try:
        raw = read_input_file(path, max_bytes=MAX_SCENARIO_BYTES, what="scenario file")
    except ValueError as exc:
        raise ScenarioError(file=file, field="", reason=str(exc)) from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        reason = f"not UTF-8 text (byte {raw[exc.start]:#04x})"
        raise ScenarioError(file=file, field="", reason=reason, line=line) from None


# --- YAML -------------------------------------------------------------------------------------------------


@dataclass
class Document:
    """A parsed scenario file: its data as ``yaml.safe_load`` gives it, and the node tree (None for an
    empty document), or the problems that stopped parsing."""

    data: Any
    root: yaml.Node | None
    problems: list[ScenarioError] = field(default_factory=list)


def parse_yaml(text: str, file: str) -> Document:
    """``yaml.safe_load(text)`` and its nodes; every key given twice and every scalar its tag cannot read
    is a problem (then there is no data), as is a syntax error (the one problem there is then)."""
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text)  # the reader rejects control characters already here
        root = loader.get_single_node()
        if root is None:
            return Document(None, None)
        problems = _node_problems(loader, root, file)
        if problems:
            return Document(None, root, problems)
        return Document(loader.construct_document(root), root)
    except yaml.MarkedYAMLError as exc:
        return Document(None, None, [_yaml_error(exc, file)])
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        reason = f"invalid YAML: unacceptable character {character}: {exc.reason}"
        return Document(None, None, [ScenarioError(file=file, field="", reason=reason, line=line)])
    except yaml.YAMLError as exc:
        return Document(None, None, [ScenarioError(file=file, field="", reason=f"invalid YAML: {exc}")])
    except _TooBig as exc:
        return Document(None, None, [ScenarioError(file=file, field="", reason=str(exc), line=exc.line)])
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


def _node_problems(loader: yaml.SafeLoader, root: yaml.Node, file: str) -> list[ScenarioError]:
    """What ``safe_load`` would get wrong or fail on, named at its field: a key given twice (safe_load
    keeps the last, which in a scenario drops half a fault list), a scalar its tag cannot read
    (``2024-13-01`` is a malformed date, not a string), an integer beyond 64 bits. In file order."""
    problems: list[ScenarioError] = []
    seen_nodes: set[int] = set()

    def scalar(node: yaml.ScalarNode, loc: Loc) -> None:
        problem = _scalar_problem(loader, node, file, loc)
        if problem is not None:
            problems.append(problem)

    def visit(node: yaml.Node, loc: Loc) -> None:
        if id(node) in seen_nodes:  # an alias
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            scalar(node, loc)
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[str, int] = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
                    visit(value, loc)
                    continue
                scalar(key, loc)
                line = key.start_mark.line + 1
                if key.value in first_line:
                    reason = f"duplicate field {key.value!r} (first given on line {first_line[key.value]})"
                    field = field_path((*loc, key.value))
                    problems.append(ScenarioError(file=file, field=field, reason=reason, line=line))
                else:
                    first_line[key.value] = line
                visit(value, (*loc, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                visit(item, (*loc, index))

    visit(root, ())
    return problems


def _scalar_problem(
    loader: yaml.SafeLoader, node: yaml.ScalarNode, file: str, loc: Loc
) -> ScenarioError | None:
    """Constructs ``node`` (the loader keeps the value for the document), or says why it cannot be."""
    kind = node.tag.rpartition(":")[2]
    line = node.start_mark.line + 1
    digits = node.value if len(node.value) <= 30 else f"{node.value[:20]}... ({len(node.value)} characters)"
    out_of_range = f"integer {digits} is out of range: integers in a scenario fit in 64 bits"
    if kind == "int" and len(node.value) > 100:  # int() of thousands of digits is slow, then refused
        return ScenarioError(file=file, field=field_path(loc), reason=out_of_range, line=line)
    try:
        value = loader.construct_object(node)
    except yaml.MarkedYAMLError:
        raise
    except Exception as exc:  # a malformed value for its tag: ValueError, KeyError, OverflowError
        detail = f": {exc}" if isinstance(exc, ValueError) and str(exc) else ""
        reason = (
            f"cannot read {show(node.value)} as {_TAG_WORDS.get(kind, node.tag)}{detail}; "
            "quote it to make it a string"
        )
        return ScenarioError(file=file, field=field_path(loc), reason=reason, line=line)
    if isinstance(value, int) and not isinstance(value, bool) and not -_INT_LIMIT <= value < _INT_LIMIT:
        return ScenarioError(file=file, field=field_path(loc), reason=out_of_range, line=line)
    return None


# --- where a field is -------------------------------------------------------------------------------------

_KeyIndex = dict[int, dict[str, tuple[yaml.Node, yaml.Node]]]
"""id(mapping node) -> its (key, value) nodes by key: a file with thousands of problems is located in
linear time."""


class Locator:
    """Finds the (line, column) of a field path in a document's nodes."""

    def __init__(self, root: yaml.Node) -> None:
        self._root = root
        self._index: _KeyIndex = {}

    def __call__(self, loc: Loc) -> tuple[int, int]:
        return locate(self._root, loc, self._index)


def locate(root: yaml.Node, loc: Loc, index: _KeyIndex | None = None) -> tuple[int, int]:
    """The (line, column) of the field at ``loc``: its key's position in a mapping, its item's position in a
    list, or the nearest enclosing one that the file has (a missing field is reported at its parent)."""
    index = {} if index is None else index
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
