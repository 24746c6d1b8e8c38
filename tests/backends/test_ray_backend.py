"""The Ray env backend on a real 3-node Ray cluster (``ray_cluster``): one env in a real actor, real kills,
the cluster on loopback, the configuration, forked children, where an actor ran (batches:
``test_ray_batches.py``).

Ray's GCS records every actor's end, so each test checks that the actors it made are dead afterwards
(Ray applies a kill asynchronously: the check waits for it, within a generous bound).
"""

from __future__ import annotations

import functools
import gc
import ipaddress
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import psutil
import pytest
import ray
from doubles import HANG_S, SandboxError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray_helpers import GIVE_UP_S, HOST, assert_dead, assert_no_env_actor_alive, raise_value_error, wait_until

from gym_resilience import (
    DependencyNotInstalledError,
    EnvClosedError,
    EnvStepError,
    EnvTimeoutError,
    EnvWorkerDiedError,
    ResilientEnv,
    RetryPolicy,
    RunnerConfig,
    UnpicklableEnvError,
    UnsupportedConfigError,
)
from gym_resilience.backends.protocol import StartAbort
from gym_resilience.backends.ray import RayEnv, _Actor
from gym_resilience.retry import is_transient
from gym_resilience.testing import ScriptableEnv
from harness.run.cluster import LocalCluster
from harness.run.netns import in_loopback_namespace

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def record_close(path: str, env: ScriptableEnv) -> None:
    with open(path, "a", encoding="utf-8") as file:
        file.write("closed\n")


def sleep_forever() -> gymnasium.Env[Any, Any]:
    time.sleep(10**6)
    raise AssertionError("unreachable")


# ScriptableEnv behaviours: module-level, since an actor unpickles them by reference (from this module).
def hang(*_args: Any) -> Any:
    """Never returns (in practice): a stuck tool call, a deadlocked simulator."""
    time.sleep(HANG_S)


def raise_unpicklable(env: ScriptableEnv, action: Any) -> Any:
    raise SandboxError("container 3f2a is gone")


def raise_in_factory() -> gymnasium.Env[Any, Any]:
    raise LookupError("no such sandbox image")


def hang_in_reset(env: ScriptableEnv, seed: int | None, options: Any) -> Any:
    return hang()


# --- one env in an actor ---------------------------------------------------------------------------------


def test_a_ray_env_runs_a_real_gymnasium_env_in_an_actor_on_a_node_of_the_cluster(
    ray_cluster: LocalCluster,
) -> None:
    env = RayEnv(functools.partial(gymnasium.make, "CartPole-v1"))
    try:
        local = gymnasium.make("CartPole-v1")
        assert env.node_id in {ray_cluster.head_node_id, *ray_cluster.worker_node_ids()}
        assert (env.observation_space, env.action_space, env.spec) == (
            local.observation_space,
            local.action_space,
            local.spec,
        )
        observation, _ = env.reset(seed=3)
        assert observation.tolist() == local.reset(seed=3)[0].tolist()
        assert env.step(1)[1:3] == local.step(1)[1:3]
        assert env.unwrapped is env
        assert repr(env).endswith(f"actor={env.actor_id} node={env.node_id}>")
    finally:
        env.close()
    assert env.closed and env.lost is None
    assert_dead(ray_cluster, env.actor_id)


def test_close_closes_the_env_once_then_kills_its_actor(ray_cluster: LocalCluster, tmp_path: Path) -> None:
    marker = tmp_path / "closes"
    env = RayEnv(functools.partial(ScriptableEnv, close=functools.partial(record_close, str(marker))))
    env.reset()
    env.close()
    env.close()
    assert marker.read_text() == "closed\n"
    assert_dead(ray_cluster, env.actor_id)
    with pytest.raises(EnvClosedError, match=r"^cannot step: the env is closed$"):
        env.step("after close")


@pytest.mark.parametrize(
    ("behaviour", "raised"), [(raise_value_error, ValueError), (raise_unpicklable, UnpicklableEnvError)]
)
def test_the_envs_own_exception_reaches_resilient_env_as_itself_and_the_actor_is_killed(
    ray_cluster: LocalCluster, behaviour: Any, raised: type[Exception]
) -> None:
    inner = RayEnv(functools.partial(ScriptableEnv, step=behaviour))
    env = ResilientEnv(inner)
    env.reset()
    with pytest.raises(EnvStepError) as caught:
        env.step("e4")
    cause = caught.value.__cause__
    assert type(cause) is raised
    assert f"raised in the env's Ray actor {inner.actor_id} on node {inner.node_id}:" in cause.__notes__[0]
    assert env.closed and inner.closed and inner.lost is None
    assert_dead(ray_cluster, inner.actor_id)


