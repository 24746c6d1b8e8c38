"""The completions protocol of vLLM's OpenAI-compatible server, as pure functions: the request body for
one generation, the ``Generation`` in a response (checked), what a failed response says and blames, and
which endpoint serves a request next. ``OpenAIEngine`` (``engines/openai.py``) does the I/O around them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

from gym_resilience.engines.base import Generation, Sampling
from gym_resilience.engines.common import (
    check_logprobs,
    check_token_ids,
    finish_reason,
    request_ids,
    request_numbers,
)
from gym_resilience.errors import EngineError
from gym_resilience.retry import is_transient_status

if TYPE_CHECKING:
    import httpx

__all__ = [
    "FailureKind",
    "choose_endpoint",
    "classify_status",
    "completion_request",
    "error_message",
    "parse_completion",
]

FailureKind = Literal["endpoint", "request"]
"""What a failed request blames: the endpoint (another may serve it) or the request itself."""


def completion_request(
    prompt_ids: Sequence[int], sampling: Sampling, *, model: str | None, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for one generation; ``extra`` adds or overrides fields.

    ``return_token_ids`` makes vLLM return the sampled ids (and the prompt's, checked against ours);
    ``logprobs: 0`` asks for the sampled token's own logprob only, and ``return_tokens_as_token_ids``
    spares the server detokenizing each of them.
    """
    max_tokens, seed = request_numbers(sampling)
    body: dict[str, Any] = {
        "prompt": request_ids(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "n": 1,
        "stream": False,
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    if seed is not None:
        body["seed"] = seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = request_ids(sampling.stop_token_ids)
    if sampling.logprobs:
        body["logprobs"] = 0
        body["return_tokens_as_token_ids"] = True
    body.update(extra)
    return body


def parse_completion(payload: object, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
    """The ``Generation`` in a ``/v1/completions`` response body; a malformed one raises ``EngineError``
    that says what is wrong with it (JSON's integers and numbers are checked as such, not converted).

    What vLLM never sends is malformed too, as the output validator would reject it: a token id below 0,
    a logprob that is NaN, infinite or above 0. Ids past the model's vocabulary are not checked: the
    tokenizer's length is no bound (models pad their embeddings past it) and the model's is not known.
    """
    choice = _first_choice(payload)
    token_ids = choice.get("token_ids")
    if not _is_ids(token_ids):
        raise EngineError(
            f"the server's completion has no token ids (token_ids={token_ids!r:.60}); "
            "OpenAIEngine needs a vLLM server that supports return_token_ids"
        )
    if len(token_ids) > sampling.max_tokens:
        raise EngineError(f"the server returned {len(token_ids)} tokens for max_tokens={sampling.max_tokens}")
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and (not _is_ids(echoed) or echoed != list(prompt_ids)):
        raise EngineError("the server changed the prompt's token ids (did it add special tokens?)")
    check_token_ids(token_ids, "the server's completion")
    logprobs: list[float] | None = None
    if sampling.logprobs:
        section = choice.get("logprobs")
        raw = section.get("token_logprobs") if isinstance(section, dict) else None
        if not isinstance(raw, list) or len(raw) != len(token_ids):
            raise EngineError("the server returned no logprob for some sampled tokens")
        logprobs = check_logprobs(raw, "the server's completion")
    return Generation(
        token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason(choice.get("finish_reason"))
    )


def _first_choice(payload: object) -> dict[str, Any]:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(f"the server's answer is not a completion (no choices): {payload!r:.80}")
    return choices[0]


def _is_ids(value: object) -> TypeGuard[list[int]]:
    # JSON's integers: a bool is not one; whether each is >= 0 is check_token_ids's to say.
    return isinstance(value, list) and set(map(type, value)) <= {int}


def classify_status(status: int) -> FailureKind | None:
    """None for success; ``"request"`` for a 4xx that blames the request; ``"endpoint"`` otherwise.

    ``is_transient_status`` decides which statuses blame the endpoint's state (5xx, 408, 429): another
    endpoint may serve the request. Any other non-2xx (a 3xx too) fails the endpoint.
    """
    if 200 <= status < 300:
        return None
    if 400 <= status < 500 and not is_transient_status(status):
        return "request"
    return "endpoint"


def choose_endpoint(
    healthy: Sequence[bool], in_flight: Sequence[int], tried: set[int], turn: int
) -> int | None:
    """The healthy, untried endpoint with the fewest requests in flight; ties go to the first at or
    after ``turn`` (round robin). None when there is none.
    """
    count = len(healthy)
    candidates = [(turn + offset) % count for offset in range(count)]
    eligible = [index for index in candidates if healthy[index] and index not in tried]
    if not eligible:
        return None
    return min(eligible, key=lambda index: in_flight[index])


def error_message(response: httpx.Response) -> str:
    """What a failed response says went wrong: the JSON error's message, else the start of its body."""
    try:
        detail = response.json()["error"]["message"]
    except Exception:
        detail = response.text[:500]
    return str(detail)
