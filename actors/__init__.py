"""The runtime: Supervisor, EngineWorker, Router, InflightTable and clients.

Each name is imported from its module when first used, not with the package: a worker process
starts from ``actors.boot``, which must run before asyncio, ZeroMQ and the rest are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import LLMClient, RemoteClient
    from .config import MODES, FleetConfig, RestartPolicy
    from .group import FleetGroup
    from .inflight import Entry, InflightTable, State
    from .result import GenerationResult, StreamChunk
    from .router import Router
    from .supervisor import Supervisor
    from .sync_client import SyncClient

_MODULES = {
    "Supervisor": "supervisor",
    "FleetConfig": "config",
    "FleetGroup": "group",
    "MODES": "config",
    "RestartPolicy": "config",
    "LLMClient": "client",
    "RemoteClient": "client",
    "SyncClient": "sync_client",
    "GenerationResult": "result",
    "StreamChunk": "result",
    "Router": "router",
    "InflightTable": "inflight",
    "Entry": "inflight",
    "State": "inflight",
}

__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
