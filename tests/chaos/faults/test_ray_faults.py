"""Ray faults in the chaos harness: the ``cluster`` and ``target: ray`` fields, the node killer, the
probes that read where envs ran, and one scenario run end to end on a real local Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]
import pytest

from gym_resilience import AttemptRecord, UnsupportedConfigError
from gym_resilience.task_gen import generate_tasks, word_game_factory
from harness.faults import FaultPlan, FaultyEnv, NodeKiller, record_span
from harness.judge.compare import compare_outputs
from harness.judge.probes import RunOutcome, Runs, observe
from harness.run.recorder import Recorder
from harness.scenario.loader import check_text
from harness.scenario.spec import RayFault, Targeting

ROOT = Path(__file__).resolve().parents[3]

RAY_RUNNER = "runner: {env_backend: ray, skip_failed_rollouts: true, max_turns: 2, max_tokens: 8}\n"


def problems(text: str) -> list[str]:
    """Every problem of a scenario given as text, as ``FIELD: REASON`` (no file, no line)."""
    checked = check_text("title: t\n" + text, file="s.yaml")
    return [f"{error.field}: {error.reason}" for error in checked.problems]


# --- the schema and its rules -----------------------------------------------------------------------------


def test_a_valid_ray_scenario_compiles_and_its_summary_names_the_cluster() -> None:
    text = (
        "batch: {tasks: 4}\n"
        "cluster: {nodes: 3, cpus_per_node: 2}\n" + RAY_RUNNER + "faults:\n"
        "  - {target: ray, kind: kill_actor, when: {rollouts: [1], turns: [1]}}\n"
        "  - {target: ray, kind: kill_node, after_steps: 3, node: 1}\n"
    )
    checked = check_text("title: t\n" + text, file="s.yaml")
    assert checked.problems == ()
    assert checked.scenario is not None
    assert checked.scenario.spec.cluster is not None
    assert checked.scenario.spec.cluster.worker_nodes == 2
    assert checked.scenario.summary() == (
        "in-process vLLM serving the bundled tiny model; env word_game, 4 tasks; BatchRunner on a 3-node "
        "Ray cluster; 2 faults, 0 probes"
    )


def test_a_ray_fault_without_a_cluster_is_an_error_naming_the_cluster_field() -> None:
    runner = RAY_RUNNER.replace("env_backend: ray, ", "")
    assert problems(runner + "faults: [{target: ray, kind: kill_actor}]\n") == [
        "faults[0].target: a ray fault needs a cluster: declare cluster: {nodes: 2} (a local Ray cluster "
        "the harness starts on loopback for the scenario)",
        "faults[0].target: a ray fault needs runner.env_backend: ray: it hits the Ray actors the envs run "
        "in, and env_backend is 'thread'",
    ]


def test_env_backend_ray_without_a_cluster_is_an_error_at_the_runner_field() -> None:
    assert problems(RAY_RUNNER + "faults: [{target: ray, kind: kill_actor}]\n") == [
        "runner.env_backend: env_backend 'ray' needs a cluster: declare cluster: {nodes: 2} (a local Ray "
        "cluster the harness starts on loopback for the scenario)"
    ]


def test_a_ray_fault_under_a_user_pipeline_is_an_error() -> None:
    text = "cluster: {nodes: 2}\n" + RAY_RUNNER + "pipeline: naive_pipeline:generate\n"
    text += "faults: [{target: ray, kind: kill_actor}]\n"
    checked = check_text("title: t\n" + text, file="s.yaml", folder=ROOT / "scenarios")
    assert [f"{e.field}: {e.reason}" for e in checked.problems] == [
        "faults[0].target: a ray fault needs BatchRunner: it hits the Ray actors BatchRunner runs envs in "
        "(runner.env_backend: ray), and a user pipeline builds its own envs"
    ]


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ("{nodes: 1}", "cluster.nodes: expected an integer > 1 and <= 4, got 1"),
        ("{nodes: 5}", "cluster.nodes: expected an integer > 1 and <= 4, got 5"),
        ("{}", "cluster.nodes: missing required field 'nodes'"),
        ("{nodes: 2, cpus_per_node: 0}", "cluster.cpus_per_node: expected an integer in [1, 64], got 0"),
        (
            "{nodes: 2, gpus: 1}",
            ("cluster.gpus: unknown field 'gpus'; expected one of nodes, cpus_per_node, envs_on_worker"),
        ),
    ],
)
def test_a_cluster_out_of_bounds_is_an_error_at_its_field(cluster: str, expected: str) -> None:
    assert problems(f"cluster: {cluster}\n") == [expected]


def test_kill_node_fields_are_checked_against_the_cluster_and_the_batch() -> None:
    text = "batch: {tasks: 4}\ncluster: {nodes: 3}\n" + RAY_RUNNER + "faults:\n"
    text += "  - {target: ray, kind: kill_node, node: 2, after_steps: 8}\n"
    assert problems(text) == [
        "faults[0].node: worker node 2 does not exist: the cluster has 2 worker nodes (cluster.nodes 3 "
        "counts the head; worker nodes are numbered from 0)",
        "faults[0].after_steps: after_steps 8 never happens: the batch makes at most 8 env steps (4 tasks "
        "x runner.n_samples_per_prompt 1 x runner.max_turns 2)",
    ]


def test_fields_of_the_other_ray_kind_are_errors_and_targeting_is_checked_like_env_faults() -> None:
    text = "batch: {tasks: 4}\ncluster: {nodes: 2}\n" + RAY_RUNNER + "faults:\n"
    text += "  - {target: ray, kind: kill_node, when: {rollouts: [1]}}\n"
    text += "  - {target: ray, kind: kill_actor, node: 0, when: {turns: [2]}}\n"
    assert problems(text) == [
        "faults[0].when: when only goes with kind 'kill_actor', and kind is 'kill_node'",
        "faults[1].node: node only goes with kind 'kill_node', and kind is 'kill_actor'",
        "faults[1].when.turns[0]: turn 2 never happens: runner.max_turns is 2 (turns are numbered from 0)",
    ]


def test_an_unknown_target_or_ray_kind_names_the_choices() -> None:
    assert problems("faults: [{target: rey, kind: kill_actor}]\n") == [
        "faults[0].target: expected one of 'env', 'engine', 'network', 'ray', got 'rey'"
    ]
    assert problems("faults: [{target: ray, kind: kill_pod}]\n") == [
        "faults[0].kind: expected one of 'kill_actor', 'kill_node', got 'kill_pod'"
    ]


def test_envs_on_worker_names_a_worker_node_of_a_ray_backend_that_places_nothing_else() -> None:
    assert problems("cluster: {nodes: 2, envs_on_worker: 1}\n" + RAY_RUNNER) == [
        "cluster.envs_on_worker: worker node 1 does not exist: the cluster has 1 worker node (numbered "
        "from 0)"
    ]
    assert problems("cluster: {nodes: 2, envs_on_worker: 0}\nrunner: {env_backend: process}\n") == [
        "cluster.envs_on_worker: envs_on_worker places env actors, and runner.env_backend is 'process': "
        "set it to 'ray'"
    ]
    runner = "runner: {env_backend: ray, env_actor_options: {scheduling_strategy: SPREAD}}\n"
    assert problems("cluster: {nodes: 3, envs_on_worker: 1}\n" + runner) == [
        "cluster.envs_on_worker: envs_on_worker sets the env actors' scheduling_strategy, and "
        "runner.env_actor_options.scheduling_strategy sets it too: give only one"
    ]


def test_a_hang_in_a_ray_actor_needs_a_step_deadline_but_not_isolate_envs() -> None:
    base = "cluster: {nodes: 2}\nfaults: [{target: env, kind: hang, when: {rollouts: [0]}}]\n"
    assert problems(base + "runner: {env_backend: ray, env_step_timeout_s: 2}\n") == []
    assert problems(base + "runner: {env_backend: ray}\n") == [
        "faults[0].kind: a hang in step needs runner.isolate_envs: true and runner.env_step_timeout_s "
        "set: only a deadline that kills the env's process stops a hung call, and without one the run "
        "would hang"
    ]


# --- injection outside a cluster: the parts that need no Ray ---------------------------------------------


def plan_of(recorder: Recorder, *faults: RayFault) -> FaultPlan:
    return FaultPlan(list(faults), seed=0, events=recorder)


def test_a_kill_actor_fault_outside_a_ray_actor_refuses_instead_of_killing_this_process(
    tmp_path: Path,
) -> None:
    recorder = Recorder(tmp_path)
    plan = plan_of(recorder, RayFault(target="ray", kind="kill_actor", when=Targeting(turns=[0])))
    task = generate_tasks(1, seed=0)[0]
    env = FaultyEnv(word_game_factory(task), plan, rollout=0)
    env.reset(options={"task": task})
    with pytest.raises(UnsupportedConfigError, match=r"faults\[0\]\.kind: a kill_actor fault needs"):
        env.step("e")
    assert recorder.firings() == []


class FakeCluster:
    """Two worker nodes; records removals (the node killer's pure decision logic is what is tested)."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def worker_node_ids(self) -> list[str]:
        return ["node-a", "node-b"]

    def remove_node(self, node_id: str) -> None:
        self.removed.append(node_id)


def log_attempt(spans: Recorder, rollout: int, node: str, *, steps: int, closed: bool = False) -> None:
    now = time.time()
    record_span(
        spans, "reset", rollout=rollout, attempt=0, turn=None, started=now, ended=now, failed=False, node=node
    )
    for turn in range(steps):
        record_span(
            spans, "step", rollout=rollout, attempt=0, turn=turn, started=now, ended=now, failed=False
        )
    if closed:
        record_span(
            spans, "close", rollout=rollout, attempt=0, turn=None, started=now, ended=now, failed=False
        )


def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def test_the_node_killer_waits_for_its_steps_then_removes_the_node_hosting_most_open_envs_once(
    tmp_path: Path,
) -> None:
    spans = Recorder(tmp_path)
    plan = plan_of(spans, RayFault(target="ray", kind="kill_node", after_steps=3))
    cluster = FakeCluster()
    with NodeKiller(plan, spans, cluster, poll_s=0.01):
        log_attempt(spans, 0, "node-a", steps=1)
        log_attempt(spans, 1, "node-b", steps=1)
        time.sleep(0.1)
        assert cluster.removed == []  # 2 steps of 3
        log_attempt(spans, 2, "node-a", steps=0, closed=True)  # closed: no longer hosted
        log_attempt(spans, 3, "node-b", steps=1)
        wait_for(lambda: cluster.removed)
        log_attempt(spans, 4, "node-b", steps=5)
        time.sleep(0.1)
    assert cluster.removed == ["node-b"]
    [firing] = spans.firings()
    assert (firing.target, firing.kind, firing.rollout) == ("ray", "kill_node", None)
    assert firing.detail == "removed worker node 1 (node-b), hosting 2 env actors, after 3 env steps"


class UnremovableCluster(FakeCluster):
    def remove_node(self, node_id: str) -> None:
        raise RuntimeError(f"cannot remove {node_id}")


def test_a_node_killer_whose_removal_fails_raises_that_error_when_its_block_is_left(tmp_path: Path) -> None:
    spans = Recorder(tmp_path)
    plan = plan_of(spans, RayFault(target="ray", kind="kill_node", node=0))
    killer = NodeKiller(plan, spans, UnremovableCluster(), poll_s=0.01)
    with pytest.raises(RuntimeError, match="cannot remove node-a"), killer:
        wait_for(lambda: killer.error is not None)
    assert spans.firings() == []


def test_the_node_probes_count_retries_that_moved_and_the_nodes_used() -> None:
    attempts = [
        AttemptRecord(rollout, attempt, node, "close", 0.1, None)
        for rollout, attempt, node in [
            (0, 0, "a"),
            (0, 1, "b"),
            (1, 0, "a"),
            (1, 1, "a"),
            (2, 0, None),
            (2, 1, "c"),
        ]
    ]
    faulted = RunOutcome(None, None, {}, None, 1.0, attempts=attempts, actors_alive=1)
    baseline = RunOutcome(None, None, {}, None, 1.0, actors_alive=0)
    runs = Runs(baseline, faulted, compare_outputs(None, None), 3, False, None)
    observed = observe(runs)
    # Rollout 0 moved from a to b; rollout 1 stayed; rollout 2's first attempt was never placed on a node.
    assert (observed["retries_moved_node"], observed["nodes_used"], observed["actors_left_alive"]) == (
        1,
        3,
        1,
    )


# --- real runs -------------------------------------------------------------------------------------------

SCENARIO = ROOT / "scenarios" / "25_ray_actor_killed_mid_step.yaml"


def chaos_run(tmp_path: Path, *prefix: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``gym-resilience chaos run`` of the kill_actor scenario in a subprocess (``prefix`` wraps it)."""
    journal = tmp_path / "journal.json"
    command = [*prefix, sys.executable, "-m", "harness.cli", "chaos", "run", str(SCENARIO)]
    command += ["--out", str(tmp_path), "--journal", str(journal)]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    return completed, json.loads(journal.read_text())


@pytest.mark.slow
def test_a_cluster_scenario_where_no_namespace_can_be_entered_fails_saying_why(tmp_path: Path) -> None:
    # Without CAP_SYS_ADMIN no network namespace can be created: the scenario is an error, not a skip.
    completed, journal = chaos_run(tmp_path, "setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin")
    assert completed.returncode == 1, completed.stderr
    assert "cannot run scenarios that declare a cluster: unshare failed: Operation not permitted" in (
        completed.stderr
    )
    [result] = journal["scenarios"]
    assert result["status"] == "error"
    assert result["message"].startswith(
        "ClusterUnavailableError: the scenario declares a cluster, and the harness starts Ray clusters only "
        "inside a loopback-only network namespace"
    )


@pytest.mark.slow
def test_the_pytest_plugin_runs_a_kill_actor_scenario_on_a_real_cluster_and_leaves_no_process() -> None:
    # Every process the run starts (Ray's nodes and workers too) inherits this marker in its environment.
    marker = uuid.uuid4().hex
    command = [sys.executable, "-m", "pytest", str(SCENARIO), "-q", "-p", "no:cacheprovider"]
    environment = {**os.environ, "GYM_RESILIENCE_TEST_RUN": marker}
    completed = subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600, check=False
    )
    assert completed.returncode == 0, completed.stdout[-3000:]
    assert "1 passed" in completed.stdout
    assert processes_marked(marker) == []


def processes_marked(marker: str) -> list[str]:
    """The processes still running whose environment carries ``GYM_RESILIENCE_TEST_RUN=marker``."""
    found = []
    for process in psutil.process_iter(["pid", "name", "environ"]):
        environ = process.info["environ"] or {}
        if environ.get("GYM_RESILIENCE_TEST_RUN") == marker:
            found.append(f"{process.info['pid']} {process.info['name']}")
    return found
