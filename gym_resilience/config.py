"""``RunnerConfig``: every knob of the batch runner, checked once at construction."""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gym_resilience import errors
from gym_resilience.backends.deadlines import check_seconds
from gym_resilience.engines.base import Sampling
from gym_resilience.errors import UnsupportedConfigError
from gym_resilience.errors import show as _show
from gym_resilience.retry import RetryPolicy

__all__ = [
    "ENV_BACKENDS",
    "FAILED_GROUP_POLICIES",
    "TOKEN_LAYOUTS",
    "EnvBackend",
    "RunnerConfig",
    "TokenLayout",
]

EnvBackend = Literal["thread", "process", "ray"]
"""Where a rollout's env runs: a thread of this process, a worker process, or a Ray actor."""

ENV_BACKENDS: tuple[EnvBackend, ...] = typing.get_args(EnvBackend)

FailedGroupPolicy = Literal["keep", "mask_group"]
"""What a batch does with the rows of a group (the samples of one task) that lost a rollout."""

FAILED_GROUP_POLICIES: tuple[FailedGroupPolicy, ...] = typing.get_args(FailedGroupPolicy)

TokenLayout = Literal["closed", "skyrl"]
"""How a multi-turn rollout lays out its tokens: ``"closed"`` ends every turn with the end-of-turn token
and keeps step-wise prompts token for token; ``"skyrl"`` is SkyRL's generator's layout."""

TOKEN_LAYOUTS: tuple[TokenLayout, ...] = typing.get_args(TokenLayout)

