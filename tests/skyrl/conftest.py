"""Fixtures for the tests against SkyRL 0.3.0: its config, a deterministic inference client behind its
``InferenceEngineInterface``, the bundled tiny model's tokenizer, and a trainer to run its methods on.

SkyRL 0.3.0 on Python 3.11: ``skyrl.tinker.types`` declares pydantic models over ``typing.TypedDict``,
which pydantic refuses below Python 3.12, and every ``skyrl.train`` module imports it (through
``skyrl.backends``). Only while that one module is first imported, ``typing.TypedDict`` is
``typing_extensions.TypedDict`` (what pydantic asks for); afterwards it is restored. Nothing else of
SkyRL's is changed. On Python 3.12 the workaround does nothing.
"""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path

import typing_extensions

if sys.version_info < (3, 12):
    _typed_dict = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    try:
        import skyrl.tinker.types  # noqa: F401
    finally:
        typing.TypedDict = _typed_dict  # type: ignore[misc]

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GYM_RESILIENCE_CACHE", str(Path(__file__).resolve().parents[2] / ".cache"))

import pytest
from skyrl_client import ScriptedClient

from gym_resilience.models import build_tiny_model


@pytest.fixture(scope="session")
def tokenizer():  # type: ignore[no-untyped-def]
    """The bundled tiny model's Hugging Face tokenizer (ChatML template, eos ``<|im_end|>``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_tiny_model()))


@pytest.fixture
def client(tokenizer) -> ScriptedClient:  # type: ignore[no-untyped-def]
    return ScriptedClient(tokenizer)
