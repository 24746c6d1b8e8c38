"""The completions protocol's pure parts: the request body, the checked parsing of a response, what a
failed status blames, and which endpoint is next."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from openai_payloads import PROMPT, completion_json

from gym_resilience.engines import Sampling
from gym_resilience.engines.completions import (
    choose_endpoint,
    classify_status,
    completion_request,
    parse_completion,
)
from gym_resilience.errors import (
    EngineError,
)


def test_the_request_sends_token_ids_and_asks_for_token_ids_and_the_sampled_logprobs_back() -> None:
    sampling = Sampling(max_tokens=9, temperature=0.7, top_p=0.9, seed=5, logprobs=True, stop_token_ids=(4,))
    body = completion_request(PROMPT, sampling, model="m", extra={"top_k": 3})
    assert body == {
        "prompt": PROMPT,
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 1,
        "stream": False,
        "return_token_ids": True,
        "model": "m",
        "seed": 5,
        "stop_token_ids": [4],
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "top_k": 3,
    }
    plain = completion_request(PROMPT, Sampling(), model=None, extra={})
    assert "logprobs" not in plain and "seed" not in plain and "model" not in plain


def test_a_completion_parses_to_exact_token_ids_logprobs_and_finish_reason() -> None:
    generation = parse_completion(completion_json(PROMPT, [7, 8], "length"), PROMPT, Sampling(logprobs=True))
    assert generation.token_ids == [7, 8] and generation.logprobs == [-0.5, -0.5]
    assert generation.finish_reason == "length"
    assert parse_completion(completion_json(PROMPT, [], "abort"), PROMPT, Sampling()).finish_reason == "abort"
    assert parse_completion(completion_json(PROMPT, [7], "stop"), PROMPT, Sampling()).logprobs is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"choices": [{"text": "hi", "finish_reason": "stop"}]}, "has no token ids"),
        ({"choices": []}, "is not a completion"),
        ([1, 2], "is not a completion"),
        ({"choices": ["text"]}, "is not a completion"),
        *(
            ({"choices": [{"token_ids": ids, "finish_reason": "stop"}]}, "has no token ids")
            for ids in ("78", [7.9, 8.2], [True, False], None)
        ),
        (completion_json([9, *PROMPT], [7]), "changed the prompt"),
        (
            {"choices": [{"token_ids": [7], "prompt_token_ids": 5, "finish_reason": "stop"}]},
            "changed the prompt",
        ),
        (completion_json(PROMPT, list(range(10, 30))), "returned 20 tokens for max_tokens=16"),
        ({"choices": [{"token_ids": [7], "finish_reason": "stop", "logprobs": None}]}, "no logprob"),
        *(
            ({"choices": [{"token_ids": [7], "finish_reason": "stop", "logprobs": logprobs}]}, "no logprob")
            for logprobs in ([-0.5], "x", {"token_logprobs": ["x"]}, {"token_logprobs": [{}]})
        ),
    ],
)
def test_a_malformed_completion_raises_engine_error(payload: Any, message: str) -> None:
    with pytest.raises(EngineError, match=message):
        parse_completion(payload, PROMPT, Sampling(max_tokens=16, logprobs=True))


def completion_with(token_ids: list[Any], token_logprobs: list[Any]) -> dict[str, Any]:
    return {
        "choices": [
            {"token_ids": token_ids, "finish_reason": "stop", "logprobs": {"token_logprobs": token_logprobs}}
        ]
    }


@pytest.mark.parametrize(
    ("token_ids", "token_logprobs", "message"),
    [
        ([7, -1, 8], [-0.5, -0.5, -0.5], "has token id -1 at position 1; a token id is an integer >= 0"),
        ([-(2**70)], [-0.5], f"has token id {-(2**70)} at position 0"),
        (
            [7, 8],
            [-0.5, math.nan],
            "has logprob nan for the token at position 1; a logprob is a finite number",
        ),
        ([7, 8], [math.inf, -0.5], "has logprob inf for the token at position 0"),
        ([7, 8], [-0.5, -math.inf], "has logprob -inf for the token at position 1"),
        (
            [7, 8],
            [-0.5, 0.25],
            "has logprob 0.25 for the token at position 1; a logprob is a finite number <= 0",
        ),
        ([7, 8], [-0.5, 1], "has logprob 1 for the token at position 1"),
        ([7], [-(10**400)], "has logprob -1000000000"),
        ([7, 8], [-0.5, True], "has no logprob for the token at position 1: got True"),
        ([7, 8], [None, -0.5], "has no logprob for the token at position 0: got None"),
    ],
)
def test_a_completion_vllm_never_sends_raises_engine_error_that_says_what_is_wrong(
    token_ids: list[Any], token_logprobs: list[Any], message: str
) -> None:
    # What the output validator would reject: a negative id, a logprob that is NaN, infinite or above 0.
    with pytest.raises(EngineError, match=re.escape(message)):
        parse_completion(completion_with(token_ids, token_logprobs), PROMPT, Sampling(logprobs=True))


def test_a_negative_token_id_is_refused_even_when_no_logprobs_were_asked_for_and_then_none_are_read() -> None:
    with pytest.raises(EngineError, match="has token id -3 at position 0"):
        parse_completion(completion_with([-3], [-0.5]), PROMPT, Sampling())
    assert parse_completion(completion_with([3], [math.nan]), PROMPT, Sampling()).logprobs is None


def test_logprobs_at_the_edges_of_what_vllm_sends_parse_as_floats() -> None:
    # 0 (a certain token), -0.0, vLLM's -9999.0 for -inf, and JSON integers among them.
    generation = parse_completion(
        completion_with([0, 7, 8, 9], [0, -0.0, -9999.0, -3]), PROMPT, Sampling(logprobs=True)
    )
    assert generation.token_ids == [0, 7, 8, 9] and generation.logprobs == [0.0, 0.0, -9999.0, -3.0]
    assert all(type(logprob) is float for logprob in generation.logprobs)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        *[(200, None), (400, "request"), (404, "request"), (422, "request")],
        *[(408, "endpoint"), (429, "endpoint"), (500, "endpoint"), (502, "endpoint"), (503, "endpoint")],
    ],
)
def test_only_a_4xx_that_blames_the_request_is_a_request_error(status: int, kind: str | None) -> None:
    assert classify_status(status) == kind


def test_the_least_busy_healthy_untried_endpoint_is_chosen_and_ties_rotate() -> None:
    assert choose_endpoint([True, True, True], [2, 0, 1], set(), 0) == 1
    assert [choose_endpoint([True, True, True], [0, 0, 0], set(), turn) for turn in range(4)] == [0, 1, 2, 0]
    assert choose_endpoint([True, False, True], [0, 0, 5], {0}, 0) == 2
    assert choose_endpoint([False, True], [0, 0], {1}, 0) is None
