"""``BatchRunner``: a batch of concurrent multi-turn rollouts that survives its failures.

Without ``skip_failed_rollouts`` the first failure aborts the step, as in SkyRL's generator, but only
after the sibling rollouts are cancelled and every env is closed. With it, each rollout's ``Exception``
becomes a ``FailedRollout`` marker, replaced by a placeholder once every rollout has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tenacity

from gym_resilience.backends.choice import EnvFactory, env_workers
from gym_resilience.backends.pool import WorkerPool
from gym_resilience.config import RunnerConfig
from gym_resilience.engines.base import Engine
from gym_resilience.errors import (
    AllRolloutsFailedError,
    FailureBudgetExceededError,
    Phase,
    UnsupportedConfigError,
    describe_exception,
)
from gym_resilience.metrics import (
    batch_metrics,
    generate_metrics,
    log_batch_summary,
    log_failed_rollout,
    log_retry,
    reward_metrics,
)
from gym_resilience.placeholders import FailedRollout, substitute_placeholders
from gym_resilience.retry import RetryPolicy
from gym_resilience.rollout import (
    ChatCodec,
    EnvPool,
    LateCloses,
    OpenEnvs,
    Progress,
    RolloutContext,
    StartLine,
    TurnLine,
    run_agent_loop,
)
from gym_resilience.rollout.env_calls import KILL_GRACE_S
from gym_resilience.rollout.pool import EAGER_THREADS, CallHistory
from gym_resilience.rollout.worker_slots import WorkerSlots
from gym_resilience.tasks import Task
from gym_resilience.trajectories import (
    AnyTrajectory,
    BatchOutput,
    StepWiseTrajectory,
    TrajectoryId,
    build_batch_output,
)

__all__ = ["AttemptRecord", "BatchResult", "BatchRunner", "mask_failed_groups"]

Outcome = AnyTrajectory | FailedRollout


@dataclass(slots=True)
class BatchResult:
    """A finished batch: one trajectory per task x sample in task order, its columns, its metrics.

    ``failures`` lists the rollouts that placeholders stand in for (empty without the flag); ``attempts``
    every attempt of every rollout, retried ones and failed ones included, in rollout and attempt order.
    ``trajectories`` and ``output`` agree row for row: post-processing (``zero_reward_on_non_stop``,
    ``apply_overlong_filtering``) edits both, and they share no lists.
    """

    trajectories: list[AnyTrajectory]
    output: BatchOutput
    metrics: dict[str, float]
    failures: list[FailedRollout]
    attempts: list[AttemptRecord] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt at one rollout, as the runner saw it: where its env ran and how the attempt ended.

    ``node_id`` is the Ray node of the env's actor (``env_backend="ray"``), None elsewhere or when the env
    was lost before its node was known; ``error`` is ``"Type: message"`` of what the attempt raised, None
    if it returned a trajectory; ``phase`` is where it ended.
    """

    rollout_index: int
    attempt: int
    node_id: str | None
    phase: Phase
    elapsed_s: float
    error: str | None


@dataclass(frozen=True, slots=True)
class _Fatal:
    """A BaseException (KeyboardInterrupt, SystemExit) carried out of its task.

    Raised inside a task it would escape into the event loop itself; carried out, it is re-raised
    from ``generate`` once every sibling has been cancelled and every env closed.
    """

    exception: BaseException


@dataclass(frozen=True, slots=True)
class _Job:
    index: int
    task: Task
    trajectory_id: TrajectoryId


