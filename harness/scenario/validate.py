"""The data of a scenario file against the models of ``harness.scenario.spec``: every problem they
find, in the file's words, and the parts that are valid.

A file with a problem in one part still has its other parts checked further (imports, cross-field
rules), so that one run of the loader reports every problem of the file: :class:`Parts` says which top-level
fields, faults and probes validated.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from harness.scenario.messages import (
    Loc,
    Problem,
    describe,
    key_not_a_string,
    show,
    union_members,
    unknown_field,
)
from harness.scenario.spec import Fault, Probe, Scenario

__all__ = ["Parts", "validate_parts"]

_TAG = "target"
"""The field that tells the members of the one tagged union of the models (``Fault``) apart."""

_LISTS: dict[str, TypeAdapter[Any]] = {"faults": TypeAdapter(Fault), "probes": TypeAdapter(Probe)}
"""The list fields whose items validate one by one: a bad fault leaves the others checkable."""


@dataclasses.dataclass(frozen=True)
class Parts:
    """What of a scenario validated.

    ``spec`` holds every valid top-level field, defaults in place of the invalid ones; ``valid`` names
    the top-level fields that validated as given (or were not given); ``faults`` pairs each valid fault
    with its index in the file.
    """

    spec: Scenario
    valid: frozenset[str]
    faults: tuple[tuple[int, Any], ...]

    @property
    def complete(self) -> bool:
        """Whether the whole file validated (then ``spec`` is exactly the file)."""
        return self.valid >= frozenset(_field_keys())


def _field_keys() -> list[str]:
    return [field.alias or name for name, field in Scenario.model_fields.items()]


def validate_parts(data: dict[str, Any]) -> tuple[Parts, list[Problem]]:
    """The valid parts of ``data`` (a mapping) and every problem the models find in it.

    A key that is not a string (YAML reads ``true``, ``1``, ``null`` as such) is a problem wherever a
    mapping holds it, in the models' fields or in the free-form ``runner`` mapping alike, reported at its
    mapping; the rest of the file is checked as if the key were not there.
    """
    keys = _key_problems(data)
    if keys:
        data = _string_keys_only(data)
    try:
        spec = Scenario.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    else:
        if not keys:
            return Parts(spec, frozenset(_field_keys()), tuple(enumerate(spec.faults))), []
        errors = []
    found = [_problem_from_pydantic(error) for error in errors]
    # A value of the wrong type (``eq: {1: 2}``) is reported as that: its keys do not matter then.
    keys = [key for key in keys if not any(key.loc[: len(other.loc)] == other.loc for other in found)]
    problems = _unique(keys + found)
    bad = {error["loc"][0] for error in errors if error["loc"]}
    values: dict[str, Any] = {}
    valid: set[str] = set()
    faults: list[tuple[int, Any]] = []
    for name, field in Scenario.model_fields.items():
        key = field.alias or name
        if key not in data:
            valid.add(key)
            continue
        if key in _LISTS and isinstance(data[key], list):
            items = _valid_items(key, data[key])
            values[name] = [item for _, item in items]
            if key == "faults":
                faults = items
            if len(items) == len(data[key]):
                valid.add(key)
        elif key not in bad:
            values[name] = data[key]
            valid.add(key)
    if "title" not in values:
        values["title"] = ""
    spec = Scenario.model_validate(values)
    return Parts(spec, frozenset(valid), tuple(faults)), problems


def _valid_items(key: str, items: list[Any]) -> list[tuple[int, Any]]:
    valid = []
    for index, item in enumerate(items):
        try:
            valid.append((index, _LISTS[key].validate_python(item)))
        except ValidationError:
            continue
    return valid


def _key_problems(data: Any, loc: Loc = ()) -> list[Problem]:
    """A problem for each key that is not a string in ``data``'s mappings, however deeply nested, at the
    path of its mapping; a mapping that YAML aliases in several places is reported once."""
    problems: list[Problem] = []
    seen: set[int] = set()

    def visit(value: Any, at: Loc) -> None:
        if not isinstance(value, dict | list) or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, list):
            for index, item in enumerate(value):
                visit(item, (*at, index))
            return
        for key, item in value.items():
            if isinstance(key, str):
                visit(item, (*at, key))
            else:
                problems.append(_key_problem(at, key))

    visit(data, loc)
    return problems


def _string_keys_only(data: Any) -> Any:
    """``data`` without the mapping keys that are not strings, however deeply nested (a copy)."""
    if isinstance(data, dict):
        return {key: _string_keys_only(value) for key, value in data.items() if isinstance(key, str)}
    if isinstance(data, list):
        return [_string_keys_only(item) for item in data]
    return data


def _key_problem(mapping: Loc, key: Any) -> Problem:
    """The problem of ``key``, not a string, in the mapping at ``mapping``: reported at the mapping (the
    key has no field path of its own), pointing at the key's line when the locator finds its text."""
    text = "null" if key is None else show(key) if isinstance(key, bool | int | float) else str(key)
    return Problem(mapping, key_not_a_string(key), anchor=(*mapping, text))


