"""One rollout: the multi-turn agent loop between an engine and a text env.

The env is created, reset, stepped and closed in a thread pool (gymnasium envs are synchronous), one
call at a time per env, and closed in ``finally`` on every exit path.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gym_resilience.config import RunnerConfig
from gym_resilience.engines.base import Engine, Generation, Sampling, Tokenizer
from gym_resilience.env import ResilientEnv
from gym_resilience.env_backends import EnvFactory, make_env
from gym_resilience.errors import Phase, RolloutError, RolloutTimeoutError, describe_exception, root_cause
from gym_resilience.isolation import StartAbort
from gym_resilience.metrics import log_close_failure
from gym_resilience.rollout_header import ROLLOUT_HEADER, RolloutIdentity, format_rollout_header
from gym_resilience.tasks import ChatMessage, Task
from gym_resilience.trajectories import AnyTrajectory, StepWiseTrajectory, Trajectory, TrajectoryId
from gym_resilience.worker_env import WorkerEnv

__all__ = [
    "ChatCodec",
    "EnvFactory",
    "LateCloses",
    "Progress",
    "current_rollout",
    "rollout_headers",
    "run_agent_loop",
]

T = TypeVar("T")

_BASE_CONVERSATION: list[ChatMessage] = [
    {"role": "system", "content": "base"},
    {"role": "user", "content": "base"},
]


def chat_ids(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool
) -> list[int]:
    """Token ids of a chat through the tokenizer's template, whatever container it returns."""
    ids = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(token) for token in ids]  # type: ignore[attr-defined]


class ChatCodec:
    """Turns chat messages into token ids and generated ids into text, for one tokenizer.

    Observations are encoded as a continuation of the conversation: the template applied to a fixed
    base conversation plus the new messages, minus the base's own ids (SkyRL's generator's method).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if eos is None or pad is None:
            raise ValueError("the tokenizer has no eos_token_id: cannot end turns or build placeholders")
        self.eos_token_id: int = eos
        self.pad_token_id: int = pad
        self._base_ids = chat_ids(tokenizer, _BASE_CONVERSATION, add_generation_prompt=False)

    def prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt=True)

    def observation(self, messages: Sequence[ChatMessage]) -> list[int]:
        ids = chat_ids(self.tokenizer, [*_BASE_CONVERSATION, *messages], add_generation_prompt=True)
        if ids[: len(self._base_ids)] != self._base_ids:
            raise ValueError("the chat template is not prefix-stable: cannot encode observations")
        return ids[len(self._base_ids) :]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def as_messages(observation: object) -> list[ChatMessage]:
    """An env's observation as chat messages: a string is one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, Mapping):
        return [dict(observation)]
    if isinstance(observation, Sequence) and all(isinstance(m, Mapping) for m in observation):
        return [dict(m) for m in observation]
    raise TypeError(
        f"a text env must return chat messages or a string, got {type(observation).__name__}: "
        f"{observation!r:.80}"
    )


def checked_step(result: object) -> tuple[object, float, bool, bool, Mapping[str, Any]]:
    """An env's ``step`` result, or a TypeError that says which part is wrong and what it was."""
    if not isinstance(result, tuple) or len(result) != 5:
        raise TypeError(
            f"env.step must return (observation, reward, terminated, truncated, info), got {result!r:.80}"
        )
    observation, reward, terminated, truncated, info = result
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(
            f"env.step returned a reward of type {type(reward).__name__} ({reward!r:.40}), expected a number"
        )
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool | numbers.Integral) and type(flag).__name__ != "bool_":  # numpy's bool
            raise TypeError(f"env.step returned {name}={flag!r:.40}, expected a bool")
    if not isinstance(info, Mapping):
        raise TypeError(f"env.step returned info of type {type(info).__name__}, expected a dict")
    return observation, float(reward), bool(terminated), bool(truncated), info


@dataclass
class Progress:
    """Where a rollout is, so a failure can say so: phase, turn, and time spent per side.

    ``attempt`` counts from 0; a retried rollout starts again with a fresh ``Progress``.
    """

    rollout_index: int
    attempt: int = 0
    phase: Phase = "reset"
    turn: int | None = None
    started: float = field(default_factory=time.perf_counter)
    llm_s: float = 0.0
    env_s: float = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


_CURRENT: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "gym_resilience_rollout", default=None
)


