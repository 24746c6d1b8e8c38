"""Which scenarios a command runs: the files' suite, and the ``-k`` expression and ``--tag`` that pick
from it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cli.exits import EXIT_HELD, EXIT_INVALID, InvalidInput

if TYPE_CHECKING:
    from harness.judge.results import ScenarioResult
    from harness.scenario.compile import CompiledScenario
    from harness.scenario.loader import Suite

__all__ = ["Keyword", "invalid_results", "load_paths", "select", "validate_paths"]


def load_paths(paths: Sequence[Path]) -> Suite:
    """Every scenario ``paths`` name, loaded, after one line on stderr per problem of each invalid path
    and file: every file is checked, however many before it were invalid."""
    from harness.scenario.loader import load_suite

    suite = load_suite(paths)
    for problem in suite.problems:
        print(f"invalid scenario: {problem}", file=sys.stderr)
    return suite


def validate_paths(paths: Sequence[Path]) -> int:
    suite = load_paths(paths)
    for scenario in suite.scenarios:
        print(f"{scenario.file}: valid ({scenario.title})")
    return EXIT_HELD if suite.valid else EXIT_INVALID


class Keyword:
    """A ``-k`` expression: words (substrings of a file name or title, any case) joined with ``and``,
    ``or``, ``not`` and parentheses, ``or`` binding loosest, as in pytest."""

    def __init__(self, expression: str) -> None:
        self._text = expression
        self._tokens = expression.replace("(", " ( ").replace(")", " ) ").split()
        self._position = 0
        if not self._tokens:
            raise self._invalid("it is empty")
        self._tree = self._or()
        if self._position < len(self._tokens):
            raise self._invalid(f"unexpected {self._tokens[self._position]!r}")

    def matches(self, *texts: str) -> bool:
        haystack = [text.lower() for text in texts]
        return self._evaluate(self._tree, haystack)

    def _invalid(self, why: str) -> InvalidInput:
        return InvalidInput(f"gym-resilience: -k {self._text!r}: {why}")

    def _next(self) -> str | None:
        return self._tokens[self._position] if self._position < len(self._tokens) else None

    def _or(self) -> Any:
        tree = self._and()
        while self._next() == "or":
            self._position += 1
            tree = ("or", tree, self._and())
        return tree

    def _and(self) -> Any:
        tree = self._not()
        while self._next() == "and":
            self._position += 1
            tree = ("and", tree, self._not())
        return tree

    def _not(self) -> Any:
        token = self._next()
        if token is None:
            raise self._invalid("it ends where a word is expected")
        self._position += 1
        if token == "not":
            return ("not", self._not())
        if token == "(":
            tree = self._or()
            if self._next() != ")":
                raise self._invalid("a '(' is never closed")
            self._position += 1
            return tree
        if token in ("and", "or", ")"):
            raise self._invalid(f"expected a word, got {token!r}")
        return ("word", token.lower())

    def _evaluate(self, tree: Any, haystack: list[str]) -> bool:
        match tree:
            case ("word", word):
                return any(word in text for text in haystack)
            case ("not", inner):
                return not self._evaluate(inner, haystack)
            case ("and", left, right):
                return self._evaluate(left, haystack) and self._evaluate(right, haystack)
            case ("or", left, right):
                return self._evaluate(left, haystack) or self._evaluate(right, haystack)
        raise AssertionError(tree)


def _tags(text: str | None) -> set[str]:
    return {tag.strip() for tag in (text or "").split(",") if tag.strip()}


def select(scenarios: Sequence[CompiledScenario], args: argparse.Namespace) -> list[CompiledScenario]:
    """The scenarios ``-k`` and ``--tags`` select (all when neither is given)."""
    keyword = Keyword(args.keyword) if args.keyword is not None else None
    tags = _tags(args.tags)
    return [
        scenario
        for scenario in scenarios
        if (keyword is None or keyword.matches(scenario.file.name, scenario.title))
        and (not tags or tags & set(scenario.spec.tags))
    ]


def invalid_results(suite: Suite) -> list[ScenarioResult]:
    """One journal entry per invalid path or file, status ``invalid``, its problems as the message."""
    from harness.judge.results import ScenarioResult

    by_file: dict[str, list[str]] = {}
    for problem in suite.problems:
        by_file.setdefault(problem.file, []).append(str(problem))
    return [
        ScenarioResult(file=file, title="", status="invalid", message="\n".join(lines))
        for file, lines in by_file.items()
    ]
