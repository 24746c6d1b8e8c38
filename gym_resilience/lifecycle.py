"""Services with a start and a stop: a ``with`` block starts one and stops it on every exit path."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Literal, Self

__all__ = ["Service"]


class Service(abc.ABC):
    """Something started by :meth:`start` and stopped by :meth:`stop`; ``with`` does both."""

    @abc.abstractmethod
    def start(self) -> Self:
        """Start it and return it."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop it; stopping one that is not running does nothing."""

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            # A start that failed or was interrupted half-way (Ctrl-C while it waits for a child) may
            # have started something: ``__exit__`` never runs for it.
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        self.stop()
        return False