def _unique(problems: list[Problem]) -> list[Problem]:
    """Without repeats: a union's members each report the same value at the same place."""
    seen: set[tuple[Loc, str]] = set()
    unique = []
    for problem in problems:
        if (problem.loc, problem.reason) not in seen:
            seen.add((problem.loc, problem.reason))
            unique.append(problem)
    return unique


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
        members = union_members(annotation)
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
        members = union_members(annotation)
        if members is not None:
            not_none = [member for member in members if member is not type(None)]
            if len(not_none) == 1 and len(members) == 2:
                annotation = not_none[0]  # pydantic reports X | None as X: no union tag in the loc
                continue
        return annotation, constraints


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


def _problem_from_pydantic(error: ErrorDetails) -> Problem:
    kind = error["type"]
    ctx = error.get("ctx", {})
    value = error.get("input")
    spot = _walk(tuple(error["loc"]))
    loc, expected = spot.loc, spot.annotation
    if kind == "missing":
        parent = _walk(tuple(error["loc"][:-1]))
        if typing.get_origin(parent.annotation) is tuple:
            return Problem(parent.loc, f"expected {describe(parent.annotation)}, got {_count(value)}")
        return Problem(loc, f"missing required field {loc[-1]!r}")
    if kind == "extra_forbidden":
        known = _field_names(spot.owner) if spot.owner is not None else []
        return Problem(loc, unknown_field(str(loc[-1]), known))
    if kind == "invalid_key" or (error["loc"] and error["loc"][-1] == "[key]"):
        # A mapping key that is not a string: pydantic's loc ends with the key for a model, with the key
        # and "[key]" for a dict, the key made a string (or True made 1); the input is the key as it was.
        mapping = tuple(error["loc"][:-1] if kind == "invalid_key" else error["loc"][:-2])
        return _key_problem(_walk(mapping).loc, value)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        discriminator = str(ctx.get("discriminator", _TAG)).strip("'")
        members = union_members(_strip(expected)[0]) or ()
        tags = [
            tag for member in members if _is_model(member) for tag in _literal_values(member, discriminator)
        ]
        choices = ", ".join(repr(tag) for tag in tags)
        if kind == "union_tag_not_found":
            if not isinstance(value, dict):
                return Problem(loc, f"expected a mapping, got {show(value)}")
            return Problem(
                (*loc, discriminator), f"missing required field {discriminator!r}; expected one of {choices}"
            )
        tag = value.get(discriminator) if isinstance(value, dict) else None
        return Problem((*loc, discriminator), f"expected one of {choices}, got {show(tag)}")
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return Problem(loc, str(ctx["error"]))
    if kind == "finite_number":
        return Problem(loc, f"expected a finite number, got {show(value)}")
    if kind in ("too_short", "too_long") and typing.get_origin(expected) is tuple:
        return Problem(loc, f"expected {describe(expected)}, got {_count(value)}")
    if expected is None:
        return Problem(loc, f"invalid value {show(value)}")
    return Problem(loc, f"expected {describe(expected, spot.constraints)}, got {show(value)}")


def _count(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"{len(value)} item{'' if len(value) == 1 else 's'}"
    return show(value)


def _literal_values(model: type[BaseModel], name: str) -> tuple[Any, ...]:
    field = model.model_fields.get(name)
    return typing.get_args(field.annotation) if field is not None else ()