MAX_SEED = 2**62
"""The largest ``seed``: each rollout's, ``seed + index``, stays a seed vLLM takes (below 2**63)."""


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How ``BatchRunner`` runs a batch. Defaults follow SkyRL's generator: failures abort the step.

    Attributes:
        skip_failed_rollouts: contain each rollout's ``Exception`` and stand a placeholder trajectory in
            for it, so the step completes with the rest of its trajectories.
        max_turns: agent turns per rollout (one generation and one env step each).
        max_tokens: tokens generated per turn.
        max_input_length: stop a rollout before a turn whose input (prompt, responses, observations)
            is longer than this many tokens; None for no limit.
        n_samples_per_prompt: rollouts per task (trajectory ids ``<instance_id>_<repetition>``).
        temperature, top_p, seed: sampling; ``temperature=0.0`` is greedy and deterministic. Rollout
            ``i`` is seeded with ``seed + i`` (its env's reset and its sampling); ``seed`` is None
            (unseeded) or an int from 0 to 2**62.
        logprobs: record the sampled tokens' logprobs (0.0 for env-written tokens).
        token_level_rewards: one reward per response token (each turn's reward on its last generated
            token) instead of one float per trajectory.
        step_wise: one trajectory per turn (``StepWiseTrajectory``) for step-wise training.
        batched: SkyRL's generator's batched single-turn path (``max_turns=1``). Engines batch
            concurrent requests themselves, so it runs the same loop; it is kept so ported
            configurations mean the same, and ``skip_failed_rollouts`` is rejected with it as in
            SkyRL's generator.
        return_routed_experts: return MoE routed-expert indices (no bundled engine provides them).
        zero_reward_on_non_stop: zero the reward of rows whose stop reason is not ``"stop"``.
        apply_overlong_filtering: zero the loss mask of rows whose stop reason is not ``"stop"``.
        max_concurrency: rollouts in flight at once (started as others finish); None for the whole
            batch at once. The default, 256, is vLLM's default batch size: more rollouts in flight would
            only queue in the engine while holding envs open.
        env_threads: threads running the (synchronous) env calls, so a slow env never blocks the loop.
            None (the default): up to one per rollout in flight, taken past the first 16 only while the
            env calls block (wait on I/O, a sleep, a worker), so that blocking envs step all at once and
            fast ones run on few threads; an int: that many, taken as calls find none free.
        start_wait_s: how long the rollouts a batch starts at once wait, each with its env open and
            reset, for the others still opening theirs, counted from the first to arrive (or fail), so
            that their first prompts reach the engine together (``rollout/start_line.py``); 0 sends
            each prompt as soon as its env is open.
        turn_wait_s: while the engine has none of the batch's requests in flight, how long a rollout
            ready for its next turn waits for the others still stepping their envs, counted from the
            first that waits, so that a turn's prompts reach the engine together
            (``rollout/turn_line.py``); 0 sends each as soon as it is ready.
        retry: rerun a rollout that failed with a transient error (``retry.retry_on`` anywhere in its
            ``__cause__`` chain) from scratch with a fresh env, before it counts as failed.
        max_failed_fraction: with ``skip_failed_rollouts``, raise ``FailureBudgetExceededError`` when
            more than this fraction of the batch failed, instead of training on mostly placeholders.
        generation_timeout_s: deadline of one engine call; the request is aborted in the engine.
        rollout_timeout_s: deadline of one whole rollout attempt (``RolloutTimeoutError``).
        env_backend: where each rollout's env runs (``backends.choice.make_env`` decides from it):
            ``"thread"``, in this process, its calls in the ``env_threads`` pool; ``"process"``, in a
            worker process of its own (``IsolatedEnv``), so a hung env can be killed, and ``env_factory``
            and the tasks must then be picklable; ``"ray"``, in a Ray actor of its own (``RayEnv``) on the
            cluster this process is connected to (``ray.init``; see docs/ray.md), which a deadline kills.
        env_workers: with ``env_backend`` ``"process"`` or ``"ray"``, the most worker processes or actors
            alive at once (``backends/pool.py``); None: ``max_concurrency`` (None: as many as rollouts are
            in flight). A rollout holds its env's worker from its build to its close, so at most this many
            rollouts are in flight. Workers serve one rollout after another, each with a new env from
            ``env_factory``, and are kept across the batches of one ``BatchRunner`` until its ``close()``
            (or ``async with``); a worker whose env passed a deadline, failed to close or left something
            behind is killed and replaced (docs/guarantees.md, "fresh").
        env_workers_prestart: start ``env_workers`` workers (at most the rollouts in flight) before a
            runner's first batch, rather than as its rollouts need them.
        env_worker_reuse: ``False`` gives every rollout's env a worker process or actor of its own, killed
            after its close (slower: for envs that must never share a process).
        env_actor_options: with ``env_backend="ray"``, the options of each env's actor (``num_cpus``,
            ``resources``, ``scheduling_strategy``, ...); None: ``backends.ray.DEFAULT_ACTOR_OPTIONS``.
        isolate_envs: ``True`` is the older spelling of ``env_backend="process"`` (the backend becomes
            ``"process"``; with another backend than ``"thread"`` or ``"process"`` it is refused).
        env_step_timeout_s, env_reset_timeout_s: deadlines of one env call; they need ``isolate_envs``
            (or ``env_backend`` ``"process"`` or ``"ray"``), because a thread stuck in an env cannot be
            stopped.
        env_create_timeout_s: deadline for building one env (its worker's or actor's start and
            ``env_factory``); past it the worker is killed and the rollout fails with
            ``EnvTimeoutError``. Needs a killable backend, for the same reason.
        failed_group_policy: with ``skip_failed_rollouts``, what happens to the rows of a group (the
            samples of one task) that holds a placeholder: ``"keep"`` trains on them as they are (a
            placeholder's 0.0 then enters the group's GRPO mean and std in a trainer that does not know
            placeholders); ``"mask_group"`` gives every row of the group an all-zero loss mask and reward
            0.0 in the output, so the trainer learns nothing from that group and nothing biased by it,
            and dynamic sampling sees no variance there.
        token_layout: ``"closed"`` (the default) ends a turn that stopped without the end-of-turn token
            (a length-truncated one) with that token, loss-masked, before the observation, and a
            step-wise step's prompt is the previous prompt and response token for token;
            ``"skyrl"`` lays tokens out as SkyRL's generator does: the observation follows a truncated
            turn directly, a rollout stopped by ``max_input_length`` drops its trailing observation, and
            a step-wise step holds the generated and observation tokens while each prompt is the chat
            template applied to the decoded history.
        close_timeout_s: how long tearing down a rollout waits for its env's ``close`` (or for an env
            still being built when the rollout gave up); past it the thread running that call closes the
            env when the call returns, the batch does not wait for it, and its metric
            ``envs_closed_late`` counts it. An isolated env's close kills its worker past this deadline.
    """

    skip_failed_rollouts: bool = False
    max_turns: int = 1
    max_tokens: int = 64
    max_input_length: int | None = None
    n_samples_per_prompt: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    logprobs: bool = False
    token_level_rewards: bool = False
    step_wise: bool = False
    batched: bool = False
    return_routed_experts: bool = False
    zero_reward_on_non_stop: bool = False
    apply_overlong_filtering: bool = False
    max_concurrency: int | None = 256
    env_threads: int | None = None
    start_wait_s: float = 0.01
    turn_wait_s: float = 0.01
    retry: RetryPolicy | None = None
    max_failed_fraction: float | None = None
    generation_timeout_s: float | None = None
    rollout_timeout_s: float | None = None
    isolate_envs: bool = False
    env_backend: EnvBackend = "thread"
    env_actor_options: Mapping[str, Any] | None = None
    env_workers: int | None = None
    env_workers_prestart: bool = False
    env_worker_reuse: bool = True
    env_step_timeout_s: float | None = None
    env_reset_timeout_s: float | None = None
    env_create_timeout_s: float | None = None
    close_timeout_s: float = 10.0
    failed_group_policy: FailedGroupPolicy = "keep"
    token_layout: TokenLayout = "closed"

    def rollout_seed(self, rollout_index: int) -> int | None:
        """``seed + rollout_index``: the RNG seed of that rollout's env reset and sampling (None without
        a ``seed``)."""
        return None if self.seed is None else self.seed + rollout_index

    def sampling(self, rollout_index: int) -> Sampling:
        """What the rollout ``rollout_index`` (task x sample, in task order) asks the engine for, every
        turn: to send an engine the same requests as a batch does (a benchmark's baseline, say)."""
        return Sampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.rollout_seed(rollout_index),
            logprobs=self.logprobs,
        )

    @classmethod
    def from_mapping(
        cls,
        mapping: Mapping[str, Any],
        *,
        exceptions: Callable[[str], type[BaseException]] | None = None,
        at: Sequence[str | int] = ("runner",),
    ) -> RunnerConfig:
        """The configuration plain data describes (a parsed YAML or JSON mapping of field names).

        Every key must be a field, every value of its field's type (an integer is a number; a finite
        one: ``null`` says "no deadline"). ``retry`` is null or a mapping of ``RetryPolicy`` fields but
        ``sleep`` and ``async_sleep``, whose ``retry_on`` lists exception names, resolved by
        ``exceptions`` (by default a built-in exception or an error gym_resilience exports).

        Args:
            mapping: the data.
            exceptions: turns an exception name into its class; raises ``ValueError`` (whose message
                is the reason given) for a name it cannot resolve.
            at: where ``mapping`` sits in the caller's data: the start of every error's ``path``.

        Raises:
            UnsupportedConfigError: the first bad key or value in ``mapping``'s order, or a combination
                ``RunnerConfig`` or ``RetryPolicy`` rejects; ``path`` is the value's place
                (``("runner", "retry", "attempts")``), ``option`` that path as text
                (``runner.retry.attempts``), ``reason`` what is wrong with it.

        Example:
            >>> RunnerConfig.from_mapping({"max_turns": 3, "retry": {"attempts": 2}}).retry.attempts
            2
            >>> RunnerConfig.from_mapping({"retry": {"attempts": 0}})
            Traceback (most recent call last):
            ...
            gym_resilience.errors.UnsupportedConfigError: runner.retry.attempts: must be an int >= 1, got 0
        """
        resolve = exceptions or _known_exception
        root = tuple(at)
        hints = _field_types(cls)
        values: dict[str, Any] = {}
        for key, value in _fields_of(cls, mapping, root).items():
            if key == "retry":
                values[key] = None if value is None else _retry_policy(value, (*root, key), resolve)
            else:
                values[key] = _typed(value, hints[key], (*root, key))
        try:
            return cls(**values)
        except UnsupportedConfigError as exc:
            raise _at((*root, *exc.path), exc.reason) from None

    def __post_init__(self) -> None:
        self._check_types()
        _check_positive("max_turns", self.max_turns)
        _check_positive("max_tokens", self.max_tokens)
        _check_positive("n_samples_per_prompt", self.n_samples_per_prompt)
        if self.env_threads is not None:
            _check_positive("env_threads", self.env_threads)
        if self.max_input_length is not None:
            _check_positive("max_input_length", self.max_input_length)
        if self.max_concurrency is not None:
            _check_positive("max_concurrency", self.max_concurrency)
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            # vLLM takes a negative seed for none (-1) and refuses one past 64 bits: the rollouts' seeds,
            # seed + index, must all be seeds.
            raise UnsupportedConfigError(
                f"must be None or an int from 0 to 2**62 (rollout i is seeded with seed + i), "
                f"got {self.seed!r}",
                option="seed",
            )
        for option in (
            "generation_timeout_s",
            "rollout_timeout_s",
            "env_step_timeout_s",
            "env_reset_timeout_s",
            "env_create_timeout_s",
        ):
            check_seconds(option, getattr(self, option))
        check_seconds("close_timeout_s", self.close_timeout_s)
        check_seconds("start_wait_s", self.start_wait_s, allow_none=False, allow_zero=True)
        check_seconds("turn_wait_s", self.turn_wait_s, allow_none=False, allow_zero=True)
        self._check_env_backend()
        env_deadlines = ("env_step_timeout_s", "env_reset_timeout_s", "env_create_timeout_s")
        needs_isolation = [option for option in env_deadlines if getattr(self, option) is not None]
        if self.env_backend == "thread" and needs_isolation:
            raise UnsupportedConfigError(
                "needs env_backend='process' or 'ray' (isolate_envs=True is 'process'): a thread stuck "
                "in an env cannot be stopped, so a deadline without a process to kill would not be a "
                "deadline",
                option=needs_isolation[0],
            )
        if self.max_failed_fraction is not None:
            if not 0 <= self.max_failed_fraction < 1:
                raise UnsupportedConfigError(
                    f"must be in [0, 1), got {self.max_failed_fraction}", option="max_failed_fraction"
                )
            if not self.skip_failed_rollouts:
                raise UnsupportedConfigError(
                    "needs skip_failed_rollouts=True: without it the first failure aborts the batch",
                    option="max_failed_fraction",
                )
        if self.temperature < 0:
            raise UnsupportedConfigError(f"must be >= 0, got {self.temperature}", option="temperature")
        if not 0 < self.top_p <= 1:
            raise UnsupportedConfigError(f"must be in (0, 1], got {self.top_p}", option="top_p")
        if self.skip_failed_rollouts and self.batched:
            raise UnsupportedConfigError(
                "cannot be combined with batched=True: the batched single-turn path has no agent loop, "
                "so the flag would silently do nothing",
                option="skip_failed_rollouts",
            )
        if self.skip_failed_rollouts and self.return_routed_experts:
            raise UnsupportedConfigError(
                "cannot be combined with return_routed_experts=True: a placeholder has no routed-expert "
                "indices to stand in for",
                option="skip_failed_rollouts",
            )
        if self.return_routed_experts:
            raise UnsupportedConfigError(
                "no engine of gym_resilience returns routed-expert indices", option="return_routed_experts"
            )
        if self.batched and (self.max_turns != 1 or self.step_wise):
            raise UnsupportedConfigError(
                "batched=True is the single-turn path: it needs max_turns=1 and step_wise=False",
                option="batched",
            )

    def _check_types(self) -> None:
        """Each field of its annotated type (the check ``from_mapping`` makes of plain data; an int given
        for a float field becomes a float), so that a wrong one fails here, naming the field, rather than
        in the middle of a batch."""
        for name, annotation in _field_types(type(self)).items():
            value = getattr(self, name)
            if name == "retry":
                if value is not None and not isinstance(value, RetryPolicy):
                    raise _at((name,), f"expected None or a RetryPolicy, got {_show(value)}")
            elif type(checked := _typed(value, annotation, (name,))) is not type(value):
                object.__setattr__(self, name, checked)  # frozen: an int made a float

    def _check_env_backend(self) -> None:
        """Checks ``env_backend`` and the options that go with it; ``isolate_envs`` selects "process"."""
        if self.env_backend not in ENV_BACKENDS:
            raise UnsupportedConfigError(
                f"must be one of {', '.join(map(repr, ENV_BACKENDS))}, got {self.env_backend!r}",
                option="env_backend",
            )
        if self.isolate_envs:
            if self.env_backend == "ray":
                raise UnsupportedConfigError(
                    "isolate_envs=True means env_backend='process', and env_backend is 'ray': set only one",
                    option="isolate_envs",
                )
            object.__setattr__(self, "env_backend", "process")  # frozen: the one place that sets it
        if self.env_actor_options is not None:
            if self.env_backend != "ray":
                raise UnsupportedConfigError(
                    f"needs env_backend='ray' (actor options place Ray actors), got {self.env_backend!r}",
                    option="env_actor_options",
                )
            from gym_resilience.backends.ray import check_actor_options  # not at import: it is rarely needed

            check_actor_options(self.env_actor_options)
        self._check_env_workers()

    def _check_env_workers(self) -> None:
        """The worker pool's options need a backend with workers, and a pool of at least one."""
        if self.env_workers is not None:
            _check_positive("env_workers", self.env_workers)
        if self.env_backend != "thread":
            return
        set_here = [
            option
            for option, default in (
                ("env_workers", None),
                ("env_workers_prestart", False),
                ("env_worker_reuse", True),
            )
            if getattr(self, option) != default
        ]
        if set_here:
            raise UnsupportedConfigError(
                "needs env_backend='process' or 'ray': envs on threads run in this process, with no "
                "worker to pool",
                option=set_here[0],
            )

    @property
    def env_pool_size(self) -> int | None:
        """How many worker processes or actors may be alive at once (None: no bound); see ``env_workers``."""
        return self.env_workers if self.env_workers is not None else self.max_concurrency


