"""Session fixtures: the bundled tiny model and one real vLLM engine shared by every test that needs it.

Real-vLLM tests are marked ``slow``. A missing vLLM fails them (``DependencyNotInstalledError``): in CI
that is a broken install, not a reason to skip.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from ray_fixtures import ray_cluster, run_cluster_tests_last  # noqa: F401 (a fixture: pytest finds it by name here)

from gym_resilience.cache import CACHE_ENV_VAR
from gym_resilience.engines.local import make_vllm_engine
from gym_resilience.engines.vllm import VLLMEngine
from gym_resilience.engines.vllm_inprocess import InProcessVLLMEngine
from gym_resilience.models import build_tiny_model

# Before any test reads it: a project-local cache unless the caller (tox, CI) chose one. The tiny
# model, vLLM's cache and torch inductor's compiled kernels land there and make the next run faster.
os.environ.setdefault(CACHE_ENV_VAR, str(Path(__file__).resolve().parent.parent / ".cache"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The bundled tiny chat model's folder, built once into the cache and reused."""
    return build_tiny_model()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_model: Path) -> AsyncIterator[InProcessVLLMEngine | VLLMEngine]:
    """One real vLLM engine on the tiny model for the whole session, the one ``make_vllm_engine``
    picks: on CPU the in-process engine (about 8 s to start warm, vLLM's async engine about 30 s).

    It runs in the session event loop, which the async tests share (pyproject sets both default loop
    scopes to ``session``), and is shut down when the session ends. Tests of the async engine itself
    start theirs in ``test_vllm_engine.py``.
    """
    async with make_vllm_engine(tiny_model) as engine:
        yield engine


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_cluster_tests_last(items)
