"""check_engine on scripted engines: one that keeps the contract passes, and each broken one is reported
by exactly the problems it has, in words that are the contract (fast: no vLLM)."""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gym_resilience.engines import Generation, Sampling, check_engine
from gym_resilience.engines.check import (
    GENERATION_CHECKS,
    check_max_tokens,
    check_tokenizer,
    default_prompt,
)
from gym_resilience.engines.scripted import CharTokenizer, ScriptedEngine, echo_script
from gym_resilience.errors import EngineContractError, EngineError, UnsupportedConfigError

TIMEOUT_S = 0.4
"""Short, for the engines that hang; the cancellation bound is a quarter of it."""


def stopped_at_stop_tokens(generation: Generation, sampling: Sampling) -> Generation:
    """``generation`` ended at its first stop token, kept (as vLLM keeps it)."""
    for index, token in enumerate(generation.token_ids):
        if token in sampling.stop_token_ids:
            logprobs = None if generation.logprobs is None else generation.logprobs[: index + 1]
            return Generation(generation.token_ids[: index + 1], logprobs, "stop")
    return generation


def keeps_the_contract(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
    """``echo_script``, ending at a stop token as an engine must (``echo_script`` does not)."""
    return stopped_at_stop_tokens(echo_script(prompt_ids, sampling, call_index), sampling)


def engine_of(change: Any) -> ScriptedEngine:
    """A scripted engine that keeps the contract but for what ``change(generation, sampling, call_index)``
    makes of each generation."""

    def script(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
        generation = keeps_the_contract(prompt_ids, sampling, call_index)
        changed: Generation = change(generation, sampling, call_index)
        return changed

    return ScriptedEngine(script=script)


def ignores_max_tokens(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
    return keeps_the_contract(prompt_ids, replace(sampling, max_tokens=64), call_index)


def random_when_greedy(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
    """Greedy requests get different letters on every call; seeded ones are reproducible."""
    if sampling.seed is not None:
        return keeps_the_contract(prompt_ids, sampling, call_index)
    letters = random.Random(call_index)
    ids = [ord(letters.choice("abcdefghij")) + 8 for _ in range(sampling.max_tokens)]
    return stopped_at_stop_tokens(
        Generation(ids, [-0.5] * len(ids) if sampling.logprobs else None, "length"), sampling
    )


def fails_call(index: int) -> Any:
    def change(generation: Generation, sampling: Sampling, call_index: int) -> Generation:
        if call_index == index:
            raise ConnectionError("dropped")
        return generation

    return change


async def hang(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
    await asyncio.Event().wait()
    raise AssertionError("never set")


class Cancellation(ScriptedEngine):
    """A long request (over 100 tokens) takes a second; what a cancellation does to it is ``on_cancel``'s."""

    def __init__(self, on_cancel: str) -> None:
        super().__init__(script=keeps_the_contract)
        self.on_cancel = on_cancel
        self.left_running = 0

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        if sampling.max_tokens <= 100:
            return await super().generate(prompt_ids, sampling)
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            if self.on_cancel == "return":
                return Generation([50], None, "abort")
            if self.on_cancel == "raise":
                raise EngineError("aborted") from None
            self.left_running += 1  # goes on generating, then ends
            try:
                await asyncio.sleep(0.5)
            finally:
                self.left_running -= 1
            raise
        raise AssertionError("a long request is cancelled before it ends")


class ReturnsAList(ScriptedEngine):
    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Any:
        return (await super().generate(prompt_ids, sampling)).token_ids


class NoEosTokenizer(CharTokenizer):
    eos_token_id = None


class BrokenTokenizer(CharTokenizer):
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: object) -> list[int]:
        raise ValueError("no chat template")

    def encode(self, text: str, **kwargs: object) -> list[int]:
        return [-1]


async def problems_of(engine: Any, **options: Any) -> list[str]:
    with pytest.raises(EngineContractError) as raised:
        await check_engine(engine, **options)
    assert raised.value.engine == type(engine).__name__
    return list(raised.value.problems)


# -- engines that keep the contract ----------------------------------------------------------------


async def test_a_scripted_engine_that_keeps_the_contract_passes_check_engine() -> None:
    engine = ScriptedEngine(script=keeps_the_contract)
    await check_engine(engine)
    assert engine.calls == 20 and engine.cancelled == 0  # the request to cancel was done before


async def test_the_scripted_engine_as_it_comes_passes_check_engine() -> None:
    await check_engine(ScriptedEngine())


async def test_an_engine_that_answers_after_a_delay_and_honours_cancellation_passes_check_engine() -> None:
    engine = ScriptedEngine(script=keeps_the_contract, delay_s=0.1)
    await check_engine(engine)
    assert engine.cancelled == 1  # the one request check_cancellation cancels


async def test_given_prompt_ids_are_what_the_checks_send() -> None:
    prompts: list[list[int]] = []

    def recording(prompt_ids: list[int], sampling: Sampling, call_index: int) -> Generation:
        prompts.append(prompt_ids)
        return keeps_the_contract(prompt_ids, sampling, call_index)

    engine = ScriptedEngine(script=recording)
    await check_engine(engine, prompt_ids=(20, 21, 22))
    assert len(prompts) == 20 and all(prompt == [20, 21, 22] for prompt in prompts)
    # The one the tokenizer's chat template gives, otherwise.
    assert default_prompt(engine) == engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True
    )


# -- broken engines: exactly their problems --------------------------------------------------------

STOP_TOKEN = ord("p") + 8
"""The stop token check_stop_token_ids picks: the echo script answers the default prompt "gpqlbkpx"."""


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        pytest.param(
            engine_of(lambda g, s, i: replace(g, token_ids=[-1, *g.token_ids[1:]])),
            ["generation: token id -1 (int) at position 0, expected a non-negative int"],
            id="negative-token-id",
        ),
        pytest.param(
            ScriptedEngine(script=ignores_max_tokens),
            ["max_tokens: generate() returned 9 tokens for max_tokens=8"],
            id="ignores-max-tokens",
        ),
        pytest.param(
            engine_of(
                lambda g, s, i: replace(g, logprobs=[math.nan] * len(g.token_ids) if s.logprobs else None)
            ),
            ["logprobs: logprob nan (float) for token 0, expected a finite number <= 0"],
            id="nan-logprobs",
        ),
        pytest.param(
            engine_of(lambda g, s, i: replace(g, logprobs=g.logprobs[:-1] if g.logprobs else None)),
            ["logprobs: 7 logprobs for 8 tokens, expected one per token"],
            id="a-logprob-short",
        ),
        pytest.param(
            engine_of(lambda g, s, i: replace(g, logprobs=None)),
            ["logprobs: no logprobs for 8 tokens, though logprobs=True asked for one per token"],
            id="no-logprobs",
        ),
        pytest.param(
            engine_of(lambda g, s, i: replace(g, logprobs=[-0.5] * len(g.token_ids))),
            [
                "generation: logprobs is [-0.5, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5] "
                "though none were asked for, expected None"
            ],
            id="logprobs-not-asked-for",
        ),
        pytest.param(
            ScriptedEngine(script=random_when_greedy),
            [
                "greedy: two greedy generations of the same prompt differ: "
                "[108, 109, 106, 111, 112, 107, 106, 106] then [114, 109, 110, 113, 105, 112, 108, 105]"
            ],
            id="non-deterministic-greedy",
        ),
        pytest.param(
            engine_of(lambda g, s, i: replace(g, finish_reason="stop")),
            ["max_tokens: a generation cut at max_tokens=4 finished 'stop', expected 'length'"],
            id="stop-when-cut",
        ),
        pytest.param(
            engine_of(lambda g, s, i: replace(g, finish_reason="done")),
            [
                "generation: finish reason 'done', expected 'stop', 'length' or 'abort'",
                "max_tokens: a generation cut at max_tokens=4 finished 'done', expected 'length'",
                f"stop_token_ids: stop token id {STOP_TOKEN} ended generation with finish 'done', "
                "expected 'stop'",
            ],
            id="unknown-finish-reason",
        ),
        pytest.param(
            engine_of(lambda g, s, i: replace(g, finish_reason="abort")),
            [
                "generation: finish reason 'abort' for a request nobody cancelled",
                "max_tokens: a generation cut at max_tokens=4 finished 'abort', expected 'length'",
                f"stop_token_ids: stop token id {STOP_TOKEN} ended generation with finish 'abort', "
                "expected 'stop'",
            ],
            id="abort-uncancelled",
        ),
        pytest.param(
            ScriptedEngine(script=lambda p, s, i: echo_script(p, replace(s, stop_token_ids=()), i)),
            [f"stop_token_ids: generation went on past stop token id {STOP_TOKEN} (finish 'length')"],
            id="ignores-stop-tokens",
        ),
        pytest.param(
            engine_of(fails_call(12)),  # one of the eight check_concurrent_requests sends at once
            [
                "concurrency: 1 of 8 requests sent at once failed; the first: generate() raised "
                "ConnectionError: dropped"
            ],
            id="a-concurrent-request-fails",
        ),
        pytest.param(
            ReturnsAList(),
            ["generation: generate() returned list, expected a Generation"],
            id="not-a-generation",
        ),
        pytest.param(
            ScriptedEngine(script=keeps_the_contract, tokenizer=NoEosTokenizer()),
            ["tokenizer: eos_token_id is None (NoneType), expected a token id"],
            id="no-eos",
        ),
    ],
)
async def test_a_broken_engine_raises_one_error_listing_exactly_its_problems(
    engine: ScriptedEngine, expected: list[str]
) -> None:
    assert await problems_of(engine, timeout_s=TIMEOUT_S) == expected


async def test_an_engine_that_never_answers_is_reported_by_every_generation_check_within_its_timeout() -> (
    None
):
    loop = asyncio.get_running_loop()
    start = loop.time()
    problems = await problems_of(ScriptedEngine(script=hang), timeout_s=0.1)
    assert problems == [
        f"{part}: no answer within 0.1 s"
        for part in (
            "generation",
            "logprobs",
            "max_tokens",
            "greedy",
            "seeded sampling",
            "concurrency",
            "cancellation",
            "stop_token_ids",
        )
    ]
    assert loop.time() - start < 8 * 0.1 + 1.0
    assert len(GENERATION_CHECKS) == 8


@pytest.mark.parametrize(
    ("on_cancel", "expected"),
    [
        ("ignore", "cancellation: generate() went on for over 0.1 s after its task was cancelled"),
        (
            "return",
            "cancellation: generate() returned a generation after its task was cancelled, instead of raising "
            "CancelledError",
        ),
        (
            "raise",
            "cancellation: generate() raised EngineError: aborted instead of CancelledError when cancelled",
        ),
    ],
    ids=["ignores-it", "returns", "raises-another-error"],
)
async def test_an_engine_that_does_not_honour_cancellation_is_reported_and_the_check_goes_on(
    on_cancel: str, expected: str
) -> None:
    engine = Cancellation(on_cancel)
    assert await problems_of(engine, timeout_s=TIMEOUT_S) == [expected]
    await asyncio.sleep(0.6)  # the request left running ends
    assert engine.left_running == 0


async def test_a_tokenizer_without_a_chat_template_is_reported_and_no_prompt_is_made_from_it() -> None:
    engine = ScriptedEngine(script=keeps_the_contract, tokenizer=BrokenTokenizer())
    assert await problems_of(engine) == [
        "tokenizer: apply_chat_template on a one-message chat raised ValueError: no chat template",
        "tokenizer: encode('Say hello.') gave [-1], expected a list of token ids",
        "prompt: the tokenizer gives no prompt to generate from; pass prompt_ids",
    ]
    assert engine.calls == 0
    with pytest.raises(EngineContractError) as raised:
        await check_engine(engine, prompt_ids=[20, 21])
    assert len(raised.value.problems) == 2  # the tokenizer's, and nothing more: the checks ran on the ids


async def test_an_engine_without_generate_or_tokenizer_is_reported_without_generating() -> None:
    class Nothing:
        @property
        def tokenizer(self) -> Any:
            raise RuntimeError("not loaded")

    assert await problems_of(Nothing()) == [
        "tokenizer: engine.tokenizer raised RuntimeError: not loaded",
        "generate: Nothing has no generate method",
    ]
    assert check_tokenizer(ScriptedEngine(tokenizer=object())) == [  # type: ignore[arg-type]
        "tokenizer: object has no eos_token_id, pad_token_id, apply_chat_template, encode, decode"
    ]


# -- the checks one by one, and the error ----------------------------------------------------------


async def test_each_check_alone_returns_its_problems_and_raises_nothing() -> None:
    prompt = default_prompt(ScriptedEngine())
    assert prompt is not None
    assert await check_max_tokens(ScriptedEngine(script=ignores_max_tokens), prompt) == [
        "max_tokens: generate() returned 9 tokens for max_tokens=8"
    ]
    assert await check_max_tokens(ScriptedEngine(script=hang), prompt, timeout_s=0.05) == [
        "max_tokens: no answer within 0.05 s"
    ]
    for check in GENERATION_CHECKS:
        assert await check(ScriptedEngine(script=keeps_the_contract), prompt) == [], check.__name__


async def test_a_cancelled_check_engine_cancels_the_generation_it_waits_on() -> None:
    engine = ScriptedEngine(script=hang)
    checking = asyncio.create_task(check_engine(engine))
    await asyncio.sleep(0.05)
    checking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await checking
    await asyncio.sleep(0)
    assert engine.cancelled == engine.calls == 1


@pytest.mark.parametrize("timeout_s", [0, -1.0, math.inf, math.nan, True, "30"])
async def test_a_timeout_that_is_no_number_of_seconds_is_refused(timeout_s: Any) -> None:
    with pytest.raises(UnsupportedConfigError, match=r"^timeout_s: must be a finite number of seconds > 0"):
        await check_engine(ScriptedEngine(), timeout_s=timeout_s)


def test_the_contract_error_lists_every_problem_and_survives_a_pickle_round_trip() -> None:
    error = EngineContractError(["greedy: differs", "cancellation: hangs"], engine="MyEngine")
    assert str(error) == (
        "MyEngine breaks the engine contract (2 problems):\n  - greedy: differs\n  - cancellation: hangs"
    )
    assert str(EngineContractError(["x"], engine="E")) == "E breaks the engine contract (1 problem):\n  - x"
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is EngineContractError and isinstance(restored, EngineError)
    assert (str(restored), restored.problems, restored.engine) == (str(error), error.problems, "MyEngine")


# -- the doc's example -----------------------------------------------------------------------------

ENGINE_DOC = Path(__file__).resolve().parents[2] / "docs" / "your-own-engine.md"
MAX_TOKENS_TEST = "            if len(tokens) == sampling.max_tokens:\n"


def run_doc_example(source: str, directory: Path) -> subprocess.CompletedProcess[str]:
    script = directory / "your_own_engine.py"
    script.write_text(source, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_the_engine_docs_example_passes_check_engine_and_without_its_max_tokens_test_fails_as_shown(
    tmp_path: Path,
) -> None:
    page = ENGINE_DOC.read_text(encoding="utf-8")
    example = re.search(r"^```python\n(.*?)^```$", page, re.MULTILINE | re.DOTALL)
    assert example is not None
    passing = run_doc_example(example[1], tmp_path)
    assert passing.returncode == 0, passing.stderr[-3000:]
    assert passing.stdout == "ReverseEngine keeps the engine contract\n"

    assert MAX_TOKENS_TEST in example[1]
    broken = run_doc_example(example[1].replace(MAX_TOKENS_TEST, "            if False:\n"), tmp_path)
    shown = re.search(r"^```\n(gym_resilience\.errors\.EngineContractError: .*?)^```$", page, re.M | re.S)
    assert shown is not None
    assert broken.returncode == 1 and broken.stderr.endswith(shown[1]), broken.stderr[-3000:]