_FIELD_TYPES: dict[type[Any], dict[str, Any]] = {}


def _field_types(kind: type[Any]) -> dict[str, Any]:
    """The resolved annotations of a dataclass's init fields (resolved once per class)."""
    if kind not in _FIELD_TYPES:
        hints = typing.get_type_hints(kind)
        fields = dataclasses.fields(kind)
        _FIELD_TYPES[kind] = {field.name: hints[field.name] for field in fields if field.init}
    return _FIELD_TYPES[kind]


def _check_positive(option: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedConfigError(f"must be a positive integer, got {value!r}", option=option)


# --- from_mapping: plain data to a configuration ---------------------------------------------------------

# RetryPolicy fields plain data cannot set: how a retry sleeps is for code (tests) to inject.
_RETRY_FIELDS_NOT_IN_DATA = frozenset({"sleep", "async_sleep"})


def _at(path: Sequence[str | int], reason: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(reason, option=_dotted(path), path=path)


def _dotted(path: Sequence[str | int]) -> str:
    """``("runner", "retry", "retry_on", 1)`` -> ``runner.retry.retry_on[1]``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _fields_of(
    kind: type[Any], value: Any, root: tuple[str | int, ...], excluded: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``value`` checked to be a mapping of ``kind``'s init fields (those not ``excluded``), in order."""
    known = [field.name for field in dataclasses.fields(kind) if field.init and field.name not in excluded]
    if not isinstance(value, Mapping):
        raise _at(
            root, f"expected a mapping of {kind.__name__} fields ({', '.join(known)}), got {_show(value)}"
        )
    for key in value:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; expected one of {', '.join(known)}"
            raise _at((*root, key), f"unknown field {_show(key)}{hint}")
    return dict(value)


def _retry_policy(
    value: Any, root: tuple[str | int, ...], resolve: Callable[[str], type[BaseException]]
) -> RetryPolicy:
    if not isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(RetryPolicy) if f.name not in _RETRY_FIELDS_NOT_IN_DATA]
        raise _at(
            root, f"expected null or a mapping of RetryPolicy fields ({', '.join(known)}), got {_show(value)}"
        )
    hints = _field_types(RetryPolicy)
    values: dict[str, Any] = {}
    for key, item in _fields_of(RetryPolicy, value, root, _RETRY_FIELDS_NOT_IN_DATA).items():
        if key == "retry_on":
            values[key] = _retry_on(item, (*root, key), resolve)
        else:
            values[key] = _typed(item, hints[key], (*root, key))
    try:
        return RetryPolicy(**values)
    except UnsupportedConfigError as exc:
        raise _at((*root, *exc.path), exc.reason) from None


def _retry_on(
    value: Any, root: tuple[str | int, ...], resolve: Callable[[str], type[BaseException]]
) -> tuple[type[Exception], ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(name, str) for name in value):
        raise _at(root, f"expected a list of exception names, got {_show(value)}")
    kinds: list[type[Exception]] = []
    for index, name in enumerate(value):
        try:
            kind = resolve(name)
        except ValueError as exc:
            raise _at((*root, index), str(exc)) from None
        if not issubclass(kind, Exception):
            raise _at(
                (*root, index),
                f"{name!r} cannot be retried: retry_on takes Exception subclasses, and cancellation and "
                "KeyboardInterrupt always propagate",
            )
        kinds.append(kind)
    return tuple(kinds)


def _known_exception(name: str) -> type[BaseException]:
    """A built-in exception or an error gym_resilience exports, by name."""
    for namespace in (vars(errors), vars(builtins)):
        found = namespace.get(name)
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
    raise ValueError(f"unknown exception {name!r}: expected a built-in exception or a gym_resilience error")


_WORDS: dict[Any, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "null",
}


def _word(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    if typing.get_origin(annotation) is Mapping:
        return "a mapping"
    return _WORDS.get(annotation, "a value")


def _typed(value: Any, annotation: Any, path: tuple[str | int, ...]) -> Any:
    """``value`` if a type ``annotation`` allows has it (an int is a float, and becomes one)."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for member in members:
        if member is type(None) and value is None:
            return None
        if member is bool and isinstance(value, bool):
            return value
        if member is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)  # NumPy's integers too
        if member is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            if not math.isfinite(value):  # an infinite deadline is no deadline: null says that
                raise _at(path, f"expected a finite number, got {_show(value)}")
            return float(value)
        if member is str and isinstance(value, str):
            return value
        if typing.get_origin(member) is Literal and value in typing.get_args(member):
            return value
        if typing.get_origin(member) is Mapping and isinstance(value, Mapping):
            if not all(isinstance(key, str) for key in value):
                raise _at(path, f"expected a mapping with string keys, got {_show(value)}")
            return dict(value)
    words = [_word(member) for member in members]
    if "a number" in words and "an integer" in words:
        words.remove("an integer")
    raise _at(path, f"expected {' or '.join(words)}, got {_show(value)}")
