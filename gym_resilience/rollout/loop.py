"""One rollout: the multi-turn agent loop between an engine and a text env, and its trajectory.

The env is created, reset, stepped and closed in a thread pool (gymnasium envs are synchronous), one
call at a time per env (built and reset in one call), and closed on every exit path.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gym_resilience.backends.choice import BackendEnv
from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.engines.base import Generation
from gym_resilience.errors import (
    EnvTimeoutError,
    RolloutError,
    RolloutTimeoutError,
    describe_exception,
    root_cause,
)
from gym_resilience.metrics import log_close_failure
from gym_resilience.rollout.checks import check_generation, checked_step, numeric_info
from gym_resilience.rollout.codec import ChatCodec, as_messages
from gym_resilience.rollout.context import RolloutContext
from gym_resilience.rollout.env_calls import EnvCalls, close_after_failure, open_env
from gym_resilience.rollout.progress import enter_rollout
from gym_resilience.tasks import ChatMessage
from gym_resilience.trajectories import AnyTrajectory, StepWiseTrajectory, Trajectory

__all__ = ["run_agent_loop"]

T = TypeVar("T")


@dataclass(slots=True)
class _Transcript:
    """What a rollout accumulates turn by turn (logprobs only when the batch returns them)."""

    prompt_ids: list[int]
    logprobs: list[float] | None  # None: the batch returns no logprobs
    steps: list[Trajectory] | None  # None: the batch is not step-wise
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (last token index, reward)
    stop_reason: str = "stop"
    info: Mapping[str, Any] = field(default_factory=dict)
    last_generated: int = 0  # the response's length up to its last generated token

    def add_generated(self, generation: Generation) -> None:
        self.response_ids += generation.token_ids
        self.loss_mask += _generated_mask(generation)
        self.last_generated = len(self.response_ids)
        if self.logprobs is not None:
            self.logprobs += generation.logprobs or [0.0] * len(generation.token_ids)

    def drop_trailing_env_tokens(self) -> None:
        """Cut the tokens after the last generated one (SkyRL drops an observation nothing answered)."""
        del self.response_ids[self.last_generated :], self.loss_mask[self.last_generated :]
        if self.logprobs is not None:
            del self.logprobs[self.last_generated :]

    def add_env_tokens(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(token_ids)


def _generated_mask(generation: Generation) -> list[int]:
    """1 for each generated token; 0 for an end-of-turn token the engine's wrapper appended."""
    mask = [1] * len(generation.token_ids)
    if generation.appended_eos and mask:
        mask[-1] = 0
    return mask


def _reward(value: float, length: int, token_level: bool, at: int | None = None) -> float | list[float]:
    """A turn's reward: a float, or token-level with the reward on token ``at`` (default: the last)."""
    if not token_level:
        return value
    rewards = [0.0] * length
    if length:
        rewards[length - 1 if at is None else at] = value
    return rewards


async def run_agent_loop(rollout: RolloutContext) -> AnyTrajectory:
    """Run one rollout to its end and return its trajectory; the env is closed on every path.

    ``rollout_timeout_s`` bounds the episode (build, reset, turns); teardown is bounded by
    ``close_timeout_s`` alone, so the error a failed rollout raises is what failed, never a deadline that
    passed while its env closed. A finished episode is kept whatever its close does: a close that fails,
    or is still running after ``close_timeout_s`` (left to its thread, counted in ``rollout.late``), is
    recorded in the trajectory's ``close_error``.
    """
    progress, late = rollout.progress, rollout.late
    enter_rollout(progress)
    call = EnvCalls(rollout.pool, progress, rollout.open_envs)
    progress.phase = "reset"
    episode = _episode(rollout, call)
    try:
        # No deadline to keep: no timeout scope, nor the coroutine around it.
        deadline = rollout.config.rollout_timeout_s is not None
        result = await (_within_rollout_deadline(rollout, episode) if deadline else episode)
    except GeneratorExit:  # collected unfinished (asyncio lost its wake-up): the batch closed its env
        raise
    except BaseException as exc:
        if call.env is not None:
            await close_after_failure(call.env, call, exc, late)
        raise
    env = call.env
    assert env is not None  # the episode returned, so it opened its env
    progress.phase = "close"
    closing = call.close(env)
    # Cancelled here (a sibling failed), the close must still finish: the env would leak otherwise. (Done
    # already, the common case after a last step that queued it, it needs no wait.)
    if not closing.done() and not await late.wait_close(env, closing):
        error: BaseException = EnvTimeoutError(operation="close", timeout_s=rollout.config.close_timeout_s)
    else:
        try:
            closing.result()
            return result
        except Exception as close_error:
            error = close_error
    # The episode is complete, so its trajectory is good data whatever teardown did (SkyRL's generator
    # keeps it too): the failure is logged and counted in env_close_errors, not raised.
    result.close_error = describe_exception(root_cause(error))
    log_close_failure(rollout.index, rollout.trajectory_id, error)
    return result