def test_what_the_factory_raises_is_raised_as_itself_and_leaves_no_actor(ray_cluster: LocalCluster) -> None:
    before = {record.actor_id for record in ray_cluster.actors(HOST)}
    with pytest.raises(LookupError) as caught:
        RayEnv(raise_in_factory)
    assert str(caught.value) == "no such sandbox image"
    made = {record.actor_id for record in ray_cluster.actors(HOST)} - before
    assert len(made) == 1
    assert_dead(ray_cluster, *made)


@pytest.mark.parametrize("operation", ["start", "reset", "step"])
def test_a_call_past_its_deadline_kills_the_actor_and_raises_env_timeout_error(
    ray_cluster: LocalCluster, operation: str
) -> None:
    deadlines = {"start": "start_timeout", "reset": "reset_timeout", "step": "step_timeout"}
    env_fn: Callable[[], gymnasium.Env[Any, Any]] = {
        "start": sleep_forever,
        "reset": functools.partial(ScriptableEnv, reset=hang_in_reset),
        "step": functools.partial(ScriptableEnv, step=hang),
    }[operation]
    before = {record.actor_id for record in ray_cluster.actors(HOST)}
    with pytest.raises(EnvTimeoutError) as caught:
        env = RayEnv(env_fn, **{deadlines[operation]: 1.0})
        env.reset()
        env.step("x")
    assert str(caught.value) == f"env {operation} exceeded its 1 s deadline"
    made = {record.actor_id for record in ray_cluster.actors(HOST)} - before
    assert len(made) == 1
    assert_dead(ray_cluster, *made)


def test_an_actor_killed_from_outside_raises_env_worker_died_error_naming_its_node(
    ray_cluster: LocalCluster,
) -> None:
    env = RayEnv(ScriptableEnv, name="gym-resilience-test-victim")
    env.reset()
    (victim,) = [record for record in ray_cluster.actors(HOST) if record.actor_id == env.actor_id]
    assert victim.pid > 0
    ray.kill(ray.get_actor("gym-resilience-test-victim"))
    # ray.kill only asks, and the GCS marks the actor dead before its process has exited: a step that
    # reaches the process meanwhile succeeds. Once the process is gone, none can.
    assert_dead(ray_cluster, env.actor_id)
    wait_until(lambda: process_gone(victim.pid), f"the actor's process {victim.pid} gone")
    with pytest.raises(EnvWorkerDiedError) as caught:
        env.step("x")
    error = caught.value
    assert (error.operation, error.actor_id, error.node_id, error.exitcode) == (
        "step",
        env.actor_id,
        env.node_id,
        None,
    )
    assert str(error).startswith(f"env actor {env.actor_id} on node {env.node_id} died during step: ")
    assert isinstance(error.__cause__, ray.exceptions.RayActorError)
    assert env.lost is error and env.closed
    # Transient exactly as a dead worker process is (not by default), and retried when asked.
    assert not is_transient(error) and not is_transient(EnvWorkerDiedError(operation="step", exitcode=-9))
    assert RetryPolicy(retry_on=(EnvWorkerDiedError,)).is_retryable(error)
    restored = pickle.loads(pickle.dumps(error))
    assert (restored.node_id, restored.actor_id, str(restored)) == (error.node_id, error.actor_id, str(error))
    env.close()  # lost: nothing to close, nothing raised


def test_an_abort_kills_an_env_still_starting(ray_cluster: LocalCluster) -> None:
    before = {record.actor_id for record in ray_cluster.actors(HOST)}
    abort = StartAbort()
    timer = threading.Timer(1.0, abort.abort)
    timer.start()
    try:
        with pytest.raises(EnvClosedError, match=r"^cannot start: the env is closed$"):
            RayEnv(sleep_forever, abort=abort)
    finally:
        timer.cancel()
    made = {record.actor_id for record in ray_cluster.actors(HOST)} - before
    assert len(made) == 1
    assert_dead(ray_cluster, *made)


