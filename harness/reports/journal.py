"""The JSON journal of a chaos run: written, read back, and reduced to what two runs must share.

The journal is ``RunJournal.to_json()`` with sorted keys, so a diff of two journals shows what changed
and nothing else. ``comparable_journal`` drops the measurements (every ``*_s`` field, ``started_at``,
and the observed value of timing probes such as ``wall_time_ratio``): running a suite twice must give
equal comparable journals.

The records of ``harness.judge.results`` are the one model of a journal. ``load_journal`` builds them
back; ``read_journal_file`` and ``strict_journal`` read a journal a user hands over (``chaos record``)
within bounded time and memory, and check the fields a reader names against those same records' types,
strictly (no string for a number), with one message naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import secrets
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from harness.judge.results import (
    Attempt,
    ClusterNode,
    EndpointSpan,
    FaultFiring,
    ProbeResult,
    RolloutSpan,
    RunJournal,
    ScenarioResult,
    Status,
    TurnSpan,
)

__all__ = [
    "comparable_journal",
    "journal_from_json",
    "json_type",
    "load_journal",
    "read_journal_file",
    "strict_journal",
    "write_atomically",
    "write_journal",
]

STATUSES = get_args(Status)

MEASURED_PROBES = frozenset({"wall_time_ratio", "wall_over_injected_latency"})
"""Probes whose observed value is a measurement: it differs between runs, only ``held`` must not."""


def write_journal(journal: RunJournal, path: str | os.PathLike[str]) -> Path:
    """Writes ``journal`` as JSON (indent 2, sorted keys) to ``path`` and returns the path.

    The file is replaced in one step, so a run interrupted while writing leaves the previous journal
    rather than half of a new one. An observed value JSON cannot hold (a numpy scalar, a set) is
    written as the nearest JSON value rather than losing the whole journal at the end of a run.
    """
    text = json.dumps(journal.to_json(), indent=2, sort_keys=True, default=_to_json_value) + "\n"
    return write_atomically(path, text.encode("utf-8"))


def write_atomically(path: str | os.PathLike[str], data: bytes) -> Path:
    """Writes ``data`` to ``path`` in one step and returns the path; missing parent folders are created.

    The bytes go to a new temporary file in the same folder, which then replaces ``path``: a reader sees
    the old file or the new one, never half of one, whether the run is interrupted, the disk fills up,
    or two runs write the same report at once.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    # O_EXCL: never write through a file or link that is already there; 0o666: the umask decides, as
    # for any file the user creates.
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    return path


