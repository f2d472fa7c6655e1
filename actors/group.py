"""Several fleets in one job, started and stopped together.

Typical RL layout: a policy fleet (hybrid or standalone, takes weight updates) beside a
reward-model fleet (colocated: fixed weights). ``FleetGroup`` owns them, on one event loop,
and shuts all of them down if any fails to start.

    async with FleetGroup({"policy": FleetConfig(engine="vllm", mode="hybrid", ...),
                           "reward": FleetConfig(engine="torch", mode="colocated", ...)}) as group:
        rollouts = await group["policy"].client().generate(...)
        scores = await group["reward"].client().generate(...)
"""

from __future__ import annotations

import asyncio
from typing import Any

from .config import FleetConfig
from .supervisor import Supervisor

__all__ = ["FleetGroup"]


class FleetGroup:
    def __init__(self, configs: dict[str, FleetConfig]):
        if not configs:
            raise ValueError("a FleetGroup needs at least one fleet")
        self.fleets = {name: Supervisor(cfg) for name, cfg in configs.items()}

    def __getitem__(self, name: str) -> Supervisor:
        return self.fleets[name]

    async def start(self) -> None:
        """Start every fleet concurrently; if one fails, or the start is cancelled, stop them all
        and raise its error (or the cancellation)."""
        try:
            results = await asyncio.gather(*(f.start() for f in self.fleets.values()), return_exceptions=True)
        except BaseException:  # cancelled (a timeout around it, Ctrl-C): those already up are stopped too
            await asyncio.shield(self.shutdown())
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]

    async def shutdown(self) -> None:
        await asyncio.gather(*(f.shutdown() for f in self.fleets.values()), return_exceptions=True)

    async def stats(self) -> dict[str, Any]:
        return {name: await f.stats() for name, f in self.fleets.items()}

    async def __aenter__(self) -> "FleetGroup":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()