def test_node_affinity_in_actor_options_pins_each_env_to_its_node(ray_cluster: LocalCluster) -> None:
    envs = [
        RayEnv(
            ScriptableEnv,
            actor_options={"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)},
        )
        for node_id in ray_cluster.worker_node_ids()
    ]
    for env in envs:
        env.close()
    assert [env.node_id for env in envs] == ray_cluster.worker_node_ids()


# --- the cluster stays on loopback -----------------------------------------------------------------------


def test_every_socket_the_cluster_listens_on_is_loopback_inside_a_namespace_with_only_lo(
    ray_cluster: LocalCluster,
) -> None:
    assert in_loopback_namespace()
    addresses = ray_cluster.listening_addresses()
    assert addresses  # the GCS and the raylets at least
    for ip, _ in addresses:
        address = ipaddress.ip_address(ip)
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        assert (mapped or address).is_loopback, ip
    ours = os.stat("/proc/thread-self/ns/net").st_ino
    assert {os.stat(f"/proc/{p.pid}/ns/net").st_ino for p in ray_cluster.processes()} == {ours}


# --- configuration ---------------------------------------------------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_ray_env_in_a_process_not_connected_to_ray_says_to_call_ray_init() -> None:
    result = run_python("from gym_resilience.backends.ray import RayEnv; RayEnv(dict)")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "gym_resilience.errors.UnsupportedConfigError: env_backend: Ray envs run on the Ray cluster this "
        "process is connected to, and it is connected to none: call ray.init(address=...) first "
        "(gym_resilience never starts a cluster)"
    )


def test_a_runner_on_the_ray_backend_without_ray_installed_names_the_extra_that_installs_it() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from gym_resilience import BatchRunner, RunnerConfig\n"
        "from gym_resilience.engines.scripted import ScriptedEngine\n"
        "config = RunnerConfig(env_backend='ray')  # data: it needs no ray\n"
        "BatchRunner(ScriptedEngine(), dict, config)"
    )
    result = run_python(code)
    assert result.stderr.strip().splitlines()[-1] == (
        "gym_resilience.errors.DependencyNotInstalledError: ray is not installed; install it with: "
        "pip install 'gym-resilience[ray]'"
    )
    assert issubclass(DependencyNotInstalledError, ImportError)


def test_isolate_envs_is_the_process_backend_and_conflicts_with_ray() -> None:
    assert RunnerConfig(isolate_envs=True).env_backend == "process"
    with pytest.raises(UnsupportedConfigError, match=r"^isolate_envs: isolate_envs=True means env_backend="):
        RunnerConfig(isolate_envs=True, env_backend="ray")


def test_env_deadlines_are_accepted_with_the_ray_backend_and_refused_with_threads() -> None:
    assert RunnerConfig(env_backend="ray", env_step_timeout_s=1.0).env_step_timeout_s == 1.0
    with pytest.raises(
        UnsupportedConfigError, match=r"^env_step_timeout_s: needs env_backend='process' or 'ray'"
    ):
        RunnerConfig(env_step_timeout_s=1.0)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"env_backend": "gpu"}, "runner.env_backend: expected one of 'thread', 'process', 'ray', got 'gpu'"),
        (
            {"env_actor_options": {"num_cpus": 1}},
            "runner.env_actor_options: needs env_backend='ray' (actor options place Ray actors), "
            "got 'thread'",
        ),
        (
            {"env_backend": "ray", "env_actor_options": {"max_restarts": 2}},
            "runner.env_actor_options: max_restarts must be 0: an env's state dies with its actor, so a "
            "restarted actor would continue an episode on a fresh env, got 2",
        ),
        (
            {"env_backend": "ray", "env_actor_options": [1]},
            "runner.env_actor_options: expected a mapping or null, got a list",
        ),
        (
            {"env_backend": "ray", "env_actor_options": {"name": "env"}},
            "runner.env_actor_options: name cannot be set: each env has an actor of its own, ended with "
            "its env; one name would be every env's (RayEnv takes a name of its own), got 'env'",
        ),
        (
            {"env_backend": "ray", "env_actor_options": {"get_if_exists": True}},
            "runner.env_actor_options: get_if_exists cannot be set: each env has an actor of its own, "
            "ended with its env; it would hand several envs one actor, got True",
        ),
        (
            {"env_backend": "ray", "env_actor_options": {"lifetime": "detached"}},
            "runner.env_actor_options: lifetime cannot be set: each env has an actor of its own, ended "
            "with its env; a detached actor would outlive the program that closes it, got 'detached'",
        ),
    ],
)
def test_from_mapping_checks_the_env_backend_and_its_actor_options(
    mapping: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedConfigError) as caught:
        RunnerConfig.from_mapping(mapping)
    assert str(caught.value) == message


