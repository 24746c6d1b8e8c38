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


class SessionEngine:
    """The session's real vLLM engine on the tiny model, started on first use, the one
    ``make_vllm_engine`` picks: on CPU the in-process engine (about 8 s to start warm, vLLM's async engine
    about 30 s). vLLM keeps an in-process engine's parallel state per process, so a test that starts one
    of its own (directly, or through the harness) asks for ``no_session_engine``, which closes this one
    first; the next test that needs it starts it again.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.engine: InProcessVLLMEngine | VLLMEngine | None = None

    async def get(self) -> InProcessVLLMEngine | VLLMEngine:
        if self.engine is None:
            engine = make_vllm_engine(self.model_dir)
            await engine.start()
            self.engine = engine
        return self.engine

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.aclose()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def session_engine(tiny_model: Path) -> AsyncIterator[SessionEngine]:
    holder = SessionEngine(tiny_model)
    yield holder
    await holder.close()


@pytest_asyncio.fixture(loop_scope="session")
async def vllm_engine(session_engine: SessionEngine) -> InProcessVLLMEngine | VLLMEngine:
    """The session's engine. It runs in the session event loop, which the async tests share (pyproject
    sets both default loop scopes to ``session``), and is shut down when the session ends. Tests of the
    async engine itself share one started in ``tests/engines/conftest.py``."""
    return await session_engine.get()


@pytest_asyncio.fixture(loop_scope="session")
async def no_session_engine(session_engine: SessionEngine) -> None:
    """No session engine runs during the test: it starts an in-process vLLM engine of its own."""
    await session_engine.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_cluster_tests_last(items)
