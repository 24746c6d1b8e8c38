"""The run's recorder: reports from this process land in memory, reports from env worker processes come
through its channel file, and the run gets back one ``Recording`` keyed by the runner's rollout index."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest

from gym_resilience import BatchRunner, RunnerConfig
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.task_gen import generate_tasks, word_game_factory
from harness.faults import FaultFiring, FaultPlan, FaultyEnvFactory, Span, record_span
from harness.run.ledger import LedgeredFactory
from harness.run.recorder import Channel, Recorder, Recording
from harness.scenario.spec import EnvFault, Targeting


def firing(rollout: int | None, turn: int | None, detail: str = "x") -> FaultFiring:
    return FaultFiring(0, "raise", "env", rollout, 0, turn, detail, 0.5)


def test_reports_from_this_process_are_kept_in_memory_and_never_touch_the_channel(tmp_path: Path) -> None:
    with Recorder(tmp_path) as recorder:
        recorder.fired(firing(2, 1))
        recorder.fired(firing(None, None))
        recorder.fired(firing(1, 0))
        record_span(
            recorder, "step", rollout=1, attempt=0, turn=0, started=time.time(), ended=None, failed=True
        )
        recorder.env_opened("a", os.getpid())
        recorder.env_opened("b", os.getpid())
        recorder.env_closed("a", os.getpid())
        assert recorder.channel.path.read_bytes() == b""
        recording = recorder.recording()
    assert [(f.rollout, f.turn) for f in recording.firings] == [(None, None), (1, 0), (2, 1)]
    assert [(s.kind, s.rollout, s.end_s) for s in recording.spans] == [("step", 1, None)]
    assert (recording.envs_created, recording.envs_unclosed) == (2, 1)
    assert not recorder.channel.path.exists()


def test_a_pickled_recorder_is_its_channel_and_what_it_sends_is_read_back_line_by_line(
    tmp_path: Path,
) -> None:
    recorder = Recorder(tmp_path, start=100.0)
    channel = pickle.loads(pickle.dumps(recorder))
    assert channel == Channel(recorder.channel.path, 100.0)
    channel.fired(firing(3, 0, "from a worker"))
    with recorder.channel.path.open("ab") as stream:  # a line another process is still writing
        stream.write(b'{"report": "env_opened", "id": "half')
    assert recorder.firings() == [firing(3, 0, "from a worker")]
    assert recorder.envs_created() == 0
    with recorder.channel.path.open("ab") as stream:
        stream.write(f'", "pid": {os.getpid()}}}\n'.encode())
    assert (recorder.envs_created(), recorder.envs_unclosed()) == (1, 1)
    assert recorder.firings() == [firing(3, 0, "from a worker")]  # each line is taken once


def test_an_env_whose_process_is_gone_counts_as_closed(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    recorder.env_opened("killed with its worker", pid)
    assert (recorder.envs_created(), recorder.envs_unclosed()) == (1, 0)


def test_a_recording_groups_spans_and_firings_by_rollout_and_leaves_out_calls_outside_any() -> None:
    spans = [Span("generate", None, None, None, 0.0, 0.1, False), Span("reset", 1, 0, None, 0.2, 0.3, False)]
    spans.append(Span("step", 1, 0, 0, 0.4, None, True))
    recording = Recording(firings=[firing(1, 0), firing(2, 0), firing(None, None)], spans=spans)
    assert recording.firings_of(2) == [firing(2, 0)]
    assert recording.spans_by_rollout() == {1: spans[1:]}


@pytest.mark.slow
async def test_env_worker_processes_report_firings_spans_and_envs_to_the_run_by_the_runners_rollout_index(
    tmp_path: Path,
) -> None:
    tasks = generate_tasks(4, seed=0)
    config = RunnerConfig(skip_failed_rollouts=True, env_backend="process", max_turns=2)
    fault = EnvFault(
        target="env", kind="raise", exception="ConnectionResetError", when=Targeting(rollouts=[2], turns=[1])
    )
    with Recorder(tmp_path) as recorder:
        plan = FaultPlan([fault], seed=0, events=recorder, exceptions={0: ConnectionResetError})
        # No fallback rollout: only the runner's own index, passed to each worker's reset, can say it.
        factory = LedgeredFactory(FaultyEnvFactory(word_game_factory, plan, {}, events=recorder), recorder)
        result = await BatchRunner(ScriptedEngine(), factory, config).generate(tasks)
        recording = recorder.recording()
        assert recorder.channel.path.stat().st_size > 0  # the workers' reports came through the channel
    assert [failure.rollout_index for failure in result.failures] == [2]
    [hit] = recording.firings
    assert (hit.rollout, hit.attempt, hit.turn, hit.detail) == (
        2,
        0,
        1,
        "step raised ConnectionResetError: injected fault",
    )
    by_rollout = recording.spans_by_rollout()
    assert sorted(by_rollout) == [0, 1, 2, 3]
    assert [(s.kind, s.turn, s.failed) for s in by_rollout[2]] == [
        ("reset", None, False),
        ("step", 0, False),
        ("step", 1, True),
        ("close", 1, False),
    ]
    assert all(span.start_s >= 0 for span in recording.spans)
    assert (recording.envs_created, recording.envs_unclosed) == (4, 0)
