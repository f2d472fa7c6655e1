"""The runtime: Supervisor, EngineWorker, Router, InflightTable and clients.

Each name (and each module of the package) is imported when first used, not with the package:
a worker process starts from ``actors.boot``, which must run before asyncio, ZeroMQ and the
rest are imported.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client import LLMClient as LLMClient
    from .client import RemoteClient as RemoteClient
    from .config import MODES as MODES
    from .config import FleetConfig as FleetConfig
    from .config import RestartPolicy as RestartPolicy
    from .group import FleetGroup as FleetGroup
    from .inflight import Entry as Entry
    from .inflight import InflightTable as InflightTable
    from .inflight import State as State
    from .result import GenerationResult as GenerationResult
    from .result import StreamChunk as StreamChunk
    from .router import Router as Router
    from .supervisor import Supervisor as Supervisor
    from .sync_client import SyncClient as SyncClient

__all__ = [
    "Supervisor",
    "FleetConfig",
    "FleetGroup",
    "MODES",
    "RestartPolicy",
    "LLMClient",
    "RemoteClient",
    "SyncClient",
    "GenerationResult",
    "StreamChunk",
    "Router",
    "InflightTable",
    "Entry",
    "State",
]

_HOME = {
    "Supervisor": "supervisor", "FleetConfig": "config", "FleetGroup": "group", "MODES": "config",
    "RestartPolicy": "config", "LLMClient": "client", "RemoteClient": "client", "SyncClient": "sync_client",
    "GenerationResult": "result", "StreamChunk": "result", "Router": "router", "InflightTable": "inflight",
    "Entry": "inflight", "State": "inflight",
}
_modules: frozenset[str] | None = None


def _module_names() -> frozenset[str]:
    """The package's modules, read from its directory once (a name that is no module costs a look)."""
    global _modules
    if _modules is None:
        import pkgutil

        _modules = frozenset(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return _modules


if not TYPE_CHECKING:  # (to a type checker, a name missing here stays an error)
    def __getattr__(name: str):
        if name in _module_names():  # rollfleet.actors.supervisor, with only rollfleet.actors imported
            return _importlib.import_module(f".{name}", __name__)
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value  # once: the next lookup is a plain one
        return value

    def __dir__():
        return sorted(set(globals()) | set(__all__) | _module_names())
