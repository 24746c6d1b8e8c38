"""Envs in Ray actors: an env on whatever Ray cluster this process is connected to, killed at deadlines.

:class:`RayEnv` is :class:`~gym_resilience.backends.process.IsolatedEnv` for fleets that span machines:
the env lives in its own Ray actor instead of a local worker process, and the same requests and replies
(:mod:`gym_resilience.backends.protocol`) travel as the actor's method calls. A deadline kills
the actor (``ray.kill``); an actor that dies, or whose node dies, makes the env lost
(:class:`EnvWorkerDiedError` naming the node). The caller connects to the cluster (``ray.init(address=
...)``); nothing here starts one.

Each env costs one actor, which Ray runs in a worker process of its own on some node; the cluster's nodes
need gym_resilience and the env's code installed. By default an env actor reserves no CPU
(``num_cpus=0``): an env mostly waits for the model and for its tools, so a one-CPU node holds dozens of
them, as many as its memory allows. Pass ``actor_options`` (``num_cpus``, ``resources``,
``scheduling_strategy``, ...) to reserve what an env really uses or to place it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

from gym_resilience.backends.deadlines import check_seconds
from gym_resilience.backends.pool import EnvTurns, Lease, WorkerPool, lease
from gym_resilience.backends.protocol import (
    CLOSE_REQUEST,
    DEFAULT_CLOSE_TIMEOUT_S,
    EnvFn,
    RemoteEnv,
    StartAbort,
    unpack_reply,
)
from gym_resilience.backends.ray_host import RAY_EXTRA, host_class, ray_module
from gym_resilience.errors import (
    DependencyNotInstalledError,
    EnvClosedError,
    EnvError,
    EnvTimeoutError,
    EnvWorkerDiedError,
    UnsupportedConfigError,
)

__all__ = ["DEFAULT_ACTOR_OPTIONS", "RAY_EXTRA", "RayEnv", "RayWorkers", "ray_workers"]

DEFAULT_ACTOR_OPTIONS: Mapping[str, Any] = {"num_cpus": 0}
"""What an env actor reserves unless ``actor_options`` says otherwise: no CPU (see the module's text)."""

# An actor that restarts would continue an episode on a fresh env: a lost env must stay lost.
_FIXED_ACTOR_OPTIONS: Mapping[str, Any] = {"max_restarts": 0, "max_task_retries": 0}

# Options that would make the actors of several envs one, or let one outlive its env.
_REFUSED_ACTOR_OPTIONS: Mapping[str, str] = {
    "name": "one name would be every env's (RayEnv takes a name of its own)",
    "get_if_exists": "it would hand several envs one actor",
    "lifetime": "a detached actor would outlive the program that closes it",
}


def check_ray_installed() -> None:
    """Raises :class:`DependencyNotInstalledError` unless ray can be imported (without importing it)."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # a module "ray" that is None or has no spec: it cannot be imported either
        found = False
    if not found:
        raise DependencyNotInstalledError(package="ray", extra=RAY_EXTRA)


def check_actor_options(actor_options: Mapping[str, Any]) -> None:
    """Raises :class:`UnsupportedConfigError` for actor options an env actor cannot take (restarts)."""
    _actor_options(actor_options, None)


def import_ray() -> Any:
    """The ``ray`` module, connected to a cluster.

    Raises:
        DependencyNotInstalledError: ray is not installed.
        UnsupportedConfigError: this process is not connected to a Ray cluster (``ray.init`` not called).
    """
    ray = ray_module()
    if not ray.is_initialized():
        raise UnsupportedConfigError(
            "Ray envs run on the Ray cluster this process is connected to, and it is connected to none: "
            "call ray.init(address=...) first (gym_resilience never starts a cluster)",
            option="env_backend",
        )
    return ray


def _refused_by_ray(error: Exception) -> UnsupportedConfigError:
    """``error``, what Ray raised for the env actors' options, as the configuration error it is."""
    return UnsupportedConfigError(f"Ray refused them: {error}", option="env_actor_options")


def _checked_by_ray(options: dict[str, Any]) -> dict[str, Any]:
    """``options``, once Ray's own check of an actor's options (``ActorClass.options``: the keywords, their
    types and values, the ``runtime_env``) found nothing wrong; it needs no cluster. Ray checks a
    ``scheduling_strategy`` given as a string only when it creates an actor (see :meth:`_Actor.create`).

    Raises:
        UnsupportedConfigError: Ray refused them; its reason is in the message.
    """
    try:
        host_class().options(**options)
    except (ValueError, TypeError) as exc:
        raise _refused_by_ray(exc) from exc
    return options


def _actor_options(actor_options: Mapping[str, Any] | None, name: str | None) -> dict[str, Any]:
    options = {**DEFAULT_ACTOR_OPTIONS, **(actor_options or {})}
    for key, why in _REFUSED_ACTOR_OPTIONS.items():
        if key in options:
            raise UnsupportedConfigError(
                f"{key} cannot be set: each env has an actor of its own, ended with its env; {why}, "
                f"got {options[key]!r}",
                option="env_actor_options",
            )
    for key, fixed in _FIXED_ACTOR_OPTIONS.items():
        if options.get(key, fixed) != fixed:
            raise UnsupportedConfigError(
                f"{key} must be {fixed}: an env's state dies with its actor, so a restarted actor would "
                f"continue an episode on a fresh env, got {options[key]!r}",
                option="env_actor_options",
            )
    options.update(_FIXED_ACTOR_OPTIONS)
    if name is not None:
        options["name"] = name
    return options


NODE_LOOKUP_S: Final = 5.0
"""How long, at most, finding an actor's node waits (for the actor's own answer, then for the GCS), and
asking the GCS whether that node is lost."""

T = TypeVar("T")

_HANDLES_KEPT_IN_FORKS: list[Any] = []

# Every env actor's _Actor in this process not yet collected (garbage cycles included), for the fork hook.
_ACTORS: weakref.WeakSet[_Actor] = weakref.WeakSet()


def _keep_in_fork(handle: Any) -> None:
    """Hold a forked copy's actor handle for good: the copy shares the parent's Ray identity, so Ray
    would take the last reference dropped here for the parent's and end the actor under it."""
    _HANDLES_KEPT_IN_FORKS.append(handle)


def _keep_every_handle_in_forked_child() -> None:
    """In a forked child, right after the fork: hold every actor handle and object ref of an env actor
    for good, so that none is ever released there.

    Releasing one runs Ray's client (``ActorHandle.__del__``, ``ObjectRef.__dealloc__``), whose threads
    did not survive the fork and whose connections the child shares with its parent: the child's garbage
    collector dropping an env that failed to start, or one the parent dropped without collecting it yet,
    could hang the child, and did write into the parent's connection to the GCS, whose next request to it
    never returned.
    """
    for actor in list(_ACTORS):
        _HANDLES_KEPT_IN_FORKS.append((actor.handle, actor._where))


os.register_at_fork(after_in_child=_keep_every_handle_in_forked_child)


def _is_node_id(value: Any) -> bool:
    """Whether ``value`` is a node id (hex) rather than empty or nil (all ``f``: not placed yet)."""
    return isinstance(value, str) and bool(value) and value.strip("f") != ""


def _ask_gcs(question: Callable[[], T], timeout: float) -> T | None:
    """What ``question`` (a call to the GCS) returns, or None if it raised or did not answer within
    ``timeout`` seconds. In a thread of its own: the GCS client waits for its answer without a deadline."""
    answers: list[T] = []

    def ask() -> None:
        with contextlib.suppress(Exception):  # a GCS that is gone or refuses: no answer
            answers.append(question())

    thread = threading.Thread(target=ask, name="gym-resilience-gcs-question", daemon=True)
    thread.start()
    thread.join(timeout)
    return answers[0] if answers else None


def _node_from_gcs(ray: Any, actor_id: str, timeout: float) -> str | None:
    """The node (hex) the GCS placed actor ``actor_id`` on, dead or alive, from its actor table; None if
    it was never placed, or the GCS did not answer within ``timeout`` seconds.

    The GCS records the actor's worker (its port and node) when it leases it one, before the actor runs
    anything, and keeps it after the actor died: it knows where an actor went that died before it could
    say. Before that lease, the address has no port, and its node is only where the request waits.
    """

    def look_up() -> str | None:
        info = ray._private.state.actors(actor_id=actor_id)
        address = info.get("Address") if isinstance(info, Mapping) else None
        if isinstance(address, Mapping) and address.get("Port") and _is_node_id(address.get("NodeID")):
            return str(address["NodeID"])
        return None

    return _ask_gcs(look_up, timeout)


class _Actor:
    """The parent's handle on one env actor: the calls (one at a time) and the state.

    As with a worker process, it serves one env at a time (``generation`` counts them), and ``close_env``
    or ``kill`` may run from another thread while a call waits: they kill the actor, and the waiting call
    wakes up and raises :class:`EnvClosedError`.
    """

    def __init__(self, ray: Any, handle: Any, where: Any, *, reuse: bool) -> None:
        self._ray = ray
        self.handle = handle
        self._where = where  # the reply of node_id(), submitted first: it may outlive the actor
        self._reuse = reuse
        self.envs = EnvTurns(reuse)
        self.actor_id: str = handle._actor_id.hex()
        self.node_id: str | None = None
        self.close_timeout = DEFAULT_CLOSE_TIMEOUT_S
        self.env_id: str | None = None
        self.lost: EnvError | None = None
        self._call_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._owner_pid = os.getpid()
        self.running = True
        _ACTORS.add(self)

    @classmethod
    def create(cls, options: Mapping[str, Any], *, reuse: bool) -> _Actor:
        """A new env actor with ``options``, asked for its node first (no handle is left in this frame)."""
        ray = import_ray()
        try:
            handle = host_class().options(**options).remote(reuse)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, ray.exceptions.RayError):  # a name taken already: Ray's error says so
                raise
            # Refused before any actor was created: what Ray checks only here (a scheduling_strategy
            # string it does not know) is the options' fault, like what _checked_by_ray catches.
            raise _refused_by_ray(exc) from exc
        return cls(ray, handle, handle.node_id.remote(), reuse=reuse)

    @property
    def retired_because(self) -> str | None:
        return self.envs.retired_because

    @property
    def reusable(self) -> bool:
        """Alive, with no env open, and its last env closed cleanly and left nothing behind."""
        return self.envs.reusable(self.running)

    def serving(self, generation: int) -> bool:
        return self.envs.serving(self.running, generation)

    def gone(self) -> bool:
        return not self.running  # only a call finds an actor dead

    def host_lost(self) -> bool:
        """Whether the actor died of its host: the GCS lists its node as dead (False if it cannot tell
        within ``NODE_LOOKUP_S``), or it never ran anywhere (no node found once it died: it was never
        placed, its node lost while it waited), so nothing of an env ran in it."""
        node_id = self.node_id
        if node_id is None:
            return not self.running

        def lost() -> bool:
            return any(
                node.get("NodeID") == node_id and not node.get("Alive", True) for node in self._ray.nodes()
            )

        return bool(_ask_gcs(lost, NODE_LOOKUP_S))

    def open(
        self, env_fn: EnvFn, *, timeout: float | None, abort: StartAbort | None, close_timeout: float
    ) -> tuple[int, dict[str, Any]]:
        """Builds an env in the actor: its generation and description, or what ``env_fn`` raised there."""
        with self._call_lock:
            generation = self.envs.next()
            self.env_id = None
            self.close_timeout = close_timeout
            if abort is not None:
                abort.watch(self)
            try:
                data = self._exchange(self.handle.open.remote(env_fn), operation="start", timeout=timeout)
            finally:
                if abort is not None:
                    abort.forget()
            self._find_node()
            description = self.envs.opened(data, self._unpack)
        return generation, description

    def request(
        self, command: str, payload: Any, *, operation: str, timeout: float | None, generation: int
    ) -> Any:
        """Runs ``command`` on env ``generation`` and returns its value, or raises what the env raised.

        Raises:
            EnvTimeoutError: no reply within ``timeout`` seconds; the actor was killed.
            EnvWorkerDiedError: the actor, or its node, died before it replied.
            EnvClosedError: the env was closed before, or by ``close_env`` from another thread meanwhile.
        """
        # An action that cannot be pickled fails here, before anything was sent: the actor is fine.
        request = pickle.dumps((command, payload))
        with self._call_lock:
            if not self.serving(generation):
                raise EnvClosedError(operation=operation, env_id=self.env_id)
            reply = self._exchange(self.handle.call.remote(request), operation=operation, timeout=timeout)
        return self._unpack(reply)

    def close_env(self, generation: int) -> None:
        """Asks the actor to close env ``generation`` within ``close_timeout``; kills the actor past it, or
        after the close if it serves one env only. Does nothing if that env was closed already.

        Raises:
            EnvTimeoutError: the env's close, or a call still in flight, outlasted ``close_timeout``.
            EnvWorkerDiedError: the actor died before it replied.
            Exception: what the env's ``close()`` raised.
        """
        if os.getpid() != self._owner_pid:  # a forked copy: the actor is the parent's to close
            _keep_in_fork(self.handle)
            return
        timeout = self.close_timeout
        deadline = time.monotonic() + timeout
        if not self._call_lock.acquire(timeout=timeout):
            # A call is in flight and does not end: the kill ends it (it raises EnvClosedError).
            if self.serving(generation) and self._end():
                raise EnvTimeoutError(operation="close", timeout_s=timeout, env_id=self.env_id)
            return
        try:
            if not self.serving(generation):
                return
            remaining = max(deadline - time.monotonic(), 0.0)
            try:
                data = self._exchange(
                    self.handle.call.remote(CLOSE_REQUEST), operation="close", timeout=remaining
                )
                reply = self.envs.judged(data)
            finally:
                if not self._reuse:
                    self._end()
        finally:
            self._call_lock.release()
        try:
            self._unpack(reply)
        except BaseException as exc:
            self.envs.failed_to_close(exc)
            raise

    def kill(self) -> None:
        """Kills the actor now, whatever it is doing; safe from any thread, a no-op once it ended."""
        self._end()

    def _end(self) -> bool:
        """Marks the env closed and kills the actor; returns whether this call ended it. A forked copy
        kills nothing: the actor is the parent's (and Ray's client does not work after a fork)."""
        if os.getpid() != self._owner_pid:
            _keep_in_fork(self.handle)
            return False
        with self._state_lock:
            if not self.running:
                return False
            self.running = False
        # no_restart: a killed env actor must never come back (it would hold a fresh, unused env).
        self._ray.kill(self.handle, no_restart=True)
        return True

    def _exchange(self, reply: Any, *, operation: str, timeout: float | None) -> bytes:
        """Waits for ``reply`` (a Ray object ref) within ``timeout``; the caller holds ``_call_lock``."""
        exceptions = self._ray.exceptions
        try:
            data: bytes = self._ray.get(reply, timeout=timeout)
            return data
        except exceptions.GetTimeoutError:
            timed_out, cause = True, None
            ended_here = self._end()
        except exceptions.RayActorError as exc:
            timed_out, cause = False, exc
            ended_here = self._end()
        except BaseException:
            # Interrupted (KeyboardInterrupt) or a failure of Ray itself: the actor's state is unknown;
            # only killing it is safe.
            self._end()
            raise
        finally:
            # The error's traceback keeps this frame: it must not keep the reply's object ref too.
            del reply
        error: EnvError
        if not ended_here:  # close() or kill() from another thread during this call: "you closed it"
            error, cause = EnvClosedError(operation=operation, env_id=self.env_id), None
        elif timed_out:
            timeout_s = timeout if timeout is not None else math.inf
            error = EnvTimeoutError(operation=operation, timeout_s=timeout_s, env_id=self.env_id)
        else:
            self._find_node()
            # Ray's error says why the actor died (killed, its node gone): it is the cause.
            error = EnvWorkerDiedError(
                operation=operation, env_id=self.env_id, actor_id=self.actor_id, node_id=self.node_id
            )
        self.lost = error
        try:
            raise error from cause
        finally:
            del error, cause  # the error's traceback keeps this frame: no cycle through it

    def _find_node(self, wait_s: float = NODE_LOOKUP_S) -> None:
        """Finds the actor's node: from its reply to ``node_id()`` (submitted before anything else), or,
        when it died before it could say, from the GCS, which records where it placed the actor. Waits
        about ``wait_s`` at most in all (the GCS gets at least a second). It stays None for an actor that
        was never placed."""
        if self.node_id is not None or self._where is None:
            return
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(self._ray.exceptions.RayError):
            # Once the actor ran anything (its start), its reply is on its way; once it died, the reply
            # is its death, which arrives at once.
            ready, _ = self._ray.wait([self._where], timeout=wait_s)
            if ready:
                self.node_id = str(self._ray.get(ready[0]))  # raises when it died before it said
        if self.node_id is None:
            self.node_id = _node_from_gcs(self._ray, self.actor_id, max(deadline - time.monotonic(), 1.0))

    def forget(self) -> None:
        """Drops this object's references to the actor (its handle, its reply) once it was killed, so a
        failed start's error, which keeps this object, keeps no Ray reference alive."""
        self.handle = None
        self._where = None

    def _unpack(self, data: bytes) -> Any:
        where = f"the env's Ray actor {self.actor_id} on node {self.node_id}"
        return unpack_reply(data, where=where, env_id=self.env_id)