class BatchRunner:
    """Runs batches of rollouts of ``engine`` against envs from ``env_factory``.

    With ``env_backend`` ``"process"`` or ``"ray"`` the runner keeps warm env workers across its batches
    (``RunnerConfig.env_workers``): close it (``await runner.close()``, or ``async with``) to end them.

    Example:
        >>> runner = BatchRunner(engine, env_factory, RunnerConfig(skip_failed_rollouts=True))
        >>> result = await runner.generate(tasks)  # doctest: +SKIP
        >>> validate_batch_output(result.output, num_prompts=len(tasks))  # doctest: +SKIP
    """

    def __init__(self, engine: Engine, env_factory: EnvFactory, config: RunnerConfig | None = None) -> None:
        self.engine = engine
        self.env_factory = env_factory
        self.config = config if config is not None else RunnerConfig()
        self._codec: ChatCodec | None = None
        # Whether the next batch's start line encodes the task prompts ahead: while most envs open
        # with their task's prompt (each batch's line tells).
        self._encode_ahead = True
        self._env_calls = CallHistory()  # whether this runner's env calls block, across its batches
        if self.config.env_backend == "ray":
            # A configuration is data (a scenario file validates without ray); a runner is about to use it.
            from gym_resilience.backends.ray import check_ray_installed

            check_ray_installed()
        # The env workers, shared by this runner's batches: made at the first batch, ended by close()
        # or, for a runner dropped without it, when it is collected.
        self._workers: WorkerPool[Any] | None = None
        # Each rollout in flight holds one of the pool's workers: a slot of this bound, shared by the
        # runner's concurrent batches, is taken before its env is built.
        pool_size = self.config.env_pool_size
        self._worker_slots = (
            WorkerSlots(pool_size) if self.config.env_backend != "thread" and pool_size is not None else None
        )
        self._closed = False

    async def __aenter__(self) -> BatchRunner:
        return self

    async def __aexit__(self, *exc_info: object) -> bool:
        await self.close()
        return False

    async def close(self) -> None:
        """Ends the runner's env workers (processes, Ray actors): idle ones now, any still serving a
        batch's env once that env closes. Later batches are refused. Rollouts of a batch still running
        that have not started yet fail with ``EnvClosedError`` saying that the env workers were closed
        with their runner (placeholders with ``skip_failed_rollouts``); those in flight finish.
        Idempotent; without envs on workers there is nothing to end."""
        self._closed = True
        workers = self._workers
        if workers is not None:
            await _on_a_thread_of_its_own(workers.close)

    @property
    def env_workers(self) -> WorkerPool[Any] | None:
        """The pool of env workers (None before the first batch, and for envs on threads)."""
        return self._workers

    async def _env_workers(self, in_flight: int) -> WorkerPool[Any] | None:
        if self._workers is None:
            self._workers = workers = env_workers(self.config)
            if workers is not None:
                weakref.finalize(self, workers.close)
                if self.config.env_workers_prestart:
                    await _on_a_thread_of_its_own(functools.partial(workers.prestart, in_flight))
        return self._workers

    def _env_pool(self, in_flight: int) -> EnvPool:
        """A batch's env pool: ``env_threads`` threads, or by default (None) up to one per rollout in
        flight, past the first ``EAGER_THREADS`` only while the env calls block (``rollout/pool.py``)."""
        threads = self.config.env_threads
        if threads is not None:
            return EnvPool(threads, name="gym-resilience-env")
        return EnvPool(in_flight, name="gym-resilience-env", eager=EAGER_THREADS, history=self._env_calls)

    def _jobs(self, tasks: Iterable[Task]) -> list[_Job]:
        if isinstance(tasks, Task | str | bytes | Mapping) or not isinstance(tasks, Iterable):
            raise TypeError(
                f"generate() takes an iterable of gym_resilience.Task, not a {type(tasks).__name__}"
            )
        tasks = list(tasks)  # read once: an iterator or a generator has nothing left for a second pass
        if not tasks:
            raise UnsupportedConfigError("generate() needs at least one task", option="tasks")
        for index, task in enumerate(tasks):
            if not isinstance(task, Task):
                raise TypeError(f"tasks[{index}] is a {type(task).__name__}, not a gym_resilience.Task")
        counts = Counter(task.instance_id for task in tasks)
        duplicates = sorted(instance_id for instance_id, count in counts.items() if count > 1)
        if duplicates:
            raise UnsupportedConfigError(
                f"instance ids must be unique, repeated: {duplicates}", option="tasks"
            )
        repetitions = range(self.config.n_samples_per_prompt)
        pairs = [(task, repetition) for task in tasks for repetition in repetitions]
        return [_Job(i, task, TrajectoryId(task.instance_id, rep)) for i, (task, rep) in enumerate(pairs)]

    async def generate(self, tasks: Iterable[Task]) -> BatchResult:
        """Run every task ``n_samples_per_prompt`` times and return the batch.

        ``tasks`` is any iterable of ``Task`` (a list, a tuple, a generator), read once, before any env
        is built; an empty one is refused.

        Raises:
            AllRolloutsFailedError: every rollout failed (``__cause__`` is the first failure).
            Exception: without ``skip_failed_rollouts``, the first rollout's failure, unchanged.
            KeyboardInterrupt, asyncio.CancelledError: propagate after every env is closed, or, past
                ``close_timeout_s``, left to the thread still building or closing it, which closes it
                when its call returns (a note on the error gives the count; docs/deadlines.md).
        """
        if self._closed:
            raise RuntimeError("this BatchRunner is closed: its env workers are gone")
        jobs = self._jobs(tasks)
        limit = self.config.max_concurrency or len(jobs)
        pool_size = self.config.env_pool_size
        if self.config.env_backend != "thread" and pool_size is not None:
            limit = min(limit, pool_size)  # every rollout in flight holds a worker
        workers = await self._env_workers(limit)
        if self._codec is None:
            self._codec = ChatCodec(self.engine.tokenizer)
        codec = self._codec
        start = time.perf_counter()
        pool = self._env_pool(limit)
        # On the line: the rollouts _Supervisor starts at once, the first ``limit`` jobs.
        start_line = StartLine(
            {job.index: job.task.prompt for job in jobs[:limit]}, self.config.start_wait_s, codec
        )
        batch = _Batch(self, codec, pool, start_line, workers)
        unwatch = batch.open_envs.watch(asyncio.get_running_loop())
        slots = self._worker_slots
        try:
            batch.worker_slots = None if slots is None else slots.enter()
            started = start_line.encode_ahead if self._encode_ahead else None
            teardown_s = 2 * (self.config.close_timeout_s + KILL_GRACE_S) + 1.0
            outcomes = await _Supervisor(jobs, batch.rollout, limit, teardown_s).run(started)
            failures = [o for o in outcomes if isinstance(o, FailedRollout)]
            check_failures(failures, total=len(outcomes), max_failed_fraction=self.config.max_failed_fraction)
        except BaseException as exc:
            batch.late.note(exc)
            # Every rollout ended; what is still open is an env whose rollout code could not run (a
            # KeyboardInterrupt inside the event loop's machinery) or is left to its thread.
            batch.open_envs.close_all()
            raise
        finally:
            if slots is not None and batch.worker_slots is not None:
                slots.leave()
            unwatch()
            # A thread stuck in a hung env must not block the event loop: do not wait for it. Queued
            # closes still run, so a stuck env is closed once its call returns.
            pool.shutdown()
            self._encode_ahead = start_line.worth_encoding_ahead(self._encode_ahead)
        metrics = batch_metrics(outcomes, elapsed_s=time.perf_counter() - start, attempts=batch.attempts)
        metrics["envs_closed_late"] = float(batch.late.count)
        trajectories = substitute_placeholders(
            outcomes,
            pad_token_id=codec.pad_token_id,
            token_level_rewards=self.config.token_level_rewards,
            logprobs=self.config.logprobs,
            step_wise=self.config.step_wise,
        )
        output = build_batch_output(trajectories)
        # As in SkyRL: its generator's generate/* metrics before post-processing, its trainer's after.
        metrics.update(generate_metrics(output))
        post_process(trajectories, output, self.config)
        if self.config.failed_group_policy == "mask_group":
            groups = [tid.instance_id if tid is not None else None for tid in output.trajectory_ids]
            metrics["rollout_groups_masked"] = float(mask_failed_groups(trajectories, output, groups))
        metrics.update(reward_metrics(output))
        output.rollout_metrics = dict(metrics)
        log_batch_summary(metrics)
        attempts = sorted(batch.attempt_log, key=lambda record: (record.rollout_index, record.attempt))
        return BatchResult(trajectories, output, metrics, failures, attempts)


