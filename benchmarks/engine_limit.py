"""How close ``BatchRunner`` gets to vLLM's own limit, and what engine start and shutdown cost.

Every engine runs in this one process on the bundled tiny model (float32, as gym_resilience runs it):
vLLM's offline ``LLM.generate`` (the limit: no asyncio, no runner), ``InProcessVLLMEngine`` (the same
engine stepped by a thread) and ``VLLMEngine`` (vLLM's async engine, its core in a child process).
Each round runs every variant nine times, each time right beside a run of the limit (the first row),
alternating which goes first and rotating the variants' order. A round's ratio is the median of its
nine pairs' ratios (a burst of load from elsewhere skews one pair, not the round); beside it, the ratio
of the fastest of those nine runs to the fastest of their nine limit runs (load from elsewhere only
ever adds time). The figures are the medians and ranges of those over the rounds, because these
machines are noisy. The load average is printed with each round.

Every side sends the same requests: the runner's prompt ids, each with the sampling its rollout asks
for (``RunnerConfig.sampling``: greedy, seeded ``seed + rollout index``).

(a) Single turn: 64 tasks x 64 tokens, greedy. Offline: ``LLM.generate`` on the same prompt ids.
    ``gather``: the prompt ids fanned straight into the engine, to tell the runner's cost from the engine's;
    ``eager``: the async engine with ``enforce_eager=True`` (no torch.compile: a faster start). One
    in-process engine runs per process (vLLM keeps its parallel state per process), so the eager one
    is the async engine. The noise floor: a second ``LLM.generate`` run beside the first, and two
    identical ``gather``s on the in-process engine. Then the time split of single batches of the runner
    and of ``gather`` on the in-process engine (extra runs, not in the ratios): until the last request
    went in, from there until the last result came back, and after it (the runner: last env steps,
    closes and the batch's output).
(b) Three turns with a 20 ms env step (64 tasks x 32 tokens a turn), every runner with its default
    settings. The limit is the turn-synchronous loop: the offline engine generating the same per-turn
    inputs (read off the runner's own trajectories), one batch per turn, plus one 20 ms env step per
    turn (every env stepping at once, and nothing else: no loop could step them faster). Beside it,
    ``env_threads=16`` (the former default, which stepped 64 envs in four waves), ``turn_wait_s=0``
    (no turn line: each next prompt sent as its step ends) and the noise floor (a second
    turn-synchronous run). Then the time split of the runner's batch on the in-process engine
    (extra runs, not in the ratios): how long the engine was generating, how long only env steps ran,
    and how long neither did (the runner's own work and its hand-overs), beside the limit's split, and
    what a runner that overlaps some rollouts' env steps with the others' generation would have to cut
    to pass 1.0.
(c) Start and shutdown of each engine configuration, after vLLM and its engine modules are imported
    (timed once, printed on its own: every process pays it once; the async engine's core process pays
    it again at each start). Rounds rotate the order; the in-process engines are itemised from vLLM's
    own log lines.

Intra-op threads: every side steps with the same count (``--threads``, default 1; 0 leaves torch's
default). Set per thread for the in-process sides, through OMP_NUM_THREADS for the async engine's child.

Run: python benchmarks/engine_limit.py [--rounds N] [--threads N] [--startup-rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium
from gymnasium import spaces

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_split import SPANS, TimedEngine, edges, print_single_split, print_split, split

from gym_resilience import BatchRunner, RunnerConfig, Task
from gym_resilience.cache import cache_dir
from gym_resilience.engines import Sampling
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_args import VLLMArgs, set_vllm_environment
from gym_resilience.engines.vllm_common import sampling_params, tokens_prompt
from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine
from gym_resilience.models import build_tiny_model
from gym_resilience.rollout import ChatCodec
from gym_resilience.trajectories import Trajectory

TASKS = 64
SINGLE_TOKENS = 64
TURN_TOKENS = 32
TURNS = 3
STEP_S = 0.02
REPEATS = 9  # pairs (variant beside a limit run) per variant per round; the round keeps their medians


class SleepyEnv(gymnasium.Env[list[dict[str, str]], str]):
    """A text env whose step takes ``step_s`` (a tool call); constant reward, never terminates."""

    observation_space = spaces.Text(256)  # type: ignore[assignment]
    action_space = spaces.Text(256)

    def __init__(self, task: Task) -> None:
        self.task = task
        self.step_s: float = task.env_kwargs.get("step_s", 0.0)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return list(self.task.prompt), {}

    def step(self, action: str) -> Any:
        if self.step_s:
            time.sleep(self.step_s)
        return [{"role": "user", "content": "go on"}], 1.0, False, False, {}


class TimedSleepyEnv(SleepyEnv):
    """``SleepyEnv``, its steps noted in ``SPANS`` (the time split's runs only)."""

    def step(self, action: str) -> Any:
        began = SPANS.now()
        try:
            return super().step(action)
        finally:
            SPANS.stepping.append((began, SPANS.now()))


def make_tasks(n: int, step_s: float) -> list[Task]:
    return [
        Task(
            prompt=[{"role": "user", "content": f"task {i}: say something"}],
            instance_id=f"task-{i}",
            env_kwargs={"step_s": step_s},
        )
        for i in range(n)
    ]


def turn_inputs(trajectories: Sequence[Any]) -> list[list[list[int]]]:
    """Per turn, the input ids each rollout generated from: prompt plus everything before that turn."""
    turns: list[list[list[int]]] = []
    for trajectory in trajectories:
        assert isinstance(trajectory, Trajectory)
        mask, turn = trajectory.loss_mask, 0
        for i, bit in enumerate(mask):
            if bit and (i == 0 or not mask[i - 1]):
                if len(turns) <= turn:
                    turns.append([])
                turns[turn].append(trajectory.prompt_ids + trajectory.response_ids[:i])
                turn += 1
    return turns


def generated(result: Any) -> int:
    return sum(sum(mask) for mask in result.output.loss_masks)


@contextmanager
def omp_threads(threads: int) -> Iterator[None]:
    """OMP_NUM_THREADS for a child process started inside the block (0: leave it alone)."""
    if not threads:
        yield
        return
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


class Offline:
    """vLLM's offline engine on the same arguments as gym_resilience's engines."""

    def __init__(self, model_dir: Path, threads: int, **extra: Any) -> None:
        from vllm import LLM

        arguments = VLLMArgs(model_dir, extra=extra).to_vllm(on_cpu=True)
        arguments.pop("enable_log_requests", None)
        self.llm = LLM(**arguments)
        self.threads = threads

    def generate(self, prompts: Sequence[list[int]], samplings: Sequence[Sampling]) -> int:
        """Tokens generated from ``prompts``, each with its sampling (the runner's, seed and all), as
        vLLM's parameters and prompts are built for the engines' requests."""
        import torch

        if self.threads:
            torch._C.set_num_threads(self.threads)  # this thread only; vLLM patches torch.set_num_threads
        outputs = self.llm.generate(
            [tokens_prompt(p) for p in prompts], [sampling_params(s) for s in samplings], use_tqdm=False
        )
        return sum(len(output.outputs[0].token_ids) for output in outputs)

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def load() -> str:
    return "/".join(f"{value:.1f}" for value in os.getloadavg())


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):>7.0f} [{min(values):.0f}-{max(values):.0f}]"


