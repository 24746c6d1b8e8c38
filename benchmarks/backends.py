"""Rollouts/s of each env backend side by side, and a long pooled-process run with env faults.

Part 1, throughput: one ``BatchRunner`` per backend (``ScriptedEngine``, a cheap two-turn
``ScriptableEnv``, ``--in-flight`` rollouts in flight; process and Ray runners keep their warm workers
across rounds), the backends in turn within each round in a rotating order, ``--rounds`` rounds: medians
of rollouts/s and of each round's ratio to threads. First without a Ray cluster (thread, process), then,
unless ``--no-ray``, with a local one-node cluster sharing the cores (thread, process, ray). The cluster
runs inside a loopback-only network namespace (``harness.run.netns``: root).

Part 2, faults: ``--batches`` batches of ``--rollouts`` two-turn rollouts on pooled worker processes,
10% of them faulty (a third each: the env raises, hangs past ``env_step_timeout_s``, or SIGKILLs its
worker). A ledger file counts each env's build and close (from inside the workers); a sampler thread
counts the worker processes alive every 20 ms. Printed per batch: failures, envs built / closed in the
worker / closed more than once, envs whose worker was killed, the most workers seen alive against the pool
size, and this process's RSS.

Run: python benchmarks/backends.py [--rounds 5] [--rollouts-per-round 1000] [--in-flight 32] [--no-ray]
[--rollouts 10000] [--batches 10] [--faults-only]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, SupportsFloat

import psutil  # type: ignore[import-untyped]

from gym_resilience import BatchRunner, RunnerConfig, Task
from gym_resilience.config import EnvBackend
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.testing import ScriptableEnv

FAULT_FRACTION = 0.1
STEP_DEADLINE_S = 0.5


def two_turn_env(task: Task) -> ScriptableEnv:
    return ScriptableEnv()


def tasks_of(count: int, **env_kwargs: Any) -> list[Task]:
    return [
        Task(prompt=[{"role": "user", "content": f"t{i}"}], instance_id=f"t{i}", env_kwargs=env_kwargs)
        for i in range(count)
    ]


# --- part 1: throughput ------------------------------------------------------------------------------


async def rollouts_per_s(runner: BatchRunner, tasks: list[Task]) -> float:
    start = time.perf_counter()
    await runner.generate(tasks)
    return len(tasks) / (time.perf_counter() - start)


async def throughput(backends: tuple[EnvBackend, ...], rounds: int, rollouts: int, in_flight: int) -> None:
    runners = {
        backend: BatchRunner(
            ScriptedEngine(),
            two_turn_env,
            RunnerConfig(env_backend=backend, max_turns=2, max_concurrency=in_flight),
        )
        for backend in backends
    }
    tasks = tasks_of(rollouts)
    samples: dict[EnvBackend, list[float]] = {backend: [] for backend in backends}
    try:
        for runner in runners.values():  # warm-up: workers started, caches filled
            await rollouts_per_s(runner, tasks[: 2 * in_flight])
        for index in range(rounds):
            order = backends[index % len(backends) :] + backends[: index % len(backends)]
            for backend in order:
                samples[backend].append(await rollouts_per_s(runners[backend], tasks))
    finally:
        for runner in runners.values():
            await runner.close()
    print(f"  load average {os.getloadavg()[0]:.1f}; median of {rounds} rounds [range]")
    for backend, values in samples.items():
        ratios = [value / base for value, base in zip(values, samples["thread"], strict=True)]
        ratio = "" if backend == "thread" else f"   {backend}/thread {statistics.median(ratios):.3f}"
        ratio += "" if backend == "thread" else f" [{min(ratios):.3f}-{max(ratios):.3f}]"
        print(
            f"  {backend:<8} {statistics.median(values):8.0f} rollouts/s "
            f"[{min(values):.0f}-{max(values):.0f}]{ratio}"
        )


# --- part 2: faults ----------------------------------------------------------------------------------


class FaultyEnv(ScriptableEnv):
    """Writes ``built <n>`` and ``closed <n>`` lines to the ledger, and misbehaves at its first step as
    its task says: ``raise``, ``hang`` (past the step deadline), ``sigkill`` (its own worker)."""

    def __init__(self, ledger: str, number: str, fault: str) -> None:
        super().__init__()
        self.ledger, self.number, self.fault = ledger, number, fault
        self._note("built")

    def _note(self, what: str) -> None:
        with open(self.ledger, "a", encoding="ascii") as file:
            file.write(f"{what} {self.number}\n")

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        if self.fault == "raise":
            raise ValueError("the env's own failure")
        if self.fault == "hang":
            time.sleep(600)
        if self.fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)

    def close(self) -> None:
        self._note("closed")
        super().close()


def faulty_env(task: Task) -> FaultyEnv:
    kwargs = task.env_kwargs
    return FaultyEnv(kwargs["ledger"], kwargs["number"], kwargs["fault"])


def faulty_tasks(count: int, ledger: str, batch: int, rng: random.Random) -> tuple[list[Task], Counter[str]]:
    faults: Counter[str] = Counter()
    tasks = []
    for i in range(count):
        fault = rng.choice(("raise", "hang", "sigkill")) if rng.random() < FAULT_FRACTION else ""
        faults[fault or "none"] += 1
        kwargs = {"ledger": ledger, "number": f"{batch}-{i}", "fault": fault}
        tasks.append(
            Task(prompt=[{"role": "user", "content": "go"}], instance_id=f"b{batch}t{i}", env_kwargs=kwargs)
        )
    return tasks, faults


def _alive(process: psutil.Process) -> bool:
    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


@contextlib.contextmanager
def worker_sampler() -> Iterator[list[int]]:
    """The most worker processes (the fork server's children) seen alive at once."""
    most = [0]
    stop = threading.Event()
    me = psutil.Process()

    def sample() -> None:
        while not stop.wait(0.02):
            with contextlib.suppress(psutil.Error):
                # The fork server's children: Ray's processes, once a cluster ran, are not workers here.
                servers = [child for child in me.children() if "forkserver" in " ".join(child.cmdline())]
                seen = [worker for server in servers for worker in server.children()]
                # Still there after the scan: a worker reaped while the scan went on is not counted
                # beside the one that replaced it.
                alive = [child for child in seen if _alive(child)]
                most[0] = max(most[0], len(alive))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield most
    finally:
        stop.set()
        thread.join()


async def faults(rollouts: int, batches: int, in_flight: int) -> None:
    config = RunnerConfig(
        env_backend="process",
        skip_failed_rollouts=True,
        max_turns=2,
        max_concurrency=in_flight,
        env_step_timeout_s=STEP_DEADLINE_S,
        close_timeout_s=2.0,
    )
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        async with BatchRunner(ScriptedEngine(), faulty_env, config) as runner:
            for batch in range(batches):
                ledger = str(Path(folder) / f"batch{batch}.ledger")
                tasks, planned = faulty_tasks(rollouts, ledger, batch, rng)
                with worker_sampler() as most:
                    start = time.perf_counter()
                    result = await runner.generate(tasks)
                    wall = time.perf_counter() - start
                lines = Path(ledger).read_text(encoding="ascii").split()  # noqa: ASYNC240 (between batches)
                notes = Counter(zip(lines[::2], lines[1::2], strict=True))
                built = {number for what, number in notes if what == "built"}
                closes = Counter({number: notes[("closed", number)] for number in built})
                closed_once = sum(count == 1 for count in closes.values())
                twice = sum(count > 1 for count in closes.values())
                killed = planned["hang"] + planned["sigkill"]
                pool = runner.env_workers
                rss = psutil.Process().memory_info().rss / 2**20
                print(
                    f"  batch {batch}: {rollouts / wall:6.0f} rollouts/s, failed {len(result.failures)} "
                    f"(planned {rollouts - planned['none']}); envs built {len(built)}, closed in their "
                    f"worker {closed_once}, more than once {twice}, never (worker killed) "
                    f"{len(built) - closed_once} (planned {killed}); workers alive at most {most[0]} "
                    f"(pool size {config.env_pool_size}; started {pool.stats.started if pool else 0}); "
                    f"RSS {rss:.0f} MiB"
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rollouts-per-round", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--no-ray", action="store_true", help="skip the runs with a Ray cluster")
    parser.add_argument("--rollouts", type=int, default=10_000, help="rollouts per faulty batch")
    parser.add_argument("--batches", type=int, default=10, help="faulty batches")
    parser.add_argument("--faults-only", action="store_true", help="part 2 only")
    args = parser.parse_args()
    logging.getLogger("gym_resilience").setLevel(logging.ERROR)  # one warning per failed rollout otherwise
    if not args.faults_only:
        throughputs(args)
    print(
        f"Part 2: {args.batches} batches of {args.rollouts} pooled-process rollouts, "
        f"{FAULT_FRACTION:.0%} faulty (raise, hang past {STEP_DEADLINE_S} s, SIGKILL of the worker)"
    )
    asyncio.run(faults(args.rollouts, args.batches, args.in_flight))


def throughputs(args: argparse.Namespace) -> None:
    print(
        f"Part 1: rollouts/s, {args.rollouts_per_round} two-turn rollouts a round, {args.in_flight} in flight"
    )
    print(" without a Ray cluster")
    asyncio.run(throughput(("thread", "process"), args.rounds, args.rollouts_per_round, args.in_flight))
    if args.no_ray:
        return
    from harness.run.cluster import LocalCluster
    from harness.run.netns import loopback_namespace

    with loopback_namespace(), LocalCluster(1):
        print(" with a one-node Ray cluster sharing the cores")
        backends: tuple[EnvBackend, ...] = ("thread", "process", "ray")
        asyncio.run(throughput(backends, args.rounds, args.rollouts_per_round, args.in_flight))


if __name__ == "__main__":
    main()