async def _episode(rollout: RolloutContext, call: EnvCalls) -> AnyTrajectory:
    """The rollout from its env's build to its last turn; the env, once built, is ``call.env``."""
    opening = await _open(rollout, call)
    prompt_ids = await rollout.start_line.first_prompt(rollout.index, opening)
    assert call.env is not None  # opened
    return await _turns(rollout, call.env, call, prompt_ids, opening)


async def _open(rollout: RolloutContext, call: EnvCalls) -> list[ChatMessage]:
    """Build and reset the rollout's env (``call.env``): its first observation as chat messages. What
    the reset returned is dropped with this frame, rather than kept through the rollout's turns."""
    progress = rollout.progress
    reset = _Reset(rollout)
    env, opened = await open_env(call, rollout.make_env, reset, rollout.late)
    call.env = env
    progress.node_id = env.node_id
    if opened is None:
        messages, _ = await call(reset, env.env, kind="open")
    else:
        progress.env_s += opened.seconds
        messages, _ = opened.result()
    try:
        return as_messages(messages)
    except BaseException:
        rollout.start_line.leave(rollout.index)  # failed before the line: the others go on now
        raise


class _Reset:
    """Resets a rollout's env with its seed and options (the task, the rollout's index, the attempt)."""

    __slots__ = ("_options", "_seed")

    def __init__(self, rollout: RolloutContext) -> None:
        self._seed = rollout.seed
        self._options = {
            "task": rollout.task,
            "rollout_index": rollout.index,
            "attempt": rollout.progress.attempt,
        }

    def __call__(self, env: ResilientEnv[Any, Any]) -> tuple[Any, dict[str, Any]]:
        return env.reset(seed=self._seed, options=self._options)


async def _within_rollout_deadline(rollout: RolloutContext, episode: Coroutine[Any, Any, T]) -> T:
    """Await ``episode`` under ``rollout_timeout_s``; past it, raise ``RolloutTimeoutError``."""
    timeout_s = rollout.config.rollout_timeout_s
    if timeout_s is None:  # no deadline to keep: spare the cost of a timeout scope
        return await episode
    deadline: asyncio.Timeout | None = None
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            return await episode
    except TimeoutError as timeout:
        if deadline is None or not deadline.expired():
            raise
        progress = rollout.progress
        error = RolloutTimeoutError(
            rollout_index=rollout.index,
            phase=progress.phase,
            turn=progress.turn,
            elapsed_s=progress.elapsed(),
            timeout_s=timeout_s,
        )
        # What the episode's own teardown noted on the cancellation (an env left to its building thread).
        for note in getattr(timeout.__context__, "__notes__", ()):
            error.add_note(note)
        raise error from None


async def _turns(
    rollout: RolloutContext,
    env: BackendEnv,
    call: EnvCalls,
    prompt_ids: list[int],
    opening: list[ChatMessage],
) -> AnyTrajectory:
    codec, config, progress = rollout.codec, rollout.config, rollout.progress
    skyrl = config.token_layout == "skyrl"
    # SkyRL's step-wise layout: every step's prompt is the template applied to the decoded history.
    history: list[ChatMessage] | None = copy.deepcopy(opening) if skyrl and config.step_wise else None
    step_prompt = prompt_ids
    record = _Transcript(
        prompt_ids=prompt_ids,
        logprobs=[] if config.logprobs else None,
        steps=[] if config.step_wise else None,
    )
    line, between = rollout.turn_line, False  # between: on the line since the last generation
    try:
        for turn in range(config.max_turns):
            input_ids = prompt_ids + record.response_ids
            progress.phase, progress.turn = "generate", turn
            # SkyRL's step-wise loop checks the length of the previous step's prompt.
            checked = step_prompt if history is not None else input_ids
            if config.max_input_length is not None and len(checked) > config.max_input_length:
                if turn == 0 and not config.step_wise:  # step-wise, a rollout with no steps is SkyRL's too
                    length = f"the prompt has {len(input_ids)} tokens, over max_input_length"
                    raise _no_response(rollout, f"{length} {config.max_input_length}")
                record.stop_reason = "length"
                if skyrl:
                    record.drop_trailing_env_tokens()
                break
            if history is not None and turn:
                step_prompt = input_ids = await codec.encode_prompt(history)
            if between:
                between = False
                await line.next_turn()
            generation = await _generate(rollout, input_ids)
            check_generation(rollout.engine, generation, logprobs=config.logprobs)
            # No tokens would make a trajectory with no response at the first turn, or, step-wise, a step
            # with none (an abort records no step: it ends the rollout with the steps before it).
            aborted = generation.finish_reason == "abort"
            if not generation.token_ids and (not aborted if config.step_wise else turn == 0):
                raise _no_response(
                    rollout, f"the engine returned no tokens (finish reason {generation.finish_reason!r})"
                )
            record.add_generated(generation)
            record.stop_reason = generation.finish_reason
            if aborted:
                break
            last_turn = turn == config.max_turns - 1  # the env is closed next, whatever its step does
            if not last_turn:
                line.generated()
                between = True
            progress.phase = "step"
            action = generation.text if generation.text is not None else codec.decode(generation.token_ids)
            observation, reward, terminated, truncated, info = checked_step(
                await (
                    call.timed(call.last_step(env, action))
                    if last_turn
                    else call(env.env.step, action, kind="step")
                )
            )
            record.info = info
            record.turn_rewards.append((len(record.response_ids) - 1, float(reward)))
            done = terminated or truncated
            if history is not None:
                assert record.steps is not None  # step-wise
                observed = as_messages(observation)
                obs_ids = await codec.skyrl_observation(observed, done=done)
                history += [_assistant(action, codec), *observed]
                record.steps.append(_skyrl_step(rollout, input_ids, generation, obs_ids, float(reward), info))
            elif record.steps is not None:  # step-wise
                record.steps.append(
                    Trajectory(
                        prompt_ids=list(input_ids),
                        response_ids=list(generation.token_ids),
                        reward=_reward(float(reward), len(generation.token_ids), config.token_level_rewards),
                        loss_mask=_generated_mask(generation),
                        stop_reason=generation.finish_reason,
                        rollout_logprobs=list(generation.logprobs or []) if config.logprobs else None,
                        env_metrics=numeric_info(info),
                        trajectory_id=rollout.trajectory_id,
                    )
                )
            if done or last_turn:
                break
            if history is not None:
                continue
            if skyrl:  # SkyRL's generator goes straight on with the observation, after any turn
                record.add_env_tokens(await codec.skyrl_observation(as_messages(observation), done=False))
                continue
            if not generation.token_ids or generation.token_ids[-1] != codec.eos_token_id:
                record.add_env_tokens([codec.eos_token_id])
            record.add_env_tokens(await codec.encode_observation(as_messages(observation)))
    finally:
        if between:
            line.left()
    return _finish(record, rollout)