def seconds(values: list[float]) -> str:
    return f"{statistics.median(values):5.1f} [{min(values):.1f}-{max(values):.1f}]"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


async def measure(run: Callable[[], Awaitable[tuple[int, float]]]) -> float:
    gc.collect()
    tokens, seconds = await run()
    return tokens / seconds


async def throughput(model_dir: Path, rounds: int, threads: int) -> None:
    print(f"starting engines (load {load()})", flush=True)
    async_engine = VLLMEngine(model_dir)
    eager_engine = VLLMEngine(model_dir, enforce_eager=True)
    with omp_threads(threads):
        await async_engine.start()
        await eager_engine.start()
    thread_engine = InProcessVLLMEngine(model_dir, cpu_threads=threads or None)
    await thread_engine.start()
    offline = Offline(model_dir, threads)
    try:
        await compare(async_engine, thread_engine, eager_engine, offline, rounds)
    finally:
        await async_engine.aclose()
        await thread_engine.aclose()
        await eager_engine.aclose()
        offline.shutdown()


async def compare(
    async_engine: VLLMEngine,
    thread_engine: InProcessVLLMEngine,
    eager_engine: VLLMEngine,
    offline: Offline,
    rounds: int,
) -> None:
    codec = ChatCodec(thread_engine.tokenizer)
    single = make_tasks(TASKS, 0.0)
    multi = make_tasks(TASKS, STEP_S)
    prompts = [codec.prompt(task.prompt) for task in single]
    one_turn = RunnerConfig(max_turns=1, max_tokens=SINGLE_TOKENS)
    three_turns = RunnerConfig(max_turns=TURNS, max_tokens=TURN_TOKENS)
    # Every side sends the runner's own requests: each rollout's sampling, seeded as the runner seeds it.
    single_sampling = [one_turn.sampling(i) for i in range(TASKS)]
    turn_sampling = [three_turns.sampling(i) for i in range(TASKS)]
    # The former default: 16 env threads, which take the 64 steps of a turn in four waves.
    three_turns_16 = RunnerConfig(max_turns=TURNS, max_tokens=TURN_TOKENS, env_threads=16)
    # No turn line: each rollout sends its next prompt as soon as its step ended.
    three_turns_unlined = RunnerConfig(max_turns=TURNS, max_tokens=TURN_TOKENS, turn_wait_s=0)
    # The per-turn inputs of the three-turn batch, for the offline side (greedy: the same every time).
    per_turn = turn_inputs(
        (await BatchRunner(thread_engine, SleepyEnv, three_turns).generate(multi)).trajectories
    )
    assert len(per_turn) == TURNS and all(len(batch) == TASKS for batch in per_turn)

    def runner(
        engine: Any, tasks: list[Task], config: RunnerConfig, env: Any = SleepyEnv
    ) -> Callable[[], Awaitable[tuple[int, float]]]:
        batch_runner = BatchRunner(engine, env, config)

        async def run() -> tuple[int, float]:
            start = time.perf_counter()
            result = await batch_runner.generate(tasks)
            return generated(result), time.perf_counter() - start

        return run

    def gather(engine: Any) -> Callable[[], Awaitable[tuple[int, float]]]:
        async def run() -> tuple[int, float]:
            start = time.perf_counter()
            generations = await asyncio.gather(
                *(engine.generate(p, s) for p, s in zip(prompts, single_sampling, strict=True))
            )
            return sum(len(g.token_ids) for g in generations), time.perf_counter() - start

        return run

    async def offline_single() -> tuple[int, float]:
        start = time.perf_counter()
        tokens = offline.generate(prompts, single_sampling)
        return tokens, time.perf_counter() - start

    async def offline_turns() -> tuple[int, float]:
        start = time.perf_counter()
        tokens = sum(offline.generate(batch, turn_sampling) for batch in per_turn)
        # The turn-synchronous loop: each turn's generation, then every env's step at once.
        return tokens, time.perf_counter() - start + TURNS * STEP_S

    variants: dict[str, dict[str, Callable[[], Awaitable[tuple[int, float]]]]] = {
        "single": {
            "offline LLM.generate": offline_single,
            "LLM.generate again (noise)": offline_single,
            "runner, in-process engine": runner(thread_engine, single, one_turn),
            "gather, in-process engine": gather(thread_engine),
            "gather again (noise)": gather(thread_engine),
            "runner, async engine, eager": runner(eager_engine, single, one_turn),
            "gather, async engine, eager": gather(eager_engine),
            "runner, async engine": runner(async_engine, single, one_turn),
            "gather, async engine": gather(async_engine),
        },
        "multi": {
            "offline + 20 ms a turn": offline_turns,
            "the same again (noise)": offline_turns,
            "runner, in-process engine": runner(thread_engine, multi, three_turns),
            "... env_threads=16 (former)": runner(thread_engine, multi, three_turns_16),
            "... turn_wait_s=0 (no line)": runner(thread_engine, multi, three_turns_unlined),
            "runner, async engine, eager": runner(eager_engine, multi, three_turns),
            "runner, async engine": runner(async_engine, multi, three_turns),
        },
    }
    timed_runner = BatchRunner(TimedEngine(thread_engine), TimedSleepyEnv, three_turns)
    splits: list[tuple[float, float, float, float]] = []  # total, generating, env only, neither
    offline_generating: list[float] = []

    timed_single = BatchRunner(TimedEngine(thread_engine), SleepyEnv, one_turn)
    single_splits: dict[str, list[tuple[float, float, float, float]]] = {"runner": [], "gather": []}

    async def single_split() -> None:
        """One single-turn batch of the runner and one of ``gather``, their requests noted."""
        gc.collect()
        SPANS.begin()
        await timed_single.generate(single)
        single_splits["runner"].append(edges(SPANS.now(), SPANS))
        gc.collect()
        SPANS.begin()
        timed = TimedEngine(thread_engine)
        await asyncio.gather(*(timed.generate(p, s) for p, s in zip(prompts, single_sampling, strict=True)))
        single_splits["gather"].append(edges(SPANS.now(), SPANS))

    async def time_split() -> None:
        """One runner batch with its spans noted, and one offline run's generation, for the split."""
        gc.collect()
        SPANS.begin()
        await timed_runner.generate(multi)
        total = SPANS.now()
        splits.append((total, *split(total, SPANS)))
        gc.collect()
        start = time.perf_counter()
        for batch in per_turn:
            offline.generate(batch, turn_sampling)
        offline_generating.append(time.perf_counter() - start)

    rates: dict[tuple[str, str], list[float]] = {}
    to_limit: dict[tuple[str, str], list[float]] = {}
    best_to_limit: dict[tuple[str, str], list[float]] = {}
    for workload in variants.values():  # warm-up: compile and cache every shape once
        for run in workload.values():
            await run()
    await time_split()
    await single_split()
    splits.clear()
    offline_generating.clear()
    single_splits["runner"].clear()
    single_splits["gather"].clear()
    for round_index in range(rounds):
        for workload_name, workload in variants.items():
            limit, *names = list(workload)
            runs: dict[str, list[float]] = {name: [] for name in [limit, *names]}
            pair_ratios: dict[str, list[float]] = {name: [] for name in names}
            beside: dict[str, list[float]] = {name: [] for name in names}  # each one's own limit runs
            for repeat in range(REPEATS):
                shift = (round_index + repeat) % len(names)
                for index, name in enumerate(names[shift:] + names[:shift]):
                    # Each variant runs beside a limit run of its own, alternating which goes first.
                    order = (limit, name) if (repeat + index) % 2 == 0 else (name, limit)
                    rate = {side: await measure(workload[side]) for side in order}
                    runs[limit].append(rate[limit])
                    runs[name].append(rate[name])
                    beside[name].append(rate[limit])
                    pair_ratios[name].append(rate[name] / rate[limit])
            for name, values in runs.items():
                rates.setdefault((workload_name, name), []).append(statistics.median(values))
            for name in names:
                key = (workload_name, name)
                to_limit.setdefault(key, []).append(statistics.median(pair_ratios[name]))
                best_to_limit.setdefault(key, []).append(max(runs[name]) / max(beside[name]))
        for _ in range(REPEATS):
            await time_split()
            await single_split()
        print(f"  round {round_index + 1}/{rounds} done (load {load()})", flush=True)

    titles = {
        "single": f"(a) single turn, {TASKS} tasks x {SINGLE_TOKENS} tokens, greedy",
        "multi": (
            f"(b) {TURNS} turns, {STEP_S * 1e3:.0f} ms env step, {TASKS} tasks x {TURN_TOKENS} tokens, "
            "against the turn-synchronous limit"
        ),
    }
    for workload_name, workload in variants.items():
        print(
            f"{titles[workload_name]}: tok/s median [range] of {rounds} rounds; ratio to the first row "
            f"(a round's: the median of its {REPEATS} pairs' ratios), and of the rounds' fastest runs"
        )
        limit, *names = list(workload)
        print(f"    {limit:<28} {summary(rates[(workload_name, limit)])}   1 (the limit)")
        for name in names:
            key = (workload_name, name)
            print(
                f"    {name:<28} {summary(rates[key])}   {spread(to_limit[key])}   "
                f"fastest {spread(best_to_limit[key])}"
            )
    print_single_split(single_splits)
    print_split(splits, offline_generating, TURNS, STEP_S)


