"""Check that an engine keeps the contract the runner relies on: ``await check_engine(engine)``.

Like Gymnasium's ``check_env``, for an engine of your own (or a served one) before a batch runs on it.
``check_engine`` runs every ``check_*`` function and raises one ``EngineContractError`` that lists every
problem found, not just the first. Each check tests one invariant with a few tokens and returns the
problems it found as strings, each reading ``"<part of the contract>: <what is wrong>"``, e.g.
``max_tokens: generate() returned 9 tokens for max_tokens=8``.

A generation check never hangs and never raises: past ``timeout_s`` its problem is ``"<part>: no answer
within <timeout_s> s"``, and a ``generate()`` that raised is ``"<part>: generate() raised <error>"``. It
runs in a task of its own, waited on with ``asyncio.wait`` rather than awaited under
``asyncio.timeout``: an engine that ignores cancellation would hold ``asyncio.timeout`` until it
answers. A generation that is not a ``Generation`` with a list of token ids is ``check_generation``'s
to report; the other checks pass over it, so one fault is reported once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

from gym_resilience.backends.deadlines import check_seconds
from gym_resilience.engines.base import Engine, Generation, Sampling
from gym_resilience.errors import EngineContractError, describe_exception
from gym_resilience.rollout.codec import chat_ids
from gym_resilience.validation.values import first_bad_number, first_bad_token, show

__all__ = [
    "GENERATION_CHECKS",
    "GenerationCheck",
    "check_cancellation",
    "check_concurrent_requests",
    "check_engine",
    "check_generation",
    "check_greedy_is_deterministic",
    "check_logprobs",
    "check_max_tokens",
    "check_seeded_sampling_is_reproducible",
    "check_stop_token_ids",
    "check_tokenizer",
    "default_prompt",
]

FINISH_REASONS: Final = ("stop", "length", "abort")
CHAT: Final = ({"role": "user", "content": "Say hello."},)
"""The small chat the tokenizer is tried on, and the default prompt."""
TOKENS: Final = 8
"""How many tokens a check asks for."""
CONCURRENT: Final = 8
"""How many requests ``check_concurrent_requests`` sends at once."""
SEED: Final = 1234
CANCEL_WITHIN_S: Final = 5.0
"""How long a cancelled ``generate()`` may take to end, at most (a quarter of ``timeout_s`` when less)."""
LONG_TOKENS: Final = 256
"""The request ``check_cancellation`` cancels asks for this many tokens, to be still running."""
RUN_BEFORE_CANCEL_S: Final = 0.05
"""How long that request runs before it is cancelled, so that it reached the engine."""
DEFAULT_TIMEOUT_S: Final = 30.0


class _Failed(Exception):
    """A ``generate()`` that raised, as the problem it is."""


class GenerationCheck(Protocol):
    """A check that generates: the problems it found on ``engine`` from ``prompt_ids``."""

    __name__: str

    async def __call__(
        self, engine: Engine, prompt_ids: Sequence[int], *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[str]: ...


_Body = Callable[[Any, list[int], float], Awaitable[list[str]]]


def _check(part: str) -> Callable[[_Body], GenerationCheck]:
    """A generation check from ``body``: bounded by ``timeout_s``, its problems prefixed with ``part``,
    a ``generate()`` that raised reported rather than raised."""

    def wrap(body: _Body) -> GenerationCheck:
        @functools.wraps(body)
        async def check(
            engine: Engine, prompt_ids: Sequence[int], *, timeout_s: float = DEFAULT_TIMEOUT_S
        ) -> list[str]:
            running = asyncio.ensure_future(body(engine, list(prompt_ids), timeout_s))
            try:
                done, _ = await asyncio.wait({running}, timeout=timeout_s)
            finally:
                if not running.done():  # past the deadline, or the caller was cancelled
                    running.cancel()
            if not done:
                # What it waits on is cancelled: give it the time a cancelled generate() has to end, then
                # leave it (an engine that ignores cancellation may hold it for good).
                await asyncio.wait({running}, timeout=_cancel_within(timeout_s))
                running.add_done_callback(_retrieve)
                return [f"{part}: no answer within {timeout_s:g} s"]
            try:
                return [f"{part}: {problem}" for problem in running.result()]
            except _Failed as failed:
                return [f"{part}: {failed}"]
            except Exception as error:  # a bug of the check on output it did not foresee: still a report
                return [f"{part}: the check failed on the engine's output: {describe_exception(error)}"]

        return check

    return wrap


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a left task's outcome as seen, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _cancel_within(timeout_s: float) -> float:
    return min(CANCEL_WITHIN_S, timeout_s / 4)


async def _ask(engine: Any, prompt_ids: list[int], sampling: Sampling) -> Any:
    """What ``engine.generate`` returned; raises ``_Failed`` saying what it raised."""
    try:
        return await engine.generate(list(prompt_ids), sampling)
    except Exception as error:
        raise _Failed(f"generate() raised {describe_exception(error)}") from error


def _usable(result: Any) -> Generation | None:
    """``result`` when it is a ``Generation`` with a list of token ids (else ``check_generation`` says
    what is wrong with it)."""
    if isinstance(result, Generation) and type(result.token_ids) is list:
        return result
    return None


def _said(value: Any) -> str:
    """A finish reason as a message shows it: ``'stop'``, or the repr and type of what is no str."""
    return repr(value) if type(value) is str else show(value)


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0


# --- The tokenizer. -----------------------------------------------------------------------------------

_TOKENIZER_NAMES: Final = ("eos_token_id", "pad_token_id", "apply_chat_template", "encode", "decode")


def check_tokenizer(engine: Engine) -> list[str]:
    """The tokenizer satisfies the ``Tokenizer`` protocol as the runner uses it: ``eos_token_id`` a token
    id (it ends turns), ``pad_token_id`` None or one, and on a one-message chat ``apply_chat_template``
    gives token ids, ``encode`` gives token ids and ``decode`` gives them back as a str."""
    try:
        tokenizer: Any = engine.tokenizer
    except Exception as error:
        return [f"tokenizer: engine.tokenizer raised {describe_exception(error)}"]
    missing = [name for name in _TOKENIZER_NAMES if not hasattr(tokenizer, name)]
    if missing:
        return [f"tokenizer: {type(tokenizer).__name__} has no {', '.join(missing)}"]
    problems = []
    if not _is_token_id(tokenizer.eos_token_id):
        problems.append(f"tokenizer: eos_token_id is {show(tokenizer.eos_token_id)}, expected a token id")
    if tokenizer.pad_token_id is not None and not _is_token_id(tokenizer.pad_token_id):
        problems.append(
            f"tokenizer: pad_token_id is {show(tokenizer.pad_token_id)}, expected None or a token id"
        )
    try:
        ids: Any = chat_ids(tokenizer, CHAT, add_generation_prompt=True)
    except Exception as error:
        problems.append(
            f"tokenizer: apply_chat_template on a one-message chat raised {describe_exception(error)}"
        )
    else:
        if not ids or first_bad_token(ids) is not None:
            problems.append(
                f"tokenizer: apply_chat_template on a one-message chat gave {show(ids)}, "
                "expected a non-empty list of token ids"
            )
    text = CHAT[0]["content"]
    try:
        encoded: Any = tokenizer.encode(text)
    except Exception as error:
        return [*problems, f"tokenizer: encode({text!r}) raised {describe_exception(error)}"]
    if type(encoded) is not list or not encoded or first_bad_token(encoded) is not None:
        return [*problems, f"tokenizer: encode({text!r}) gave {show(encoded)}, expected a list of token ids"]
    try:
        decoded: Any = tokenizer.decode(encoded, skip_special_tokens=True)
    except Exception as error:
        return [*problems, f"tokenizer: decode() of encode({text!r}) raised {describe_exception(error)}"]
    if type(decoded) is not str:
        problems.append(f"tokenizer: decode() of encode({text!r}) gave {show(decoded)}, expected a str")
    return problems


def default_prompt(engine: Engine) -> list[int] | None:
    """The prompt the generation checks send unless given one: the small chat through the tokenizer's
    template (as the runner makes a prompt), else its text encoded; None when neither gives token ids."""
    ids: Any = None
    try:
        tokenizer: Any = engine.tokenizer
    except Exception:
        return None
    for make in (
        lambda: chat_ids(tokenizer, CHAT, add_generation_prompt=True),
        lambda: tokenizer.encode(CHAT[0]["content"]),
    ):
        try:
            ids = make()
        except Exception:
            continue
        if type(ids) is list and ids and first_bad_token(ids) is None:
            return list(ids)
    return None


# --- Generation. --------------------------------------------------------------------------------------


@_check("generation")
async def check_generation(engine: Any, prompt_ids: list[int], timeout_s: float) -> list[str]:
    """A greedy generation is a ``Generation``: a list of token ids the tokenizer decodes, a finish reason
    of ``"stop"`` or ``"length"`` (``"abort"`` is for a request that was cancelled, or whose engine
    closed), and no logprobs, since none were asked for."""
    result = await _ask(engine, prompt_ids, Sampling(max_tokens=TOKENS))
    if not isinstance(result, Generation):
        return [f"generate() returned {type(result).__name__}, expected a Generation"]
    problems = []
    ids: Any = result.token_ids
    bad = None
    if type(ids) is not list:
        problems.append(f"token_ids is {show(ids)}, expected a list")
    else:
        bad = first_bad_token(ids)
        if bad is not None:
            problems.append(f"token id {show(ids[bad])} at position {bad}, expected a non-negative int")
    reason: Any = result.finish_reason
    if reason == "abort":
        problems.append("finish reason 'abort' for a request nobody cancelled")
    elif type(reason) is not str or reason not in FINISH_REASONS:
        problems.append(f"finish reason {_said(reason)}, expected 'stop', 'length' or 'abort'")
    if result.logprobs is not None:
        problems.append(f"logprobs is {show(result.logprobs)} though none were asked for, expected None")
    if type(ids) is list and bad is None:
        try:
            text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        except Exception as error:
            problems.append(f"the tokenizer cannot decode the generated ids: {describe_exception(error)}")
        else:
            if type(text) is not str:
                problems.append(f"the tokenizer decodes the generated ids as {show(text)}, expected a str")
    return problems


@_check("logprobs")
async def check_logprobs(engine: Any, prompt_ids: list[int], timeout_s: float) -> list[str]:
    """Asked for, logprobs come one per token, each a finite number <= 0 (a sampled generation, so that
    they are not all about 0)."""
    sampling = Sampling(max_tokens=TOKENS, temperature=1.0, seed=SEED, logprobs=True)
    generation = _usable(await _ask(engine, prompt_ids, sampling))
    if generation is None:
        return []
    values: Any = generation.logprobs
    count = len(generation.token_ids)
    if values is None:
        return [f"no logprobs for {count} tokens, though logprobs=True asked for one per token"]
    if type(values) is not list:
        return [f"logprobs is {show(values)}, expected a list with one per token"]
    if len(values) != count:
        return [f"{len(values)} logprobs for {count} tokens, expected one per token"]
    bad = first_bad_number(values, at_most_zero=True)
    if bad is not None:
        return [f"logprob {show(values[bad])} for token {bad}, expected a finite number <= 0"]
    return []


@_check("max_tokens")
async def check_max_tokens(engine: Any, prompt_ids: list[int], timeout_s: float) -> list[str]:
    """A generation never has more than ``max_tokens`` tokens, and one cut there finishes ``"length"``.

    It is cut when a longer greedy generation of the same prompt goes on past it; when the two differ
    (greedy decoding is not deterministic: ``check_greedy_is_deterministic`` reports that), only the
    count is checked.
    """
    free = _usable(await _ask(engine, prompt_ids, Sampling(max_tokens=TOKENS)))
    if free is None:
        return []
    if len(free.token_ids) > TOKENS:
        return [f"generate() returned {len(free.token_ids)} tokens for max_tokens={TOKENS}"]
    if len(free.token_ids) < 2:  # it stopped at once: no shorter generation to cut
        return []
    limit = min(TOKENS // 2, len(free.token_ids) - 1)
    cut = _usable(await _ask(engine, prompt_ids, Sampling(max_tokens=limit)))
    if cut is None:
        return []
    if len(cut.token_ids) > limit:
        return [f"generate() returned {len(cut.token_ids)} tokens for max_tokens={limit}"]
    if cut.token_ids == free.token_ids[:limit] and cut.finish_reason != "length":
        return [
            f"a generation cut at max_tokens={limit} finished {_said(cut.finish_reason)}, expected 'length'"
        ]
    return []


@_check("greedy")
async def check_greedy_is_deterministic(engine: Any, prompt_ids: list[int], timeout_s: float) -> list[str]:
    """Greedy decoding (temperature 0) gives the same tokens and finish reason on two calls."""
    sampling = Sampling(max_tokens=TOKENS)
    first = _usable(await _ask(engine, prompt_ids, sampling))
    second = _usable(await _ask(engine, prompt_ids, sampling))
    if first is None or second is None:
        return []
    if first.token_ids != second.token_ids:
        return [
            f"two greedy generations of the same prompt differ: {show(first.token_ids)} "
            f"then {show(second.token_ids)}"
        ]
    if first.finish_reason != second.finish_reason:
        return [
            "two greedy generations of the same prompt finished "
            f"{_said(first.finish_reason)} then {_said(second.finish_reason)}"
        ]
    return []


@_check("seeded sampling")
async def check_seeded_sampling_is_reproducible(
    engine: Any, prompt_ids: list[int], timeout_s: float
) -> list[str]:
    """A sampled request with a seed gives the same tokens on two calls (the runner seeds each rollout's
    requests, so that a batch can be replayed)."""
    sampling = Sampling(max_tokens=TOKENS, temperature=1.0, seed=SEED)
    first = _usable(await _ask(engine, prompt_ids, sampling))
    second = _usable(await _ask(engine, prompt_ids, sampling))
    if first is None or second is None or first.token_ids == second.token_ids:
        return []
    return [
        f"two generations at temperature 1.0 with seed={SEED} differ: {show(first.token_ids)} "
        f"then {show(second.token_ids)}"
    ]


@_check("concurrency")
async def check_concurrent_requests(engine: Any, prompt_ids: list[int], timeout_s: float) -> list[str]:
    """``CONCURRENT`` requests sent at once all complete (the runner sends a batch's requests together)."""
    requests = [
        _ask(engine, prompt_ids, Sampling(max_tokens=TOKENS // 2, temperature=1.0, seed=SEED + index))
        for index in range(CONCURRENT)
    ]
    outcomes = await asyncio.gather(*requests, return_exceptions=True)
    failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if not failed:
        return []
    first = failed[0]
    said = str(first) if isinstance(first, _Failed) else f"it raised {describe_exception(first)}"
    return [f"{len(failed)} of {CONCURRENT} requests sent at once failed; the first: {said}"]


@_check("cancellation")
async def check_cancellation(engine: Any, prompt_ids: list[int], timeout_s: float) -> list[str]:
    """Cancelling the task awaiting ``generate()`` ends it promptly (within a quarter of ``timeout_s``,
    at most ``CANCEL_WITHIN_S``) with ``CancelledError``, and the engine serves the next request.

    The runner cancels a generation past its deadline, or when a sibling rollout failed; an engine
    should abort the request then (this check sees only the task's side of it).
    """
    within_s = _cancel_within(timeout_s)
    problems = []
    long = asyncio.ensure_future(_ask(engine, prompt_ids, Sampling(max_tokens=LONG_TOKENS)))
    try:
        await asyncio.sleep(RUN_BEFORE_CANCEL_S)
        if long.done():  # it finished before it could be cancelled: nothing to see but a failure
            long.result()
        else:
            long.cancel()
            await asyncio.wait({long}, timeout=within_s)
            if not long.done():
                long.add_done_callback(_retrieve)
                problems.append(f"generate() went on for over {within_s:g} s after its task was cancelled")
            elif not long.cancelled():
                error = long.exception()
                if error is None:
                    problems.append(
                        "generate() returned a generation after its task was cancelled, "
                        "instead of raising CancelledError"
                    )
                else:
                    raised = describe_exception(error.__cause__ or error)
                    problems.append(f"generate() raised {raised} instead of CancelledError when cancelled")
    finally:
        if not long.done():
            long.cancel()
    try:
        await _ask(engine, prompt_ids, Sampling(max_tokens=TOKENS // 2))
    except _Failed as failed:
        problems.append(f"the request after a cancelled one failed: {failed}")
    return problems


@_check("stop_token_ids")
async def check_stop_token_ids(engine: Any, prompt_ids: list[int], timeout_s: float) -> list[str]:
    """A token id in ``stop_token_ids`` ends generation with finish ``"stop"``.

    The stop token is one a greedy generation of the same prompt picks (the first after its first token
    that it had not picked before); the stopped generation may keep it (vLLM does) or not. When the two
    generations differ before it, nothing can be said (``check_greedy_is_deterministic`` reports that).
    """
    free = _usable(await _ask(engine, prompt_ids, Sampling(max_tokens=TOKENS)))
    if free is None:
        return []
    eos = getattr(engine.tokenizer, "eos_token_id", None)
    picks = [
        index
        for index, token in enumerate(free.token_ids)
        if token != eos and token not in free.token_ids[:index]
    ]
    if not picks:
        return []
    at = next((index for index in picks if index >= 1), picks[0])
    stop = free.token_ids[at]
    result = await _ask(engine, prompt_ids, Sampling(max_tokens=TOKENS, stop_token_ids=(stop,)))
    stopped = _usable(result)
    if stopped is None:
        return []
    ids, reason = stopped.token_ids, stopped.finish_reason
    if stop in ids[:-1]:
        return [f"generation went on past stop token id {stop} (finish {_said(reason)})"]
    if ids in (free.token_ids[: at + 1], free.token_ids[:at]) and reason != "stop":
        return [f"stop token id {stop} ended generation with finish {_said(reason)}, expected 'stop'"]
    return []


GENERATION_CHECKS: Final[tuple[GenerationCheck, ...]] = (
    check_generation,
    check_logprobs,
    check_max_tokens,
    check_greedy_is_deterministic,
    check_seeded_sampling_is_reproducible,
    check_concurrent_requests,
    check_cancellation,
    check_stop_token_ids,
)
"""The checks that generate, in the order ``check_engine`` runs them (after ``check_tokenizer``)."""


async def check_engine(
    engine: Engine, *, prompt_ids: Sequence[int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Check that ``engine`` keeps the contract the runner relies on; raise one error listing every problem.

    Runs ``check_tokenizer``, then each of ``GENERATION_CHECKS`` one after another on ``prompt_ids``
    (by default a one-message chat through the tokenizer's template), each bounded by ``timeout_s``. The
    checks ask for a few tokens each (about 30 generations in all, one of them cancelled); a started
    engine is left running.

    Raises:
        EngineContractError: listing every problem found, each naming the part of the contract.
        UnsupportedConfigError: ``timeout_s`` is not a finite number of seconds > 0.
    """
    check_seconds("timeout_s", timeout_s, allow_none=False)
    name = type(engine).__name__
    problems = check_tokenizer(engine)
    if not callable(getattr(engine, "generate", None)):
        raise EngineContractError([*problems, f"generate: {name} has no generate method"], engine=name)
    prompt = list(prompt_ids) if prompt_ids is not None else default_prompt(engine)
    if prompt is None:
        problems.append("prompt: the tokenizer gives no prompt to generate from; pass prompt_ids")
    else:
        for check in GENERATION_CHECKS:
            problems += await check(engine, prompt, timeout_s=timeout_s)
    if problems:
        raise EngineContractError(problems, engine=name)
