"""The runtime: Supervisor, EngineWorker, Router, InflightTable and clients."""

from .client import LLMClient, RemoteClient
from .config import FleetConfig, RestartPolicy
from .inflight import Entry, InflightTable, State
from .result import GenerationResult, StreamChunk
from .router import Router
from .supervisor import Supervisor

__all__ = [
    "Supervisor",
    "FleetConfig",
    "RestartPolicy",
    "LLMClient",
    "RemoteClient",
    "GenerationResult",
    "StreamChunk",
    "Router",
    "InflightTable",
    "Entry",
    "State",
]