@contextmanager
def vllm_log_lines() -> Iterator[list[str]]:
    """The messages vLLM logs in this process while inside the block."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


_PHASES = {
    "model init": r"Initializing model took ([\d.]+) s",
    "weights": r"Loading weights took ([\d.]+) s",
    "compile": r"torch.compile took ([\d.]+) s in total",
    "profile, KV cache, warm-up": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}


def phases(lines: list[str]) -> str:
    found = []
    for name, pattern in _PHASES.items():
        match = next((m for line in lines if (m := re.search(pattern, line))), None)
        if match:
            found.append(f"{name} {float(match.group(1)):.1f}")
    reloaded = any("Compiling model again due to a load failure" in line for line in lines)
    return ", ".join(found) + ("; compile cache NOT loaded" if reloaded else "")


async def startup(model_dir: Path, rounds: int, threads: int) -> None:
    start = time.perf_counter()
    # Imported once per process: timed on their own, so that no configuration's first start pays them.
    import vllm  # noqa: F401
    from vllm import AsyncLLMEngine, EngineArgs  # noqa: F401
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401

    print(f"(c) import vllm and its engines {time.perf_counter() - start:.1f} s (load {load()})")
    configurations: dict[str, Callable[[], Any]] = {
        "async engine": lambda: VLLMEngine(model_dir),
        "async engine, eager": lambda: VLLMEngine(model_dir, enforce_eager=True),
        "in-process engine": lambda: InProcessVLLMEngine(model_dir, cpu_threads=threads or None),
        "in-process engine, eager": lambda: InProcessVLLMEngine(
            model_dir, cpu_threads=threads or None, enforce_eager=True
        ),
    }
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in configurations}
    for round_index in range(rounds):
        names = list(configurations)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            engine = configurations[name]()
            with vllm_log_lines() as lines, omp_threads(threads):
                began = time.perf_counter()
                await engine.start()
                started = time.perf_counter() - began
            await engine.generate([1, 2, 3], Sampling(max_tokens=4))
            began = time.perf_counter()
            await engine.aclose()
            stopped = time.perf_counter() - began
            times[name][0].append(started)
            times[name][1].append(stopped)
            detail = phases(lines) if isinstance(engine, InProcessVLLMEngine) else "core in a child process"
            print(
                f"    round {round_index + 1} {name:<26} start {started:5.1f} s, shutdown {stopped:4.1f} s "
                f"({detail}) load {load()}",
                flush=True,
            )
    print(f"(c) start and shutdown, median [range] of {rounds} rounds, seconds")
    for name, (started_s, stopped_s) in times.items():
        print(f"    {name:<26} start {seconds(started_s)}  shutdown {seconds(stopped_s)}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads on every side; 0: torch's")
    parser.add_argument("--startup-rounds", type=int, default=1, help="0 skips part (c)")
    args = parser.parse_args()
    set_vllm_environment(cache_dir())
    model_dir = build_tiny_model()
    print(f"load average at start {load()} ({os.cpu_count()} cores), threads {args.threads or 'default'}")
    if args.startup_rounds:
        await startup(model_dir, args.startup_rounds, args.threads)
    await throughput(model_dir, args.rounds, args.threads)
    print(f"load average at end {load()}")


if __name__ == "__main__":
    asyncio.run(main())
