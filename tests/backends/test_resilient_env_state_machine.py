"""Random orders of reset/step/close, with faults, never close the inner env twice or leave it open."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gym_resilience.backends.resilient import ResilientEnv
from gym_resilience.errors import EnvClosedError, EnvCloseError, EnvResetError, EnvStepError
from gym_resilience.testing import ScriptableEnv, default_reset, echo_step

Fault = Literal["none", "error", "interrupt"]
FAULTS = st.sampled_from(["none", "error", "interrupt"])


class InjectedError(RuntimeError):
    """What a faulty behaviour raises; distinct from anything the wrapper raises itself."""


class ResilientEnvLifecycle(RuleBasedStateMachine):
    """Models the wrapper as open or closed, and checks the inner close count against the model."""

    env: ResilientEnv[Any, Any]

    def __init__(self) -> None:
        super().__init__()
        self.fault: Fault = "none"
        self.close_fails = False
        self.model_closed = False
        self.inner = ScriptableEnv(
            reset=self.faulty(default_reset), step=self.faulty(echo_step), close=self.close
        )

    def faulty(self, behaviour: Any) -> Any:
        def scripted(*args: Any) -> Any:
            if self.fault == "error":
                raise InjectedError("injected")
            if self.fault == "interrupt":
                raise KeyboardInterrupt
            return behaviour(*args)

        return scripted

    def close(self, inner: ScriptableEnv) -> None:
        if self.close_fails:
            raise InjectedError("close failed")

    @initialize(close_on_error=st.booleans(), close_fails=st.booleans())
    def wrap(self, close_on_error: bool, close_fails: bool) -> None:
        self.env = ResilientEnv(self.inner, close_on_error=close_on_error)
        self.close_fails = close_fails

    def operate(self, operation: str, fault: Fault, expected_error: type[Exception]) -> None:
        self.fault = fault
        call = self.env.reset if operation == "reset" else lambda: self.env.step("action")
        if self.model_closed:
            with pytest.raises(EnvClosedError, match=rf"^cannot {operation}: the env is closed$"):
                call()
        elif fault == "none":
            call()
        elif fault == "error":
            with pytest.raises(expected_error) as caught:
                call()
            assert isinstance(caught.value.__cause__, InjectedError)
            self.model_closed = self.env.close_on_error
            self.check_close_failure_is_a_note(caught.value)
        else:
            with pytest.raises(KeyboardInterrupt) as interrupted:
                call()
            self.model_closed = True
            self.check_close_failure_is_a_note(interrupted.value)
        self.fault = "none"

    def check_close_failure_is_a_note(self, propagated: BaseException) -> None:
        notes = getattr(propagated, "__notes__", [])
        if self.model_closed and self.close_fails:  # the env was open: this failure closed it
            assert notes == ["env close failed: InjectedError: close failed"]
            assert isinstance(self.env.close_error, EnvCloseError)
        else:
            assert notes == []

    @rule(fault=FAULTS)
    def reset(self, fault: Fault) -> None:
        self.operate("reset", fault, EnvResetError)

    @rule(fault=FAULTS)
    def step(self, fault: Fault) -> None:
        self.operate("step", fault, EnvStepError)

    @rule()
    def close_wrapper(self) -> None:
        self.close_expecting_a_close_error_if_it_fails(self.env.close)

    @rule()
    def leave_a_with_block_normally(self) -> None:
        def leave() -> None:
            with self.env:
                pass

        self.close_expecting_a_close_error_if_it_fails(leave)

    @rule()
    def leave_a_with_block_by_exception(self) -> None:
        failure = LookupError("agent crashed")
        with pytest.raises(LookupError) as caught, self.env:
            raise failure
        assert caught.value is failure
        was_open = not self.model_closed
        self.model_closed = True
        if was_open:
            self.check_close_failure_is_a_note(caught.value)
        else:
            assert not hasattr(caught.value, "__notes__")

    def close_expecting_a_close_error_if_it_fails(self, close: Any) -> None:
        if self.close_fails and not self.model_closed:
            with pytest.raises(EnvCloseError) as caught:
                close()
            assert isinstance(caught.value.__cause__, InjectedError)
            assert self.env.close_error is caught.value
        else:
            close()
        self.model_closed = True

    @precondition(lambda self: not self.model_closed)
    @rule(close_fails=st.booleans())
    def make_close_fail(self, close_fails: bool) -> None:
        self.close_fails = close_fails

    @invariant()
    def inner_close_ran_once_exactly_when_the_wrapper_is_closed(self) -> None:
        assert self.inner.close_calls in (0, 1)
        assert self.env.closed is self.model_closed
        assert (self.inner.close_calls == 1) is self.model_closed

    def teardown(self) -> None:
        self.close_fails = False
        if hasattr(self, "env"):
            self.env.close()
            assert self.inner.close_calls == 1


ResilientEnvLifecycle.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_resilient_env_lifecycle_closes_the_inner_env_exactly_once = ResilientEnvLifecycle.TestCase