def load_journal(path: str | os.PathLike[str]) -> RunJournal:
    """Reads a journal ``write_journal`` wrote.

    Raises:
        ValueError: the file is not JSON or not a journal; the message names the file and the field.
        OSError: the file cannot be read.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a chaos journal: invalid JSON: {exc}") from exc
    try:
        return journal_from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def journal_from_json(data: Any) -> RunJournal:
    """The ``RunJournal`` that ``RunJournal.to_json()`` produced ``data`` from (its ``status`` is derived).

    Raises:
        ValueError: ``data`` is not a journal; the message names the field.
    """
    where = "journal"
    try:
        _expect_mapping(data)
        scenarios = []
        for number, item in enumerate(data["scenarios"]):
            where = f"scenarios[{number}]"
            _expect_mapping(item)
            fields = dict(item)
            where = f"scenarios[{number}].probes"
            fields["probes"] = [ProbeResult(**probe) for probe in fields.get("probes", [])]
            where = f"scenarios[{number}].firings"
            fields["firings"] = [FaultFiring(**firing) for firing in fields.get("firings", [])]
            where = f"scenarios[{number}].rollouts"
            fields["rollouts"] = [_rollout(rollout) for rollout in fields.get("rollouts", [])]
            where = f"scenarios[{number}].baseline_rollouts"
            fields["baseline_rollouts"] = [_rollout(item) for item in fields.get("baseline_rollouts", [])]
            where = f"scenarios[{number}].endpoints"
            fields["endpoints"] = [_endpoint(endpoint) for endpoint in fields.get("endpoints", [])]
            for name in ("attempts", "baseline_attempts"):
                where = f"scenarios[{number}].{name}"
                fields[name] = [Attempt(**_mapping(item)) for item in fields.get(name, [])]
            where = f"scenarios[{number}].nodes"
            fields["nodes"] = [ClusterNode(**_mapping(node)) for node in fields.get("nodes", [])]
            where = f"scenarios[{number}]"
            if fields.get("status") not in STATUSES:
                raise TypeError(f"status must be one of {', '.join(STATUSES)}, got {fields.get('status')!r}")
            scenarios.append(ScenarioResult(**fields))
        where = "journal"
        return RunJournal(
            device=data["device"],
            scenarios=scenarios,
            started_at=data.get("started_at", ""),
            total_s=data.get("total_s", 0.0),
        )
    except KeyError as exc:
        raise ValueError(f"not a chaos journal: {where}: missing field {exc.args[0]!r}") from exc
    except TypeError as exc:  # an unknown or missing keyword, or a list where a record should be
        raise ValueError(f"not a chaos journal: {where}: {exc}") from exc


def comparable_journal(data: RunJournal | Mapping[str, Any]) -> dict[str, Any]:
    """The journal without what is measured, so two runs of one suite can be compared with ``==``.

    Drops every key ending in ``_s`` and ``started_at`` (outside a scenario's ``spec``, whose
    ``delay_s`` and ``latency_s`` are settings), the observed value of measured probes
    (``wall_time_ratio`` and any probe named ``*_s``; whether it held stays), and orders each
    scenario's fault firings by what they hit rather than when, since concurrent rollouts reach their
    faults in a different order from run to run. Accepts a ``RunJournal`` or its JSON (loaded or not).
    """
    raw = data.to_json() if isinstance(data, RunJournal) else data
    # Through JSON and back: tuples and lists, or a numpy scalar and its float, then compare equal.
    plain = json.loads(json.dumps(raw, sort_keys=True, default=_to_json_value))
    reduced = _drop_measured(plain)
    if not isinstance(reduced, dict):
        raise ValueError("not a chaos journal: expected a JSON object at the top")
    for scenario in reduced.get("scenarios", []):
        for probe in scenario.get("probes", []):
            name = str(probe.get("probe", ""))
            if name in MEASURED_PROBES or name.endswith("_s"):
                probe.pop("observed", None)
        if "firings" in scenario:
            scenario["firings"] = sorted(
                scenario["firings"], key=lambda item: json.dumps(item, sort_keys=True)
            )
    if not isinstance(reduced, dict):
        raise ValueError("not a chaos journal: expected a JSON object at the top")
    return reduced


def _drop_measured(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            # A scenario's spec holds settings (delay_s, latency_s), not measurements: kept whole.
            key: item if key == "spec" else _drop_measured(item)
            for key, item in value.items()
            if key == "spec" or not (key.endswith("_s") or key == "started_at")
        }
    if isinstance(value, list):
        return [_drop_measured(item) for item in value]
    return value


def _rollout(data: Any) -> RolloutSpan:
    _expect_mapping(data)
    fields = dict(data)
    fields["spans"] = [TurnSpan(**span) for span in fields.get("spans", [])]
    return RolloutSpan(**fields)


def _endpoint(data: Any) -> EndpointSpan:
    _expect_mapping(data)
    fields = dict(data)
    # JSON has no tuples: each (start, end) comes back as a list.
    fields["down_s"] = [(float(start), float(end)) for start, end in fields.get("down_s", [])]
    return EndpointSpan(**fields)


def _mapping(value: Any) -> Mapping[str, Any]:
    _expect_mapping(value)
    return dict(value)


def _expect_mapping(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected an object, got {type(value).__name__}")


def _to_json_value(value: Any) -> Any:
    for method in ("tolist", "item"):  # numpy arrays and scalars, torch tensors
        convert = getattr(value, method, None)
        if callable(convert):
            return convert()
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return repr(value)


# --- Strict reading of a journal a user hands over. ---------------------------------------------------

Reads = Mapping[type, Mapping[str, bool]]
"""The fields a reader checks, per record of the journal (``RunJournal``, ``ScenarioResult``,
``FaultFiring``, ...), each with whether it must be there; every other field is ignored."""


def read_journal_file(path: Path, *, max_bytes: int, max_nesting: int) -> Any:
    """The JSON of the journal at ``path``, read within bounded time and memory: at most ``max_bytes``,
    nested at most ``max_nesting`` levels, no integer of over 100 digits.

    Raises:
        ValueError: the file is missing, too large, not a regular file, not UTF-8 or not JSON; the
            message says which, without the path.
    """
    from harness.scenario.source import read_input_file

    raw = read_input_file(path, max_bytes=max_bytes, what="journal")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
    too_deep = f"not a chaos journal: the JSON nests deeper than {max_nesting} levels"
    try:
        data = json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise ValueError(too_deep) from None
    except ValueError as exc:
        raise ValueError(f"not a chaos journal: invalid JSON: {exc}") from None
    if _nested_deeper_than(data, max_nesting):
        raise ValueError(too_deep)
    return data


def strict_journal(data: Any, reads: Reads) -> Any:
    """``data`` checked, strictly, against the journal's records, field by field as ``reads`` names them.

    The result has the named fields of each record as attributes (a ``RunJournal``'s ``scenarios``, a
    scenario's ``firings``, ...), with the records' own types: a fault index or a rollout is a
    non-negative integer, a file a string.

    Raises:
        ValueError: ``data`` is not such a journal: ``not a chaos journal: FIELD: what was expected``.
    """
    from pydantic import ValidationError

    from harness.scenario.messages import field_path

    if not isinstance(data, dict):
        raise ValueError(f"not a chaos journal: expected a JSON object at the top, got {json_type(data)}")
    try:
        return _strict_model(RunJournal, _frozen(reads)).model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = field_path(error["loc"])
        if error["type"] == "missing":
            message = "missing field"
        elif error["type"] in ("model_type", "dict_type"):
            message = f"expected an object, got {json_type(error['input'])}"
        else:
            message = f"{error['msg'][0].lower()}{error['msg'][1:]}, got {json_type(error['input'])}"
        raise ValueError(f"not a chaos journal: {where}: {message}") from None


def _frozen(reads: Reads) -> tuple[tuple[type, tuple[tuple[str, bool], ...]], ...]:
    return tuple((record, tuple(fields.items())) for record, fields in reads.items())


@functools.cache
def _strict_model(record: type, reads: tuple[tuple[type, tuple[tuple[str, bool], ...]], ...]) -> Any:
    """A strict pydantic model of the dataclass ``record``: the fields ``reads`` names, with the types the
    dataclass declares (a record ``reads`` names in turn becomes its own model). Made on first use, so
    this module imports without pydantic."""
    from pydantic import ConfigDict, create_model

    fields_of = dict(reads)
    hints = typing.get_type_hints(record, include_extras=True)
    declared = {field.name: field for field in dataclasses.fields(record)}
    model_fields: dict[str, Any] = {}
    for name, required in fields_of[record]:
        hint = hints[name]
        if typing.get_origin(hint) is list and typing.get_args(hint)[0] in fields_of:
            hint = list[_strict_model(typing.get_args(hint)[0], reads)]  # type: ignore[misc]
        model_fields[name] = (hint, ... if required else _default(declared[name]))
    config = ConfigDict(extra="ignore", strict=True)
    return create_model(record.__name__, __config__=config, **model_fields)


def _default(field: dataclasses.Field[Any]) -> Any:
    """A field's default where a reader may leave it out: the record's own, else None."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def json_type(value: Any) -> str:
    """What a JSON value is, in words (``an object``, ``a list``, ``null``, ...), for messages."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _json_int(text: str) -> int:
    """An integer of the journal; thousands of digits are refused before ``int()`` spends time on them."""
    if len(text) > 100:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _nested_deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return False
