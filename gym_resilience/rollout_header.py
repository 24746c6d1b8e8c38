"""The rollout a request serves, carried on the wire: the ``x-gym-resilience-rollout`` HTTP header.

A fault proxy (or a server's log) sees only bytes; this header tells it which rollout, attempt and
turn a request belongs to, so a network fault can hit the same requests on every run whatever order
the connections arrive in. The bundled tool env and ``OpenAIEngine`` (given
``headers=rollout_headers``) send it; a user's own HTTP client can send ``rollout_headers()`` too.

The value reads ``rollout=3; attempt=0; turn=1``; a part that is unknown (the reset of an episode
has no turn) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["ROLLOUT_HEADER", "RolloutIdentity", "format_rollout_header", "parse_rollout_header"]

ROLLOUT_HEADER: Final = "x-gym-resilience-rollout"

_PARTS: Final = ("rollout", "attempt", "turn")


@dataclass(frozen=True, slots=True)
class RolloutIdentity:
    """Which rollout (0-based index in the batch), attempt and turn a request serves; None if unknown."""

    rollout: int | None = None
    attempt: int | None = None
    turn: int | None = None


def format_rollout_header(identity: RolloutIdentity) -> str:
    """The header's value: ``rollout=3; attempt=0; turn=1``, unknown parts left out."""
    return "; ".join(f"{name}={value}" for name in _PARTS if (value := getattr(identity, name)) is not None)


def parse_rollout_header(value: str) -> RolloutIdentity:
    """The identity in a header value; parts that are missing or not whole numbers are unknown."""
    found: dict[str, int] = {}
    for part in value.split(";"):
        name, _, number = part.partition("=")
        name, number = name.strip(), number.strip()
        if name in _PARTS and number.isdigit():
            found[name] = int(number)
    return RolloutIdentity(**found)