def _assistant(action: str, codec: ChatCodec) -> ChatMessage:
    """The assistant's message for the history, its end-of-turn text removed (the template adds it)."""
    eos = getattr(codec.tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos and action.endswith(eos):
        action = action[: -len(eos)]
    return {"role": "assistant", "content": action}


def _skyrl_step(
    rollout: RolloutContext,
    prompt_ids: list[int],
    generation: Generation,
    obs_ids: list[int],
    reward: float,
    info: Mapping[str, Any],
) -> Trajectory:
    """One step as SkyRL's generator makes it: the generated ids and the observation's, its reward on
    the last generated token."""
    config, generated = rollout.config, len(generation.token_ids)
    length = generated + len(obs_ids)
    return Trajectory(
        prompt_ids=list(prompt_ids),
        response_ids=[*generation.token_ids, *obs_ids],
        reward=_reward(reward, length, config.token_level_rewards, at=generated - 1),
        loss_mask=[*_generated_mask(generation), *[0] * len(obs_ids)],
        stop_reason=generation.finish_reason,
        rollout_logprobs=[*(generation.logprobs or []), *[0.0] * len(obs_ids)] if config.logprobs else None,
        env_metrics=numeric_info(info),
        trajectory_id=rollout.trajectory_id,
    )


def _no_response(rollout: RolloutContext, why: str) -> RolloutError:
    """The error for a rollout that would leave a trajectory (or, step-wise, a step) with no response
    tokens, which no trainer can use and the output validator rejects."""
    return RolloutError(
        rollout_index=rollout.index,
        phase="generate",
        turn=rollout.progress.turn,
        elapsed_s=rollout.progress.elapsed(),
        detail=f"{why}: the trajectory would have no response",
    )


async def _generate(rollout: RolloutContext, prompt_ids: list[int]) -> Generation:
    """One engine call under its deadline; past it the request is cancelled, which aborts it in the engine."""
    progress, timeout_s = rollout.progress, rollout.config.generation_timeout_s
    start = time.perf_counter()
    deadline: asyncio.Timeout | None = None
    try:
        with rollout.turn_line.request():
            if timeout_s is None:  # no deadline to keep: spare the per-turn cost of a timeout scope
                return await rollout.engine.generate(prompt_ids, rollout.sampling)
            async with asyncio.timeout(timeout_s) as deadline:
                return await rollout.engine.generate(prompt_ids, rollout.sampling)
    except TimeoutError:
        if deadline is None or not deadline.expired():
            raise
        raise RolloutTimeoutError(
            rollout_index=rollout.index,
            phase="generate",
            turn=progress.turn,
            elapsed_s=progress.elapsed(),
            timeout_s=timeout_s or 0.0,
            what="generation",
        ) from None
    finally:
        progress.llm_s += time.perf_counter() - start


def _finish(record: _Transcript, rollout: RolloutContext) -> AnyTrajectory:
    config, progress, trajectory_id = rollout.config, rollout.progress, rollout.trajectory_id
    e2e_time = progress.elapsed()
    splits = {"llm": progress.llm_s, "env": progress.env_s}
    if record.steps is not None:  # step-wise
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
        rollout_logprobs=record.logprobs,
        env_metrics=numeric_info(record.info),
        e2e_time=e2e_time,
        time_splits=splits,
        trajectory_id=trajectory_id,
    )
