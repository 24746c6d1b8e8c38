"""The engines a chaos run shares across its scenarios: starting vLLM costs tens of seconds, a
scenario a few."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gym_resilience.engines import Engine
from harness.scenario.compile import CompiledScenario

__all__ = ["Bench"]


@dataclass
class _Served:
    servers: list[Any]

    def kill(self, index: int) -> None:
        self.servers[index].kill()

    async def revive(self) -> None:
        for server in self.servers:
            if not server.is_running:
                server.start()
        for server in self.servers:
            await asyncio.to_thread(server.wait_healthy)


@dataclass
class Bench:
    """The engines a run shares, keyed by what they serve: in-process vLLM engines by (model folder,
    context length), served vLLM servers by (count, model folder, context length). Endpoints the user
    runs are not started here. A killed server is started again when the next scenario needs it.
    """

    device: Literal["cpu", "cuda"] = "cpu"
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _local: dict[tuple[Path, int], Engine] = field(default_factory=dict)
    _served: dict[tuple[int, Path, int], _Served] = field(default_factory=dict)
    _tiny_model: Path | None = None

    def model_dir(self, scenario: CompiledScenario) -> Path:
        """The model folder ``scenario`` runs on: its own, or the bundled tiny model (built once)."""
        if scenario.model_dir is not None:
            return scenario.model_dir
        if self._tiny_model is None:
            from gym_resilience.models import build_tiny_model

            self._tiny_model = build_tiny_model()
        return self._tiny_model

    async def local(self, model_dir: Path, max_model_len: int) -> Engine:
        key = (model_dir, max_model_len)
        if key not in self._local:
            from gym_resilience.engines import make_vllm_engine

            # In-process on CPU: it starts in a third of the time of vLLM's async engine (README).
            engine = make_vllm_engine(model_dir, device=self.device, max_model_len=max_model_len)
            self._local[key] = await self._stack.enter_async_context(engine)
        return self._local[key]

    async def served(self, servers: int, model_dir: Path, max_model_len: int) -> _Served:
        key = (servers, model_dir, max_model_len)
        if key not in self._served:
            from gym_resilience.engines.vllm_server import servers as start_servers

            pool = await self._stack.enter_async_context(
                start_servers(servers, model_dir, device=self.device, max_model_len=max_model_len)
            )
            self._served[key] = _Served(list(pool))
        served = self._served[key]
        await served.revive()
        return served

    async def aclose(self) -> None:
        await self._stack.aclose()
