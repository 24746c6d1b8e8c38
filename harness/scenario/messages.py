"""How a problem in a scenario file is worded: its place (a field path), the value, what was expected,
and the near name the user probably meant.

Every message of the loader is built from these helpers, so a value, a type or a suggestion reads the
same in every error.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from gym_resilience.errors import show

__all__ = [
    "Loc",
    "Problem",
    "closest",
    "counted",
    "describe",
    "did_you_mean",
    "error_text",
    "field_path",
    "key_not_a_string",
    "show",
    "split_import_path",
    "union_members",
    "unknown_field",
]

Loc = tuple[str | int, ...]
"""A path into the scenario data: mapping keys and list indices, ``("faults", 2, "kind")``."""


class Problem(Exception):
    """One problem at a path in the data, before the file and line are attached.

    ``anchor`` is where in the file to point when that is not ``loc`` itself (a non-string key has no
    field path of its own).
    """

    def __init__(self, loc: Loc, reason: str, *, anchor: Loc | None = None) -> None:
        super().__init__(reason)
        self.loc = loc
        self.reason = reason
        self.anchor = loc if anchor is None else anchor


def field_path(loc: Sequence[Any]) -> str:
    """``("faults", 2, "kind")`` -> ``faults[2].kind``: a path into YAML or JSON data as messages give it.

    An ``int`` is a list index; ``True`` is not (it equals 1 in Python, but it is a boolean key), nor is
    any other key that is not a string: those read as the data writes them (``runner.true``), though a
    problem with such a key is reported at its mapping (:func:`key_not_a_string`).
    """
    path = ""
    for item in loc:
        if isinstance(item, int) and not isinstance(item, bool):
            path += f"[{item}]"
            continue
        if isinstance(item, str):
            name = item if item.isprintable() else repr(item)  # a line break in a key must not split it
        else:
            name = show(item) if isinstance(item, bool | int | float) or item is None else str(item)
        path += f".{name}" if path else name
    return path


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """``1 scenario``, ``2 scenarios``, ``0 scenarios``: a count and its noun, which agree (``plural``
    for a noun that does not take an ``s``: ``counted(2, "process", "processes")``)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


_KEY_KINDS = {bool: "a boolean", int: "an integer", float: "a number"}


def key_not_a_string(key: Any) -> str:
    """``key true is a boolean, not a string: ...``: the problem of a mapping key that YAML read as
    something else than a string (``true``, ``1``, ``null``, ``1.5``, a date), in the file's words."""
    text = show(key) if isinstance(key, bool | int | float) or key is None else str(key)
    kind = _KEY_KINDS.get(type(key), f"a {type(key).__name__}")
    fix = "keys must be strings (quote the key to make it one)"
    if key is None:
        return f"key null is not a string: {fix}"
    return f"key {text} is {kind}, not a string: {fix}"


def closest(name: str, known: Iterable[str]) -> str | None:
    """The one of ``known`` closest to ``name``, if any is close (``difflib``'s measure)."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str], *, prefix: str = "") -> str:
    """``"; did you mean 'faults'?"`` for the closest of ``known`` to ``name`` (after ``prefix``), or ``""``
    if none is close."""
    close = closest(name, known)
    return f"; did you mean {prefix + close!r}?" if close is not None else ""


def unknown_field(name: str, known: Sequence[str]) -> str:
    """``unknown field 'fualts'; did you mean 'faults'?``, or the fields there are when none is close."""
    return f"unknown field {show(name)}" + (
        did_you_mean(name, known) or (f"; expected one of {', '.join(known)}" if known else "")
    )


def split_import_path(text: str, what: str) -> tuple[str, str]:
    """``"my_pkg.envs:make_env"`` -> ``("my_pkg.envs", "make_env")``.

    Raises:
        ValueError: ``text`` is not ``module:name``; ``what`` names what it should point at.
    """
    module, _, attribute = text.partition(":")
    if not module or not attribute or ":" in attribute:
        raise ValueError(f"{what} must be 'module:name', got {show(text)}")
    return module, attribute


def error_text(exc: BaseException) -> str:
    """``SystemExit: 3``, or just ``KeyboardInterrupt`` when it has no message."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def union_members(annotation: Any) -> tuple[Any, ...] | None:
    """The members of ``X | Y`` (or ``Union[X, Y]``); None for anything else."""
    if typing.get_origin(annotation) in (typing.Union, type(int | str)):
        return typing.get_args(annotation)
    return None


def describe(annotation: Any, constraints: Sequence[Any] = ()) -> str:
    """What an annotation accepts, in the words of a YAML file: ``an integer >= 0``, ``one of 'a', 'b'``."""
    extra: tuple[Any, ...] = ()
    while typing.get_origin(annotation) is typing.Annotated:  # keeps ``| None``: null may be expected
        annotation, *metadata = typing.get_args(annotation)
        extra += tuple(metadata)
    bounds = _bounds([*constraints, *extra])
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(value) for value in typing.get_args(annotation))
    members = union_members(annotation)
    if members is not None:
        words = [describe(member) for member in members]
        if "a number" in words and "an integer" in words:
            words.remove("an integer")
        words = list(dict.fromkeys(words))
        if len(words) <= 2:
            return " or ".join(words)
        return ", ".join(words[:-1]) + f", or {words[-1]}"
    if origin is tuple:
        args = typing.get_args(annotation)
        if Ellipsis not in args:
            item = describe(args[0])
            return f"a list of {len(args)} {_plural(item) if len(args) != 1 else _bare(item)}"
        return "a list"
    if origin is list:
        return f"a list of {_plural(describe(typing.get_args(annotation)[0]))}"
    if (
        origin is dict
        or annotation is dict
        or (isinstance(annotation, type) and issubclass(annotation, BaseModel))
    ):
        return "a mapping"
    word = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return word.get(annotation, "a value") + bounds


def _bare(words: str) -> str:
    """``an integer >= 0`` -> ``integer >= 0``: the noun after a count of one."""
    for article in ("an ", "a "):
        if words.startswith(article):
            return words[len(article) :]
    return words


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
