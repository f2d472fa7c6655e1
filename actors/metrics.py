"""Observability helpers of the Supervisor: rate-limited drop logs and a Prometheus exporter.

``LogLimiter`` keeps a flood of bad frames (a fuzzer, a buggy peer) from turning into a
flood of log lines: per kind of event it logs the first few lines of each interval, then
one line with the number it held back. It also counts every event, for stats and metrics.

``MetricsExporter`` serves the fleet's numbers on a loopback port for Prometheus. The
supervisor's loop hands it a snapshot (plain dicts) once per monitor tick; the HTTP server
thread only reads the latest snapshot, so a scrape never touches live tables from another
thread. prometheus-client is optional (``rollfleet[metrics]``) and imported only here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["LogLimiter", "MetricsExporter"]

logger = logging.getLogger(__name__)


class LogLimiter:
    """Counts events by kind and logs at most ``burst`` lines per kind per ``interval_s``."""

    def __init__(self, log: logging.Logger, *, burst: int = 5, interval_s: float = 5.0):
        if burst < 0 or interval_s <= 0:
            raise ValueError("burst must be >= 0 and interval_s > 0")
        self.log_to = log
        self.burst = burst
        self.interval_s = interval_s
        self.counts: dict[str, int] = {}
        """Every event so far, by kind (logged or not)."""
        self._windows: dict[str, list[Any]] = {}  # kind -> [start, lines logged, held back, level]

    def log(self, kind: str, level: int, msg: str, *args: Any) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        window = self._windows.get(kind)
        if window is None or now - window[0] >= self.interval_s:
            if window is not None:
                self._summarize(kind, window, now)
            window = self._windows[kind] = [now, 0, 0, level]
        if window[1] < self.burst:
            window[1] += 1
            self.log_to.log(level, msg, *args, stacklevel=2)  # name the caller, not this helper
        else:
            window[2] += 1

    def flush(self) -> None:
        """Log the held-back counts of windows that have ended (call it now and then)."""
        now = time.monotonic()
        for kind, window in list(self._windows.items()):
            if now - window[0] >= self.interval_s:
                self._summarize(kind, window, now)
                del self._windows[kind]

    def _summarize(self, kind: str, window: list[Any], now: float) -> None:
        if window[2]:
            self.log_to.log(window[3], "%d more %s events in the last %.1fs (not logged one by one)",
                            window[2], kind, now - window[0])


class MetricsExporter:
    """Prometheus text endpoint at ``address`` (``http://127.0.0.1:PORT/metrics``).

    Raises RuntimeError when prometheus-client is not installed, OSError when the port
    is taken.
    """

    def __init__(self, port: int, host: str = "127.0.0.1"):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as exc:
            raise RuntimeError("metrics_port needs prometheus-client: pip install 'rollfleet[metrics]'") from exc
        self._snapshot: tuple[list[dict[str, Any]], dict[str, Any]] = ([], {})
        # A registry of our own: several fleets in one process must not collide in the global one.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # say which of the fleet's ports it was
            raise OSError(exc.errno, f"metrics port {host}:{port}: {exc.strerror}") from exc
        self.port = int(self._server.server_port)
        self.address = f"http://{host}:{self.port}/metrics"
        logger.info("prometheus metrics at %s", self.address)

    def update(self, stats: dict[str, Any]) -> None:
        """Replace the snapshot with a ``Supervisor.stats(engines=False)`` map."""
        self._snapshot = (list(stats.get("workers", [])), dict(stats))  # one assignment: atomic for readers

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # prometheus_client calls this from its server thread on every scrape.
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        workers, fleet = self._snapshot
        # Series are labelled by slot, not worker id: a restart must not start a new series.
        labels = ["worker", "device"]
        up = GaugeMetricFamily("rollfleet_worker_up", "1 when the worker serves requests", labels=labels)
        state = GaugeMetricFamily("rollfleet_worker_state", "1 for the worker's current state",
                                  labels=[*labels, "state"])
        inflight = GaugeMetricFamily("rollfleet_worker_inflight", "Requests running on the worker", labels=labels)
        tokens = CounterMetricFamily("rollfleet_worker_tokens", "Tokens generated by the worker's current process",
                                     labels=labels)
        version = GaugeMetricFamily("rollfleet_worker_weight_version", "Weight version the worker holds",
                                    labels=labels)
        restarts = CounterMetricFamily("rollfleet_worker_restarts", "Restarts of the worker slot", labels=labels)
        info = InfoMetricFamily("rollfleet_worker", "Identity (process, host) and last error of the worker",
                                labels=labels)
        for w in workers:
            key = [str(w.get("index", "")), str(w.get("device", ""))]
            current = str(w.get("state", ""))
            up.add_metric(key, 1.0 if current == "ready" else 0.0)
            for name in ("starting", "ready", "dead"):
                state.add_metric([*key, name], 1.0 if current == name else 0.0)
            inflight.add_metric(key, float(w.get("num_inflight", 0)))
            tokens.add_metric(key, float(w.get("num_tokens", 0)))
            version.add_metric(key, float(w.get("weight_version", 0)))
            restarts.add_metric(key, float(w.get("restarts", 0)))
            info.add_metric(key, {"worker_id": str(w.get("worker_id", "")), "pid": str(w.get("pid", "")),
                                  "host": str(w.get("host", "")), "last_error": str(w.get("last_error", ""))[:200]})
        yield from (up, state, inflight, tokens, version, restarts, info)
        if not fleet:
            return
        yield _gauge("rollfleet_inflight", "Requests in flight (running or waiting)", fleet.get("num_inflight", 0))
        yield _gauge("rollfleet_pending", "Requests waiting for a worker", fleet.get("num_pending", 0))
        yield _gauge("rollfleet_workers_ready", "Workers serving requests", fleet.get("num_workers", 0))
        yield _gauge("rollfleet_weight_version", "The fleet's weight version", fleet.get("weight_version", 0))
        yield _gauge("rollfleet_sleep_level", "Level of the sleep in force (0: awake)", fleet.get("sleep_level", 0))
        outcomes = CounterMetricFamily("rollfleet_requests", "Requests by outcome; 'resumed' counts resumptions",
                                       labels=["outcome"])
        for name in ("completed", "aborted", "failed", "resumed", "cancelled"):
            outcomes.add_metric([name], float(fleet.get(f"num_{name}", 0)))
        yield outcomes
        dropped = CounterMetricFamily("rollfleet_dropped_frames", "Frames refused or dropped, by kind",
                                      labels=["kind"])
        for kind, count in sorted(dict(fleet.get("dropped_frames") or {}).items()):
            dropped.add_metric([kind], float(count))
        yield dropped


def _gauge(name: str, doc: str, value: Any) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, value=float(value))
