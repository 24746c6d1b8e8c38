"""Comparing a faulted run with its baseline: equal, a real difference located, or a numerical tie."""

from __future__ import annotations

import dataclasses

from gym_resilience import BatchOutput, Trajectory, TrajectoryId, build_batch_output
from harness.judge.compare import LOGPROB_TOLERANCE, TIE_MAX_LOGPROB, TIE_TOLERANCE, compare_outputs


def trajectory(index: int, response: list[int], mask: list[int], logprobs: list[float]) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2, 3],
        response_ids=response,
        reward=0.5,
        loss_mask=mask,
        stop_reason="stop",
        rollout_logprobs=logprobs,
        trajectory_id=TrajectoryId(f"task-{index}"),
    )


def batch(*rows: Trajectory) -> BatchOutput:
    return build_batch_output(list(rows))


# Two turns: generated 10, 11; env wrote 90, 91; generated 12, 13.
MASK = [1, 1, 0, 0, 1, 1]
LOGPROBS = [-1.0, -2.0, 0.0, 0.0, -0.75, -0.25]


def base_row(index: int = 0) -> Trajectory:
    return trajectory(index, [10, 11, 90, 91, 12, 13], list(MASK), list(LOGPROBS))


def test_equal_runs_are_identical_and_logprob_noise_below_the_tolerance_is_not_a_difference() -> None:
    noisy = base_row()
    noisy.rollout_logprobs = [lp - LOGPROB_TOLERANCE / 10 for lp in LOGPROBS]
    comparison = compare_outputs(batch(base_row()), batch(noisy))
    assert (comparison.identical, comparison.first_difference, comparison.ties) == (True, None, [])
    assert comparison.describe() == ""


def test_a_different_token_is_located_by_rollout_turn_and_token_index() -> None:
    changed = base_row(1)
    changed.response_ids[5] = 77
    changed.rollout_logprobs[5] = -3.0  # type: ignore[index]
    comparison = compare_outputs(batch(base_row(0), base_row(1)), batch(base_row(0), changed))
    assert comparison.identical is False
    assert (
        comparison.describe()
        == "first difference at rollout 1, turn 1, token 5 (response_ids): baseline 13, faulted 77"
    )


def test_a_different_reward_or_prompt_is_a_difference_even_with_equal_tokens() -> None:
    rewarded = dataclasses.replace(base_row(), reward=1.0)
    assert compare_outputs(batch(base_row()), batch(rewarded)).describe() == (
        "first difference at rollout 0 (rewards): baseline 0.5, faulted 1.0"
    )
    prompted = dataclasses.replace(base_row(), prompt_ids=[1, 2, 4])
    assert compare_outputs(batch(base_row()), batch(prompted)).first_difference.column == "prompt_token_ids"  # type: ignore[union-attr]


def test_logprobs_that_moved_past_the_tolerance_are_a_difference() -> None:
    moved = base_row()
    moved.rollout_logprobs[4] -= 10 * LOGPROB_TOLERANCE  # type: ignore[index]
    comparison = compare_outputs(batch(base_row()), batch(moved))
    assert comparison.identical is False
    assert comparison.first_difference is not None
    assert (comparison.first_difference.column, comparison.first_difference.index) == ("rollout_logprobs", 4)


def test_a_token_chosen_at_a_numerical_tie_is_reported_as_a_tie_not_a_deviation() -> None:
    flipped = base_row()
    flipped.response_ids[4:] = [55, 56, 57]  # the rest legitimately diverges after the tie
    flipped.loss_mask[4:] = [1, 1, 1]
    flipped.rollout_logprobs[4:] = [-0.75 + TIE_TOLERANCE / 2, -4.0, -4.0]  # type: ignore[index]
    comparison = compare_outputs(batch(base_row()), batch(flipped))
    assert comparison.identical is True
    assert comparison.describe() == (
        "1 numerical tie(s), first at rollout 0, turn 1, token 4 (response_ids): baseline 12, faulted 55"
    )