async def _on_a_thread_of_its_own(call: Callable[[], object]) -> None:
    """Run ``call`` (starting or ending workers) off the event loop, on a thread that ends with it rather
    than one the loop's executor keeps."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if error is None else done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            call()
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="gym-resilience-env-workers", daemon=True).start()
    await done


class _Supervisor:
    """Runs every job, at most ``limit`` at once; on the first failure that must propagate, cancels the
    rest and raises it once every rollout has finished (and closed its env), or ``teardown_s`` passed.

    Rollouts are started in job order, the first ``limit`` at once (the start line's), then as slots
    free up rather than all at once, so a large batch keeps a bounded number of tasks alive and the
    cost per rollout stays flat.
    """

    def __init__(
        self,
        jobs: list[_Job],
        start: Callable[[_Job], Coroutine[Any, Any, Outcome | _Fatal]],
        limit: int,
        teardown_s: float,
    ) -> None:
        self._pending = iter(jobs)
        self._teardown_s = teardown_s
        self._start = start
        self._limit = limit
        self._results: list[Outcome | None] = [None] * len(jobs)
        self._running: dict[asyncio.Task[Outcome | _Fatal], int] = {}  # each task's job index
        # One callback and one context for every task: nothing more is made per rollout.
        self._done = self._on_done
        self._done_context = contextvars.copy_context()
        self._aborting: BaseException | None = None
        self._finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run(self, started: Callable[[], None] | None = None) -> list[Outcome]:
        """Every job's outcome, in job order; ``started`` is called once the first rollouts' tasks exist."""
        self._launch()
        if started is not None:
            started()
        try:
            await asyncio.shield(self._finished)
        except asyncio.CancelledError as cancelled:
            self._abort(cancelled)
            await self._wait_for_rollouts()
            raise
        if self._aborting is not None:
            await self._wait_for_rollouts()
            raise self._aborting
        return [outcome for outcome in self._results if outcome is not None]

    async def _wait_for_rollouts(self) -> None:
        """Wait, through cancellation, until every rollout started has ended (and closed its env), for
        ``teardown_s`` at most: each rollout's teardown is bounded, so only a task that lost its wake-up
        can outlast it, and the batch then closes the envs left open itself (``OpenEnvs``).

        It watches the tasks, not ``_finished``: a KeyboardInterrupt raised by a signal handler inside
        ``_on_done`` can leave that future unset after the last rollout ended.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._teardown_s
        cancellation: asyncio.CancelledError | None = None
        while (running := [task for task in self._running if not task.done()]) and loop.time() < deadline:
            for task in running:
                if not task.cancelling():
                    task.cancel()
            try:
                await asyncio.wait(running, timeout=deadline - loop.time())
            except asyncio.CancelledError as cancelled:
                cancellation = cancellation or cancelled
        if cancellation is not None:
            raise cancellation

    def _launch(self) -> None:
        while len(self._running) < self._limit and self._aborting is None:
            job = next(self._pending, None)
            if job is None:
                break
            task = asyncio.create_task(self._start(job))
            self._running[task] = job.index  # first: its callback finds it there
            task.add_done_callback(self._done, context=self._done_context)
        if not self._running and not self._finished.done():
            self._finished.set_result(None)

    def _on_done(self, task: asyncio.Task[Outcome | _Fatal]) -> None:
        index = self._running.pop(task)
        if task.cancelled():
            self._abort(asyncio.CancelledError())
        elif (error := task.exception()) is not None:
            self._abort(error)
        elif isinstance(outcome := task.result(), _Fatal):
            self._abort(outcome.exception)
        else:
            self._results[index] = outcome
        self._launch()

    def _abort(self, error: BaseException) -> None:
        """Cancel every rollout and wake ``run``, which waits for them (bounded) and raises ``error``."""
        if self._aborting is None:
            self._aborting = error
            if not self._finished.done():
                self._finished.set_result(None)
            for task in self._running:
                if not task.done() and not task.cancelling():
                    task.cancel()


class _Batch:
    """The parts one ``generate`` call shares among its rollouts, and how it runs one of them."""

    def __init__(
        self,
        runner: BatchRunner,
        codec: ChatCodec,
        pool: EnvPool,
        start_line: StartLine,
        workers: WorkerPool[Any] | None,
    ) -> None:
        self.engine = runner.engine
        self.workers = workers
        self.worker_slots: asyncio.Semaphore | None = None  # the runner's, while the batch runs
        self.env_factory = runner.env_factory
        self.config = runner.config
        self.codec = codec
        self.pool = pool
        self.late = LateCloses(self.config.close_timeout_s, nudge=pool.deliver_pending)
        self.open_envs = OpenEnvs()
        self.start_line = start_line
        self.turn_line = TurnLine(self.config.turn_wait_s)
        self.attempts: dict[int, int] = {}
        self.attempt_log: list[AttemptRecord] = []

    def _context(self, job: _Job, attempt: int = 0) -> RolloutContext:
        return RolloutContext(
            engine=self.engine,
            codec=self.codec,
            env_factory=self.env_factory,
            config=self.config,
            pool=self.pool,
            late=self.late,
            open_envs=self.open_envs,
            start_line=self.start_line,
            turn_line=self.turn_line,
            task=job.task,
            trajectory_id=job.trajectory_id,
            progress=Progress(rollout_index=job.index, attempt=attempt),
            workers=self.workers,
        )

    async def rollout(self, job: _Job) -> Outcome | _Fatal:
        """One rollout with its retries; a contained failure becomes a ``FailedRollout``."""
        context = self._context(job)
        first_start = context.progress.started
        try:
            if self.config.retry is None:
                return await self._attempt(context)
            async for attempt in self._retrying(self.config.retry, job):
                with attempt:
                    context = self._context(job, attempt.retry_state.attempt_number - 1)
                    return await self._attempt(context)
            raise AssertionError("tenacity stopped without a result or an error")  # pragma: no cover
        except Exception as exc:
            if not self.config.skip_failed_rollouts:
                raise
            failure = FailedRollout(
                exception=exc,
                rollout_index=job.index,
                trajectory_id=job.trajectory_id,
                phase=context.progress.phase,
                turn=context.progress.turn,
                elapsed_s=time.perf_counter() - first_start,
                attempts=self.attempts.get(job.index, 1),
            )
            log_failed_rollout(failure)
            return failure
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as exc:
            return _Fatal(exc)

    def _retrying(self, policy: RetryPolicy, job: _Job) -> tenacity.AsyncRetrying:
        """Tenacity's loop for one rollout under the policy's bounds, counting its attempts."""

        def count(state: tenacity.RetryCallState) -> None:
            self.attempts[job.index] = state.attempt_number + 1
            log_retry(job.index, job.trajectory_id, state)

        return policy.async_retrying(before_sleep=count)

    async def _attempt(self, context: RolloutContext) -> AnyTrajectory:
        """One attempt at a rollout, from a fresh env, recorded in ``attempts``; one that fails before
        the start line holds the rollouts waiting there no more. With env workers, it holds one of the
        runner's worker slots meanwhile (its env is closed, or left to its thread, when it returns)."""
        try:
            if self.worker_slots is None:
                trajectory = await run_agent_loop(context)
            else:
                async with self.worker_slots:
                    trajectory = await run_agent_loop(context)
        except Exception as exc:
            self.attempt_log.append(_attempt_record(context.progress, exc))
            raise
        finally:
            self.start_line.leave(context.index)
        self.attempt_log.append(_attempt_record(context.progress, None))
        return trajectory


def _attempt_record(progress: Progress, error: Exception | None) -> AttemptRecord:
    node_id = progress.node_id
    cause: BaseException | None = error
    while node_id is None and cause is not None:  # an env lost while starting names its node, if known
        node_id = getattr(cause, "node_id", None)
        cause = cause.__cause__
    return AttemptRecord(
        rollout_index=progress.rollout_index,
        attempt=progress.attempt,
        node_id=node_id if isinstance(node_id, str) else None,
        phase=progress.phase,
        elapsed_s=progress.elapsed(),
        error=None if error is None else describe_exception(error),
    )


def check_failures(failures: list[FailedRollout], *, total: int, max_failed_fraction: float | None) -> None:
    """Raise when the batch carries no signal (every rollout failed) or more failures than budgeted."""
    if not failures:
        return
    exceptions = [failure.exception for failure in failures]
    if len(failures) == total:
        raise AllRolloutsFailedError(exceptions) from exceptions[0]
    if max_failed_fraction is not None and len(failures) > max_failed_fraction * total:
        raise FailureBudgetExceededError(
            exceptions, total=total, max_failed_fraction=max_failed_fraction
        ) from exceptions[0]


def post_process(trajectories: list[AnyTrajectory], output: BatchOutput, config: RunnerConfig) -> None:
    """Apply ``zero_reward_on_non_stop`` and ``apply_overlong_filtering`` in place to the trajectories,
    then copy each edited row into ``output`` (built from them), so both views of the batch agree.

    Any stop reason but ``"stop"`` is non-stop, so a placeholder contributes nothing through them either.
    """
    if not (config.zero_reward_on_non_stop or config.apply_overlong_filtering):
        return
    steps = [s for t in trajectories for s in (t.steps if isinstance(t, StepWiseTrajectory) else [t])]
    for row, step in enumerate(steps):
        if step.stop_reason == "stop":
            continue
        if config.zero_reward_on_non_stop:
            step.reward = [0.0] * len(step.reward) if isinstance(step.reward, list) else 0.0
            output.rewards[row] = list(step.reward) if isinstance(step.reward, list) else step.reward
        if config.apply_overlong_filtering:
            step.loss_mask = [0] * len(step.loss_mask)
            output.loss_masks[row] = list(step.loss_mask)


def mask_failed_groups(trajectories: list[AnyTrajectory], output: BatchOutput, groups: list[Any]) -> int:
    """Zero the loss mask of every row whose group (``groups[row]``, e.g. the task's instance id) holds a
    placeholder, in the trajectories and in ``output`` alike, and that row's reward in ``output``; returns
    how many groups were masked.

    This is ``failed_group_policy="mask_group"``: a trainer that knows nothing of placeholders (SkyRL's
    GRPO puts a placeholder's 0.0 into its group's mean and std) learns nothing from such a group. The
    rewards go too (the trajectories keep theirs) so the group has no variance: SkyRL's dynamic sampling
    (``filter``, ``replace``) would otherwise keep it, for the spread a placeholder made up, in place of a
    group that teaches something; and its GRPO advantages are then exactly 0.
    """
    flags = output.is_placeholder or [False] * len(output)
    failed = {group for group, placeholder in zip(groups, flags, strict=True) if placeholder}
    if not failed:
        return 0
    steps = [s for t in trajectories for s in (t.steps if isinstance(t, StepWiseTrajectory) else [t])]
    for row, step in enumerate(steps):
        if groups[row] in failed:
            step.loss_mask = [0] * len(step.loss_mask)
            output.loss_masks[row] = list(step.loss_mask)
            reward = output.rewards[row]
            output.rewards[row] = [0.0] * len(reward) if isinstance(reward, list) else 0.0
    return len(failed)
