"""The runtime: Supervisor, EngineWorker, Router, InflightTable and clients."""

from .client import LLMClient, RemoteClient
from .config import MODES, FleetConfig, RestartPolicy
from .group import FleetGroup
from .inflight import Entry, InflightTable, State
from .result import GenerationResult, StreamChunk
from .router import Router
from .supervisor import Supervisor
from .sync_client import SyncClient

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
