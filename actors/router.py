"""Which worker gets a request: pure policy, no I/O.

Sticky first: a session id already seen goes back to the worker that served it (its
KV/prefix cache is warm there), while that worker is available; a request without one may
prefer a worker (the one a resumed request ran on). Otherwise the available worker with the
fewest requests in flight. Ties go to the first worker in
registration order in deterministic mode, else to a random one of the tied workers, so
that bursts spread out instead of piling onto worker 0.
"""

from __future__ import annotations

import random
from collections import OrderedDict

__all__ = ["Router"]


class Router:
    def __init__(self, *, max_sticky: int = 65536, deterministic: bool = False, seed: int | None = None):
        if max_sticky < 0:
            raise ValueError(f"max_sticky must be >= 0, got {max_sticky}")
        self.max_sticky = max_sticky
        self.deterministic = deterministic
        self._rng = random.Random(seed)
        self._load: dict[str, int] = {}  # worker id -> requests in flight (insertion = registration order)
        self._available: set[str] = set()
        self._sticky: OrderedDict[str, str] = OrderedDict()  # key -> worker id, LRU order

    # -- membership
    def add_worker(self, worker_id: str) -> None:
        self._load.setdefault(worker_id, 0)
        self._available.add(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (dead); its sticky keys fall back to least-loaded."""
        self._load.pop(worker_id, None)
        self._available.discard(worker_id)

    def set_available(self, worker_id: str, available: bool) -> None:
        if worker_id not in self._load:
            return
        if available:
            self._available.add(worker_id)
        else:
            self._available.discard(worker_id)

    @property
    def workers(self) -> list[str]:
        return list(self._load)

    def load(self, worker_id: str) -> int:
        return self._load.get(worker_id, 0)

    # -- policy
    def choose(self, key: str | None = None, exclude: frozenset[str] | set[str] = frozenset(),
               prefer: str | None = None) -> str | None:
        """The worker for a request keyed by ``key`` (its session id), remembered for the next
        one; or, without a key, ``prefer`` while it is available. None if none is available."""
        if key is not None:
            worker = self._sticky.get(key)
            if worker is not None and worker in self._available and worker not in exclude:
                self._sticky.move_to_end(key)
                return worker
        elif prefer is not None and prefer in self._available and prefer not in exclude:
            return prefer
        best: list[str] = []
        best_load = -1
        for worker, load in self._load.items():
            if worker not in self._available or worker in exclude:
                continue
            if best_load < 0 or load < best_load:
                best, best_load = [worker], load
            elif load == best_load:
                best.append(worker)
        if not best:
            return None
        worker = best[0] if self.deterministic or len(best) == 1 else self._rng.choice(best)
        if key is not None and self.max_sticky:
            self._sticky[key] = worker
            self._sticky.move_to_end(key)
            if len(self._sticky) > self.max_sticky:
                self._sticky.popitem(last=False)
        return worker

    def on_dispatch(self, worker_id: str) -> None:
        if worker_id in self._load:
            self._load[worker_id] += 1

    def on_finish(self, worker_id: str) -> None:
        if self._load.get(worker_id, 0) > 0:
            self._load[worker_id] -= 1

    def forget(self, key: str) -> None:
        self._sticky.pop(key, None)

    @property
    def num_sticky(self) -> int:
        return len(self._sticky)