def current_rollout() -> Progress | None:
    """The rollout the calling code runs in (index, attempt, phase, turn), or None outside one.

    Set for the engine call and for every env call of a rollout (they run in its context), so an env,
    an engine wrapper or a log line can tell which rollout it serves.
    """
    return _CURRENT.get()


def rollout_headers() -> dict[str, str]:
    """The ``x-gym-resilience-rollout`` header for the rollout the caller runs in; empty outside one.

    Pass it to an HTTP client (``OpenAIEngine(..., headers=rollout_headers)``) so that a fault proxy can
    target network faults by rollout, attempt and turn.
    """
    progress = _CURRENT.get()
    if progress is None:
        return {}
    identity = RolloutIdentity(progress.rollout_index, progress.attempt, progress.turn)
    return {ROLLOUT_HEADER: format_rollout_header(identity)}


class EnvCalls:
    """Runs one env's synchronous calls in the pool, one at a time.

    The lock matters on cancellation: the awaiting task stops waiting but the thread finishes its call,
    and ``close`` must not run beside it. An isolated env is the exception: its close is made to run
    beside a stuck call (it kills the worker, which ends that call), so it does not queue behind it.
    """

    def __init__(self, executor: Executor, progress: Progress) -> None:
        self._executor = executor
        self._progress = progress
        self._lock = threading.Lock()

    def _locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return fn(*args, **kwargs)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Start the call in the pool, in the rollout's context; a plain future, so no task is made."""
        return self._start(functools.partial(self._locked, fn, *args, **kwargs))

    def close(self, env: ResilientEnv[Any, Any]) -> asyncio.Future[None]:
        """Start closing ``env``: after its call in flight, or, for an isolated env, beside it."""
        if isinstance(env.unwrapped, WorkerEnv):
            return self._start(env.close)
        return self.submit(env.close)

    def _start(self, call: Callable[[], T]) -> asyncio.Future[T]:
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, functools.partial(context.run, call))

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        try:
            return await self.submit(fn, *args, **kwargs)
        finally:
            self._progress.env_s += time.perf_counter() - start


@dataclass
class _Transcript:
    """What a rollout accumulates turn by turn."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (last token index, reward)
    steps: list[Trajectory] = field(default_factory=list)
    stop_reason: str = "stop"
    info: Mapping[str, Any] = field(default_factory=dict)

    def add_generated(self, generation: Generation) -> None:
        self.response_ids += generation.token_ids
        self.loss_mask += [1] * len(generation.token_ids)
        self.logprobs += generation.logprobs or [0.0] * len(generation.token_ids)

    def add_env_tokens(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)


def _reward(value: float, length: int, token_level: bool) -> float | list[float]:
    """A turn's reward: a float, or token-level with the reward on the last token."""
    if not token_level:
        return value
    rewards = [0.0] * length
    if length:
        rewards[-1] = value
    return rewards