def test_from_mapping_reads_the_ray_backend_and_its_actor_options() -> None:
    config = RunnerConfig.from_mapping({"env_backend": "ray", "env_actor_options": {"num_cpus": 0.5}})
    assert (config.env_backend, config.env_actor_options) == ("ray", {"num_cpus": 0.5})


def test_a_forked_child_that_drops_a_ray_env_leaves_the_parents_actor_serving(
    ray_cluster: LocalCluster,
) -> None:
    """The child's close is a no-op and its handle is kept: Ray would take the child's release for the
    parent's and end the actor (and a Ray call from a forked child never returns)."""
    env = ResilientEnv(RayEnv(ScriptableEnv))
    env.reset()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it ends here
        try:
            del env
            gc.collect()  # ResilientEnv's finalizer closes the RayEnv
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    env.step("still served")
    actor_id = env.unwrapped.actor_id  # type: ignore[attr-defined]
    env.close()
    assert_dead(ray_cluster, actor_id)


def waited_child(pid: int, limit_s: float = GIVE_UP_S) -> int:
    """The exit code of forked child ``pid``; a child still running after ``limit_s`` is killed (-9)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9


def within(seconds: float, call: Callable[[], Any]) -> bool:
    """Whether ``call()`` returned within ``seconds``: in a thread, since a Ray client call that hangs
    does so in native code, where no signal (pytest-timeout's included) reaches it."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_a_forked_child_collecting_an_env_that_failed_to_start_leaves_the_parents_ray_client_working(
    ray_cluster: LocalCluster,
) -> None:
    """A failed start's error is a reference cycle, freed by the garbage collector: in a forked child it
    once dropped the dead actor's handle there, and Ray's client in the child wrote into the connection
    it shares with the parent, whose next request to the GCS never returned."""
    before = {record.actor_id for record in ray_cluster.actors(HOST)}
    abort = StartAbort()
    timer = threading.Timer(1.0, abort.abort)
    gc.disable()  # the failed start stays garbage until the child collects it
    try:
        timer.start()
        with pytest.raises(EnvClosedError):
            RayEnv(sleep_forever, abort=abort)
        assert_dead(ray_cluster, *({record.actor_id for record in ray_cluster.actors(HOST)} - before))
        alive = RayEnv(ScriptableEnv)  # and one the parent still uses
        pid = os.fork()
        if pid == 0:  # the child: whatever happens, it ends here
            try:
                gc.collect()
            finally:
                os._exit(0)
        assert waited_child(pid) == 0
    finally:
        timer.cancel()
        gc.enable()
    assert within(GIVE_UP_S, ray_cluster.actors), "the parent's request to the GCS never returned"
    alive.reset()
    alive.close()
    assert_no_env_actor_alive(ray_cluster)


def test_a_failed_start_leaves_no_reference_to_its_actor_in_its_error(ray_cluster: LocalCluster) -> None:
    before = {record.actor_id for record in ray_cluster.actors(HOST)}
    gc.collect()
    with pytest.raises(EnvTimeoutError) as caught:
        RayEnv(sleep_forever, start_timeout=1.0)
    (made,) = {record.actor_id for record in ray_cluster.actors(HOST)} - before
    # The error keeps the frames it went through: none holds the actor's handle or an object ref.
    frames, traceback = [], caught.value.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    held = [
        (frame.f_code.co_name, name)
        for frame in frames
        for name, value in frame.f_locals.items()
        if isinstance(value, ray.actor.ActorHandle | ray.ObjectRef)
    ]
    assert held == []
    handles = [o for o in gc.get_objects() if isinstance(o, ray.actor.ActorHandle)]
    assert made not in {handle._actor_id.hex() for handle in handles}
    assert_dead(ray_cluster, made)


def test_a_forked_child_holds_every_env_actors_handle_from_the_moment_it_starts() -> None:
    """No Ray needed: the fork hook holds the handles of every ``_Actor`` not yet collected."""
    from types import SimpleNamespace

    from gym_resilience.backends import ray as ray_env

    handle, where = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "a1")), object()
    actor = ray_env._Actor(None, handle, where, reuse=False)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            kept = any(item == (handle, where) for item in ray_env._HANDLES_KEPT_IN_FORKS)
            os.write(write, b"kept" if kept else b"lost")
        finally:
            os._exit(0)
    os.close(write)
    assert waited_child(pid) == 0
    assert os.read(read, 16) == b"kept"
    os.close(read)
    assert (handle, where) not in ray_env._HANDLES_KEPT_IN_FORKS  # the parent's are its own to drop
    del actor