def test_a_different_token_whose_logprob_is_far_from_the_baselines_is_no_tie() -> None:
    flipped = base_row()
    flipped.response_ids[4] = 55
    flipped.rollout_logprobs[4] = -0.75 + 10 * TIE_TOLERANCE  # type: ignore[index]
    assert compare_outputs(batch(base_row()), batch(flipped)).identical is False


def test_a_different_token_after_a_different_prompt_is_no_tie_but_a_prompt_difference() -> None:
    flipped = dataclasses.replace(base_row(), prompt_ids=[9, 9, 9, 9])
    flipped.response_ids[4] = 55
    flipped.rollout_logprobs[4] = LOGPROBS[4] + TIE_TOLERANCE / 2  # type: ignore[index]
    comparison = compare_outputs(batch(base_row()), batch(flipped))
    assert (comparison.identical, comparison.ties) == (False, [])
    assert comparison.describe() == "first difference at rollout 0 (prompt_token_ids): baseline 1, faulted 9"


def test_two_different_tokens_each_near_certain_in_its_run_are_no_tie() -> None:
    certain = base_row()
    certain.rollout_logprobs[4] = -1e-5  # type: ignore[index]
    flipped = dataclasses.replace(certain, response_ids=list(certain.response_ids))
    flipped.response_ids[4] = 55
    comparison = compare_outputs(batch(certain), batch(flipped))
    assert (comparison.identical, comparison.ties) == (False, [])
    assert comparison.describe() == (
        "first difference at rollout 0, turn 1, token 4 (response_ids): baseline 12, faulted 55"
    )


def test_a_tie_needs_both_sampled_logprobs_at_most_about_log_one_half() -> None:
    for logprob, tie in ((TIE_MAX_LOGPROB, True), (TIE_MAX_LOGPROB + TIE_TOLERANCE / 2, False)):
        at_bound = base_row()
        at_bound.rollout_logprobs[4] = logprob  # type: ignore[index]
        flipped = dataclasses.replace(at_bound, response_ids=list(at_bound.response_ids))
        flipped.response_ids[4] = 55
        comparison = compare_outputs(batch(at_bound), batch(flipped))
        assert (comparison.identical, len(comparison.ties)) == (tie, int(tie))


def test_without_logprobs_any_different_token_is_a_difference() -> None:
    plain, flipped = base_row(), base_row()
    plain.rollout_logprobs = flipped.rollout_logprobs = None
    flipped.response_ids[4] = 55
    assert compare_outputs(batch(plain), batch(flipped)).identical is False


def test_placeholders_are_not_compared_and_a_missing_batch_is_no_verdict() -> None:
    placeholder = dataclasses.replace(base_row(), response_ids=[0], loss_mask=[0], rollout_logprobs=[0.0])
    placeholder.is_placeholder = True
    assert compare_outputs(batch(base_row()), batch(placeholder)).identical is True
    assert compare_outputs(None, batch(base_row())).identical is None


def test_a_deviation_names_its_first_difference_in_the_terminal_line_the_junit_message_and_the_picture(
    tmp_path,
) -> None:
    from harness.judge.results import ProbeResult, RolloutSpan, RunJournal, ScenarioResult, TurnSpan
    from harness.reports import deviation_line, plot_timeline
    from harness.reports.junit import junit_tree

    changed = base_row(1)
    changed.response_ids[5] = 77
    changed.rollout_logprobs[5] = -3.0  # type: ignore[index]
    comparison = compare_outputs(batch(base_row(0), base_row(1)), batch(base_row(0), changed))
    probe = ProbeResult("identical_to_baseline", "is true", False, False, comparison.describe())
    where = "first difference at rollout 1, turn 1, token 5 (response_ids): baseline 13, faulted 77"
    assert deviation_line(probe) == f"probe identical_to_baseline: observed false, expected is true ({where})"
    result = ScenarioResult(
        file="scenarios/x.yaml",
        title="x",
        status="deviated",
        probes=[probe],
        rollouts=[RolloutSpan(0, [TurnSpan("generate", 0, 0, 0.0, 0.5, False)])],
    )
    failure = junit_tree(RunJournal(device="cpu", scenarios=[result])).find(".//failure")
    assert failure is not None
    assert where in failure.get("message", "")
    assert plot_timeline(result, tmp_path / "x.png").stat().st_size > 0
