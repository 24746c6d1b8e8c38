"""What the validator reports: the warning for an all-zero batch, and every problem at once.

Messages are the contract (``sample <i>: <column> ...`` or ``batch: <column> ...``), so they are matched
exactly.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
from small_batches import batch, passes, problems, real

from gym_resilience.errors import OutputValidationError
from gym_resilience.trajectories import (
    ROLLOUT_ERROR_STOP_REASON,
    TrajectoryId,
    build_batch_output,
)
from gym_resilience.validation import (
    OutputValidationWarning,
    validate_batch_output,
)

# A valid batch must not warn either, unless a test says so.
pytestmark = pytest.mark.filterwarnings("error::gym_resilience.validation.OutputValidationWarning")


# The all-zero loss mask warning.


def test_all_zero_loss_masks_warn_but_pass() -> None:
    output = batch()
    output.loss_masks[:] = [[0] * len(mask) for mask in output.loss_masks]
    with pytest.warns(
        OutputValidationWarning,
        match=re.escape(
            "every loss mask in the batch is all zeros: no token will be trained on and the loss may be NaN"
        ),
    ):
        passes(output)


def test_a_single_trained_token_does_not_warn() -> None:
    output = batch()
    output.loss_masks[:] = [[0] * len(mask) for mask in output.loss_masks]
    output.loss_masks[1][2] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        passes(output)


def test_invalid_batch_with_all_zero_loss_masks_raises_without_warning() -> None:
    output = batch()
    output.loss_masks[:] = [[0] * len(mask) for mask in output.loss_masks]
    output.stop_reasons[0] = None  # type: ignore[call-overload]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert problems(output) == ["sample 0: stop_reasons is None (NoneType), expected a str"]


def test_output_validation_warning_is_a_user_warning() -> None:
    assert issubclass(OutputValidationWarning, UserWarning)


# All problems at once.


def test_several_problems_are_all_reported_at_once() -> None:
    output = batch(token_level=True)
    assert output.rollout_logprobs is not None
    output.response_ids[0].append(99)
    output.loss_masks[1][0] = 2
    output.rewards[2] = 0.5
    output.rollout_logprobs[1][0] = 0.1
    output.stop_reasons[2] = ROLLOUT_ERROR_STOP_REASON
    output.prompt_token_ids[1] = []
    assert problems(output, num_prompts=5) == [
        "sample 1: prompt_token_ids is empty",
        "sample 0: loss_masks has 2 entries but response_ids has 3",
        "sample 0: rewards has 2 entries but response_ids has 3",
        "sample 0: rollout_logprobs has 2 entries but response_ids has 3",
        "sample 2: rewards is trajectory-level (a number) but sample 0's is token-level (a list); "
        "a batch's rewards must be all trajectory-level or all token-level",
        "sample 1: loss_masks[0] is 2 (int), expected 0 or 1 (int)",
        "sample 1: rollout_logprobs[0] is 0.1 (float), expected a finite number <= 0",
        "sample 2: stop_reasons is 'rollout_error' but is_placeholder is False (bool); "
        "only a placeholder may stop with 'rollout_error'",
        "batch: response_ids has 3 rows but num_prompts is 5",
    ]


def test_error_message_lists_every_problem() -> None:
    output = batch()
    output.response_ids[0] = []
    output.stop_reasons[1] = 3  # type: ignore[call-overload]
    with pytest.raises(OutputValidationError) as info:
        validate_batch_output(output, 3)
    assert str(info.value) == (
        "batch output is invalid (4 problems):\n"
        "  - sample 0: response_ids is empty\n"
        "  - sample 0: loss_masks has 2 entries but response_ids has 0\n"
        "  - sample 0: rollout_logprobs has 2 entries but response_ids has 0\n"
        "  - sample 1: stop_reasons is 3 (int), expected a str"
    )


def test_output_validation_error_is_a_value_error() -> None:
    output = batch()
    output.response_ids[0] = []
    with pytest.raises(ValueError):
        validate_batch_output(output, 3)


def test_validation_still_raises_under_python_optimize() -> None:
    code = (
        "from gym_resilience.trajectories import Trajectory, build_batch_output\n"
        "from gym_resilience.validation import validate_batch_output\n"
        "from gym_resilience.errors import OutputValidationError\n"
        "row = Trajectory(prompt_ids=[1], response_ids=[], reward=1.0, loss_mask=[], stop_reason='stop')\n"
        "try:\n"
        "    validate_batch_output(build_batch_output([row]), 1)\n"
        "except OutputValidationError as error:\n"
        "    print(error.problems)\n"
    )
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "('sample 0: response_ids is empty',)"


def test_ten_thousand_rows_validate_and_one_bad_entry_among_them_is_reported_naming_its_row() -> None:
    rows = [
        real(
            list(range(i % 50, i % 50 + 40)),
            prompt=list(range(60)),
            reward=[0.1] * 40,
            mask=[i % 2] * 40,
            logprobs=[-0.5] * 40,
            tid=TrajectoryId(str(i)),
        )
        for i in range(10_000)
    ]
    output = build_batch_output(rows)
    validate_batch_output(output, 10_000)
    output.rollout_logprobs[7_654][39] = float("nan")
    assert problems(output, 10_000) == [
        "sample 7654: rollout_logprobs[39] is nan (float), expected a finite number <= 0"
    ]