# --- where an actor ran -----------------------------------------------------------------------------------


@ray.remote
def fails() -> None:
    raise ValueError("no answer")


def test_an_actors_node_comes_from_the_gcs_when_the_actor_never_said_alive_or_dead(
    ray_cluster: LocalCluster,
) -> None:
    from gym_resilience.backends.ray_host import host_class

    node = ray_cluster.worker_node_ids()[0]
    handle = (
        host_class()
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote()
    )
    assert ray.get(handle.node_id.remote(), timeout=GIVE_UP_S) == node  # placed and running
    # As an actor whose answer to node_id() never came (it died first): the GCS says where it went.
    actor = _Actor(ray, handle, fails.remote(), reuse=False)
    actor._find_node()
    assert actor.node_id == node
    actor.kill()
    assert_dead(ray_cluster, actor.actor_id)
    dead = _Actor(ray, handle, fails.remote(), reuse=False)
    dead._find_node()
    assert dead.node_id == node


def test_an_actor_that_was_never_placed_has_no_node_and_the_lookup_is_bounded(
    ray_cluster: LocalCluster,
) -> None:
    from gym_resilience.backends.ray_host import host_class

    handle = host_class().options(num_cpus=0, resources={"no_such_resource": 1}).remote()
    actor = _Actor(ray, handle, handle.node_id.remote(), reuse=False)
    start = time.monotonic()
    actor._find_node(wait_s=1.0)
    assert actor.node_id is None
    assert time.monotonic() - start < 10.0
    actor.kill()
    assert_dead(ray_cluster, actor.actor_id)


def test_a_gcs_that_does_not_answer_leaves_the_node_unknown_within_the_bound() -> None:
    from types import SimpleNamespace

    from gym_resilience.backends.ray import _node_from_gcs

    node = "ab" * 28

    def gcs(answer: Callable[[str], Any]) -> Any:
        return SimpleNamespace(_private=SimpleNamespace(state=SimpleNamespace(actors=answer)))

    def stuck(actor_id: str) -> dict[str, Any]:
        time.sleep(30)
        return {"Address": {"NodeID": node, "Port": 4321}}

    start = time.monotonic()
    assert _node_from_gcs(gcs(stuck), "a1", timeout=0.5) is None
    assert time.monotonic() - start < 5.0
    placed = {"Address": {"NodeID": node, "Port": 4321}}
    assert _node_from_gcs(gcs(lambda actor_id: placed), "a1", 5.0) == node
    # No worker leased yet (no port: the node is where the request waits), a nil node, no record at all.
    for address in ({"NodeID": node, "Port": 0}, {"NodeID": "f" * 56, "Port": 1}, {"NodeID": "", "Port": 1}):
        assert _node_from_gcs(gcs(lambda actor_id, a=address: {"Address": a}), "a1", 5.0) is None
    assert _node_from_gcs(gcs(lambda actor_id: {}), "a1", 5.0) is None


def test_whether_an_actor_died_of_its_host_is_read_from_the_gcs_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from gym_resilience.backends import ray as ray_backend

    node = "ab" * 28
    monkeypatch.setattr(ray_backend, "NODE_LOOKUP_S", 0.5)

    def actor(nodes: Callable[[], Any], node_id: str | None = node) -> Any:
        handle = SimpleNamespace(_actor_id=bytes.fromhex("cd" * 16))
        found = _Actor(SimpleNamespace(nodes=nodes), handle, None, reuse=True)
        found.node_id = node_id
        return found

    def stuck() -> list[dict[str, Any]]:
        time.sleep(30)
        return [{"NodeID": node, "Alive": False}]

    def refuses() -> list[dict[str, Any]]:
        raise ConnectionError("the GCS is gone")

    assert actor(lambda: [{"NodeID": node, "Alive": False}]).host_lost()
    assert not actor(
        lambda: [{"NodeID": node, "Alive": True}, {"NodeID": "ef" * 28, "Alive": False}]
    ).host_lost()
    # Dead with no node found: never placed anywhere (its node lost while it waited), it ran nothing.
    never_placed = actor(lambda: [], node_id=None)
    assert not never_placed.host_lost()  # alive: nothing to tell yet
    never_placed.running = False
    assert never_placed.host_lost()
    assert not actor(refuses).host_lost()
    start = time.monotonic()
    assert not actor(stuck).host_lost()
    assert time.monotonic() - start < 5.0