def _numeric(info: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in info.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


async def run_agent_loop(
    *,
    engine: Engine,
    codec: ChatCodec,
    env_factory: EnvFactory,
    task: Task,
    trajectory_id: TrajectoryId,
    config: RunnerConfig,
    sampling: Sampling,
    executor: Executor,
    progress: Progress,
    reset_seed: int | None,
    late: LateCloses,
) -> AnyTrajectory:
    """Run one rollout to its end and return its trajectory; the env is closed on every path.

    Teardown waits ``late.timeout_s`` at most for a step that a thread runs (a build, a close); past it
    the step is left to that thread, which closes the env when it returns, and counted in ``late``.
    """
    _CURRENT.set(progress)
    call = EnvCalls(executor, progress)
    progress.phase = "reset"
    env = await _create_env(call, functools.partial(make_env, env_factory, task, config), late)
    try:
        messages, _ = await call(
            env.reset,
            seed=reset_seed,
            options={"task": task, "rollout_index": progress.rollout_index, "attempt": progress.attempt},
        )
        result = await _turns(engine, codec, env, call, trajectory_id, config, sampling, progress, messages)
    except BaseException as exc:
        await _close_after_failure(env, call, exc, late)
        raise
    progress.phase = "close"
    closing = call.close(env)
    # Cancelled here (a sibling failed), the close must still finish: the env would leak otherwise.
    if not await _wait_through_cancellation(closing, late):
        raise RolloutTimeoutError(
            rollout_index=progress.rollout_index,
            phase="close",
            turn=progress.turn,
            elapsed_s=progress.elapsed(),
            timeout_s=config.close_timeout_s,
            what="env close",
        )
    try:
        closing.result()
    except Exception as error:
        # The episode is complete, so its trajectory is good data whatever teardown did (SkyRL's
        # generator keeps it too): the failure is logged and counted in env_close_errors, not raised.
        result.close_error = describe_exception(root_cause(error))
        log_close_failure(progress.rollout_index, trajectory_id, error)
    return result


@dataclass
class LateCloses:
    """The teardown steps of a batch that it stopped waiting for after ``timeout_s``.

    An env still being built when its rollout gave up, or a close queued behind a call stuck in the
    env's thread: the thread closes the env once that call returns (a build that never returns leaves
    nothing to close). ``count`` says how many, in the batch's metrics and the error it raises.
    """

    timeout_s: float
    count: int = 0

    def left(self, step: asyncio.Future[Any]) -> None:
        self.count += 1
        # Nobody awaits it any more: its outcome must not be reported as never retrieved.
        step.add_done_callback(lambda done: done.cancelled() or done.exception())

    def note(self, error: BaseException) -> None:
        """Say on the batch's ``error`` how many envs were left to their threads, if any."""
        if self.count:
            envs = "1 env was" if self.count == 1 else f"{self.count} envs were"
            error.add_note(
                f"{envs} still being built or closed when the batch stopped waiting for them "
                f"(close_timeout_s={self.timeout_s:g}): the thread of each closes it when its call returns"
            )


class _Abandoned(Exception):
    """The rollout stopped waiting for its env: the env was closed on arrival, or never built."""


class _EnvBuild:
    """An env built in a pool thread for a rollout that may stop waiting for it meanwhile.

    Whichever side comes last closes the env: the rollout if it got the env, else the thread that
    built it, once it finds the rollout gone. A worker still starting an isolated env is killed at once.
    """

    def __init__(self, make: Callable[[StartAbort], ResilientEnv[Any, Any]]) -> None:
        self._make = make
        self._abort = StartAbort()
        self._lock = threading.Lock()
        self._abandoned = False

    def run(self) -> ResilientEnv[Any, Any]:
        """Build the env (in the pool thread) and hand it over, or close it if the rollout left."""
        if self._abandoned:
            raise _Abandoned
        env = self._make(self._abort)
        with self._lock:
            if not self._abandoned:
                return env
        env.close()
        raise _Abandoned

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
        self._abort.abort()


async def _create_env(
    call: EnvCalls, make: Callable[[StartAbort], ResilientEnv[Any, Any]], late: LateCloses
) -> ResilientEnv[Any, Any]:
    """Build the env in its thread; a rollout cancelled meanwhile leaves it to be closed on arrival."""
    build = _EnvBuild(make)
    creating = call.submit(build.run)
    try:
        return await asyncio.shield(creating)
    except asyncio.CancelledError as cancelled:
        build.abandon()
        if not await _wait_through_cancellation(creating, late):
            cancelled.add_note(
                f"its env was still being built when the rollout stopped waiting after {late.timeout_s:g} s: "
                "the thread building it closes it when the factory returns"
            )
        elif not creating.cancelled() and creating.exception() is None:
            # Handed over just before the rollout gave up on it.
            await _close_after_failure(creating.result(), call, cancelled, late)
        raise


async def _wait_through_cancellation(future: asyncio.Future[Any], late: LateCloses) -> bool:
    """Wait for a teardown step up to ``late.timeout_s``, even if cancelled again meanwhile.

    Teardown that a second cancellation could interrupt would leak the env it was closing; the
    cancellation is delivered once the step is done (or its time is up). True when it finished;
    a step still running is left to its thread and counted in ``late``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + late.timeout_s
    cancelled = False
    while not future.done() and loop.time() < deadline:
        try:
            await asyncio.wait({future}, timeout=deadline - loop.time())
        except asyncio.CancelledError:
            cancelled = True
    if not future.done():
        late.left(future)
    if cancelled:
        raise asyncio.CancelledError
    return future.done()


async def _close_after_failure(
    env: ResilientEnv[Any, Any], call: EnvCalls, error: BaseException, late: LateCloses
) -> None:
    """Close the env of a failed rollout without masking ``error`` and without waiting forever.

    The close waits for any env call still running in its thread (a cancelled step finishes there);
    past ``late.timeout_s`` it is left to run when that call returns, and ``error`` says so.
    """
    closing = call.close(env)
    if not await _wait_through_cancellation(closing, late):
        error.add_note(
            f"the env's close is still waiting after {late.timeout_s:g} s for a call stuck in its thread; "
            "it runs when that call returns (isolate_envs=True kills stuck envs instead)"
        )
        return
    try:
        closing.result()
    except Exception as close_error:
        error.add_note(f"closing the env also failed: {describe_exception(close_error)}")


async def _turns(
    engine: Engine,
    codec: ChatCodec,
    env: ResilientEnv[Any, Any],
    call: EnvCalls,
    trajectory_id: TrajectoryId,
    config: RunnerConfig,
    sampling: Sampling,
    progress: Progress,
    opening: object,
) -> AnyTrajectory:
    prompt_ids = codec.prompt(as_messages(opening))
    record = _Transcript(prompt_ids=prompt_ids)
    for turn in range(config.max_turns):
        input_ids = prompt_ids + record.response_ids
        if config.max_input_length is not None and len(input_ids) > config.max_input_length:
            if turn == 0 and not config.step_wise:
                raise RolloutError(
                    rollout_index=progress.rollout_index,
                    phase="generate",
                    turn=0,
                    elapsed_s=progress.elapsed(),
                    detail=f"the prompt has {len(input_ids)} tokens, over max_input_length "
                    f"{config.max_input_length}",
                )
            record.stop_reason = "length"
            break
        progress.phase, progress.turn = "generate", turn
        generation = await _generate(engine, input_ids, sampling, config.generation_timeout_s, progress)
        record.add_generated(generation)
        record.stop_reason = generation.finish_reason
        if generation.finish_reason == "abort":
            break
        progress.phase = "step"
        observation, reward, terminated, truncated, info = checked_step(
            await call(env.step, codec.decode(generation.token_ids))
        )
        record.info = info
        record.turn_rewards.append((len(record.response_ids) - 1, float(reward)))
        if config.step_wise:
            record.steps.append(
                Trajectory(
                    prompt_ids=list(input_ids),
                    response_ids=list(generation.token_ids),
                    reward=_reward(float(reward), len(generation.token_ids), config.token_level_rewards),
                    loss_mask=[1] * len(generation.token_ids),
                    stop_reason=generation.finish_reason,
                    rollout_logprobs=list(generation.logprobs or []) if config.logprobs else None,
                    env_metrics=_numeric(info),
                    trajectory_id=trajectory_id,
                )
            )
        if terminated or truncated or turn == config.max_turns - 1:
            break
        if not generation.token_ids or generation.token_ids[-1] != codec.eos_token_id:
            record.add_env_tokens([codec.eos_token_id])
        record.add_env_tokens(codec.observation(as_messages(observation)))
    return _finish(record, trajectory_id, config, progress)


async def _generate(
    engine: Engine, prompt_ids: list[int], sampling: Sampling, timeout_s: float | None, progress: Progress
) -> Generation:
    """One engine call under its deadline; past it the request is cancelled, which aborts it in the engine."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            return await engine.generate(prompt_ids, sampling)
    except TimeoutError:
        if not deadline.expired():
            raise
        raise RolloutTimeoutError(
            rollout_index=progress.rollout_index,
            phase="generate",
            turn=progress.turn,
            elapsed_s=progress.elapsed(),
            timeout_s=timeout_s or 0.0,
            what="generation",
        ) from None
    finally:
        progress.llm_s += time.perf_counter() - start


def _finish(
    record: _Transcript, trajectory_id: TrajectoryId, config: RunnerConfig, progress: Progress
) -> AnyTrajectory:
    e2e_time = progress.elapsed()
    splits = {"llm": progress.llm_s, "env": progress.env_s}
    if config.step_wise:
        for step in record.steps:
            step.e2e_time = e2e_time
            step.time_splits = splits
        return StepWiseTrajectory(steps=record.steps, e2e_time=e2e_time, trajectory_id=trajectory_id)
    reward: float | list[float] = sum(value for _, value in record.turn_rewards)
    if config.token_level_rewards:
        per_token = [0.0] * len(record.response_ids)
        for index, value in record.turn_rewards:
            per_token[index] += value
        reward = per_token
    return Trajectory(
        prompt_ids=record.prompt_ids,
        response_ids=record.response_ids,
        reward=reward,
        loss_mask=record.loss_mask,
        stop_reason=record.stop_reason,
        rollout_logprobs=record.logprobs if config.logprobs else None,
        env_metrics=_numeric(record.info),
        e2e_time=e2e_time,
        time_splits=splits,
        trajectory_id=trajectory_id,
    )