RayWorkers = WorkerPool[_Actor]
"""A pool of env actors, each serving Ray envs one after another."""


def ray_workers(actor_options: Mapping[str, Any] | None, *, size: int | None, reuse: bool) -> RayWorkers:
    """A pool of at most ``size`` env actors (None: no bound) with ``actor_options``, reused from env to
    env if ``reuse``. Nothing starts before an env needs an actor; the options are checked here, by
    Ray too (no cluster needed), so that options Ray refuses fail the runner's batch before any rollout.

    Raises:
        DependencyNotInstalledError: ray is not installed.
        UnsupportedConfigError: ``actor_options`` asks for restarts, a name or a detached actor, or Ray
            refuses them (an unknown option, a negative resource, a value of the wrong type).
    """
    options = _checked_by_ray(_actor_options(actor_options, None))
    return WorkerPool(functools.partial(_Actor.create, options, reuse=reuse), size=size, reuse=reuse)


class RayEnv(RemoteEnv):
    """A local stand-in for an env that runs in a Ray actor, which a deadline kills.

    ``env_fn`` is called once, in the actor, to build the env; Ray pickles it with cloudpickle, so a
    lambda works (its code must be importable on the cluster's nodes). Its spaces, ``metadata``,
    ``render_mode`` and ``spec`` are copied here when it starts; ``reset``, ``step``, ``render`` and
    ``close`` run there, as do reads of ``np_random``. This object is its own ``unwrapped``.

    A call past its deadline kills the actor and raises :class:`EnvTimeoutError`; an actor that dies, or
    whose node dies, raises :class:`EnvWorkerDiedError` naming the node; either way the env is closed.
    ``close`` closes the env in the actor, then kills the actor, once. An exception raised by the env is
    raised here as itself, with the actor's traceback as a note, or as :class:`UnpicklableEnvError` if
    it cannot be pickled. Calls from several threads are serialized. An env that is dropped without
    ``close`` loses its actor when Ray collects the handle; its env's ``close`` does not run.

    Args:
        env_fn: Zero-argument callable that builds the env.
        actor_options: Options for the actor (``ray.remote(...).options(**actor_options)``): ``num_cpus``,
            ``resources``, ``scheduling_strategy`` (node affinity), ``runtime_env``, ... over
            :data:`DEFAULT_ACTOR_OPTIONS`. ``max_restarts`` and ``max_task_retries`` stay 0.
        step_timeout: Deadline of ``step``, ``render`` and attribute reads, in seconds; None: no limit.
        reset_timeout: Deadline of ``reset``; None: no limit.
        start_timeout: Deadline for the actor to be placed, its worker to start and ``env_fn`` to return;
            None: no limit (an actor the cluster has no room for then waits).
        close_timeout: How long ``close`` waits for the env to close before killing the actor.
        abort: Lets another thread end the start early (see :class:`StartAbort`).
        name: The actor's name in Ray (unique within its namespace), to find it with Ray's tools.
        workers: A pool of actors (:func:`ray_workers`) to take the env's actor from, which serves
            other envs before and after it; None: an actor of its own, killed after the close.

    Raises:
        DependencyNotInstalledError: ray is not installed.
        UnsupportedConfigError: this process is not connected to a Ray cluster, a timeout is not a number
            > 0, or ``actor_options`` asks for restarts or Ray refuses them (its reason in the message).
        EnvTimeoutError: the env did not start within ``start_timeout`` (the actor was killed).
        EnvWorkerDiedError: the actor, or its node, died while starting.
        EnvClosedError: ``abort`` was aborted before the env started (the actor was killed).
        Exception: what ``env_fn`` raised in the actor, as itself.
    """

    _host: Lease[_Actor]

    def __init__(
        self,
        env_fn: EnvFn,
        *,
        actor_options: Mapping[str, Any] | None = None,
        step_timeout: float | None = None,
        reset_timeout: float | None = None,
        start_timeout: float | None = None,
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S,
        abort: StartAbort | None = None,
        name: str | None = None,
        workers: RayWorkers | None = None,
    ) -> None:
        check_seconds("step_timeout", step_timeout)
        check_seconds("reset_timeout", reset_timeout)
        check_seconds("start_timeout", start_timeout)
        check_seconds("close_timeout", close_timeout, allow_none=False)
        if workers is not None and (actor_options is not None or name is not None):
            raise UnsupportedConfigError(
                "the actors of a pool of workers take the pool's options, not the env's",
                option="actor_options" if actor_options is not None else "name",
            )
        pool = workers
        if pool is None:
            options = _checked_by_ray(_actor_options(actor_options, name))
            import_ray()
            pool = WorkerPool(functools.partial(_Actor.create, options, reuse=False), size=None, reuse=False)
        self.step_timeout = step_timeout
        self.reset_timeout = reset_timeout
        self.close_timeout = close_timeout
        taken: list[_Actor] = []

        def open_on(actor: _Actor, timeout: float | None) -> tuple[int, dict[str, Any]]:
            taken.append(actor)
            return actor.open(env_fn, timeout=timeout, abort=abort, close_timeout=close_timeout)

        try:
            self._host, description = lease(pool, open_on, abort, start_timeout)
        except BaseException:
            for actor in taken:
                if not actor.running:
                    # The error keeps this frame and the actor's: neither keeps a reference to the dead actor.
                    actor.forget()
            raise
        finally:
            taken.clear()
        self._actor = self._host.worker
        self._actor.env_id = self._adopt(description)

    @property
    def actor_id(self) -> str:
        """The actor's id (hex)."""
        return self._actor.actor_id

    @property
    def node_id(self) -> str | None:
        """The id (hex) of the node the actor runs on; None only if neither the actor nor Ray's GCS said
        within :data:`NODE_LOOKUP_S`."""
        return self._actor.node_id

    def __repr__(self) -> str:
        return f"<RayEnv{getattr(self, '_name', '')} actor={self.actor_id} node={self.node_id}>"

    __str__ = __repr__
