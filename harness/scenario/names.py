"""What the names in a scenario file refer to: exception classes and the user's own code (``module:name``).

A user module may raise anything while it is imported, ``SystemExit`` and ``KeyboardInterrupt``
included: that is a problem of the scenario file that names it, never the end of the command. A name
that does not resolve gets the closest existing one as a suggestion.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import pkgutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gym_resilience
from gym_resilience import errors as gym_errors
from harness.scenario.messages import did_you_mean, error_text, show

__all__ = ["add_import_folders", "import_attribute", "resolve_exception"]

_ADDED: list[str] = []
"""The folders scenarios put on ``sys.path``: where a missing top-level module's near names are sought."""

_SCENARIO: list[str] = []
"""The folders of the scenario whose names are being resolved (the last ``add_import_folders`` call's):
a module they hold must be the one imported (see ``_imported_elsewhere``)."""


def add_import_folders(folders: Iterable[Path]) -> None:
    """Put ``folders`` first on ``sys.path``, in their order, for good: the user's modules are imported from
    them now, and isolated env workers (started later, with this ``sys.path``) import them again by name.
    Until the next call, they are the folders of the scenario whose names :func:`import_attribute`
    resolves."""
    entries = list(dict.fromkeys(str(folder.resolve()) for folder in folders))
    for entry in reversed(entries):
        if entry not in _ADDED:
            _ADDED.append(entry)
        if entry in sys.path:  # another scenario's folder, now behind the folders added since
            sys.path.remove(entry)
        sys.path.insert(0, entry)
    _SCENARIO[:] = entries


def import_attribute(module_name: str, qualname: str, purpose: str = "") -> Any:
    """``module_name:qualname`` imported.

    Raises:
        ValueError: the module does not import or has no such attribute, with the closest existing
            module or attribute name when one is close; ``purpose`` (`` for exception 'x'``) goes after
            the module's name in the message.
    """
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        clash = _imported_elsewhere(module_name, purpose)
        if clash is not None:
            raise ValueError(clash) from None
        hint = _near_module(module_name) if isinstance(exc, ModuleNotFoundError) else ""
        raise ValueError(f"cannot import module {show(module_name)}{purpose}: {exc}{hint}") from None
    except BaseException as exc:  # the module's own code failed: say how, without its traceback
        raise ValueError(f"importing module {show(module_name)}{purpose} raised {error_text(exc)}") from None
    clash = _imported_elsewhere(module_name, purpose)
    if clash is not None:
        raise ValueError(clash)
    for part in qualname.split("."):
        try:
            found = getattr(found, part)
        except BaseException:  # AttributeError, or whatever a module's __getattr__ raises
            names = [name for name in _names(found) if not name.startswith("_")]
            raise ValueError(
                f"module {show(module_name)} has no attribute {show(qualname)}{did_you_mean(part, names)}"
            ) from None
    return found


def _imported_elsewhere(module_name: str, purpose: str) -> str | None:
    """Why ``module_name`` is not the scenario's own module, if it is not: the scenario's folders hold a
    module of that name (or of a package above it), and the one imported is another, already in
    ``sys.modules`` (another scenario's folder held one of the same name, or it is installed) and
    silently used instead. None when it is the scenario's own, or its folders hold no such module."""
    search: list[str] = list(_SCENARIO)
    name = ""
    for part in module_name.split("."):
        name = f"{name}.{part}" if name else part
        try:
            own = importlib.machinery.PathFinder.find_spec(name, search) if search else None
        except (ImportError, OSError, ValueError):
            return None
        loaded = sys.modules.get(name)
        if own is None or loaded is None:
            return None
        if own.origin is not None:  # a module or a regular package: one file
            where = _origin(loaded)
            if where is None or not _same_file(where, own.origin):
                return (
                    f"cannot import module {show(module_name)}{purpose} from the scenario's folder: "
                    f"{show(name)} was already imported from {where or 'no file'} (another scenario's "
                    f"folder, or an installed module of that name), not from {own.origin}; a process holds "
                    "one module of a name: rename one of them, or put it in a package of its own"
                )
        search = list(own.submodule_search_locations or [])  # a namespace package: its folders here
    return None


def _origin(module: Any) -> str | None:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    return origin if isinstance(origin, str) else None


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):
        return a == b


def _names(value: Any) -> list[str]:
    try:
        return list(dir(value))
    except BaseException:  # a module's __dir__ is its own code too
        return []


def _near_module(module_name: str) -> str:
    """``; did you mean 'my_pkg.envs'?`` for a missing module whose package (or scenario folder) has a
    close one."""
    parent, _, last = module_name.rpartition(".")
    if not parent:  # top-level: only the scenario folders (listing every installed module would be slow)
        return did_you_mean(last, [info.name for info in pkgutil.iter_modules(_ADDED)])
    try:
        package = importlib.import_module(parent)
    except BaseException:  # the parent is missing too: the error names it already
        return ""
    search = getattr(package, "__path__", None)
    names = [info.name for info in pkgutil.iter_modules(search)] if search is not None else []
    return did_you_mean(last, names, prefix=f"{parent}.")


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
        found: Any = import_attribute(module_name, qualname, f" for exception {show(name)}")
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
                reason += did_you_mean(name, candidates)
            raise ValueError(reason)
        found = candidates[name]
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        raise ValueError(f"{name!r} is not an exception class")
    return found


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
