"""Configuration of a fleet, owned by the Supervisor."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..engines import ENGINE_NAMES, check_engine_options
from ..fielddoc import document_fields
from ..transport.auth import check_bind
from ..transport.sockets import split_host_port

__all__ = ["FleetConfig", "RestartPolicy", "DEVICE_ENV_VARS", "MODES"]

# hybrid: engines share the trainer's devices; they sleep while it trains; weights over
#         cuda_ipc (or shm on CPU / NPUs without IPC).
# standalone: engines on their own devices or hosts; weights over the collective transport.
# colocated: no weight sync at all (a reward model, a judge, a frozen reference policy).
MODES = ("hybrid", "standalone", "colocated")

# Variables that select a device for a worker process, by accelerator kind.
DEVICE_ENV_VARS = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "rocm": "HIP_VISIBLE_DEVICES",
}


def _int_field(owner: str, name: str, value: Any, low: int, *, none: bool = False) -> None:
    """An int (not a bool) >= low, or None where ``none``: else ValueError naming the field."""
    if (value is None and none) or (type(value) is int and value >= low):
        return
    raise ValueError(f"{owner}.{name} must be an int >= {low}{' or None' if none else ''}, got {value!r}")


def _real_field(owner: str, name: str, value: Any, *, none: bool = False) -> None:
    """A real number (an int or a float, not a bool), or None where ``none``; its range is the
    caller's to check."""
    if (value is None and none) or type(value) in (int, float):
        return
    raise ValueError(f"{owner}.{name} must be a number{' or None' if none else ''}, got {value!r}")


def _check_address(name: str, addr: Any) -> None:
    """What a worker or a client can reach: tcp://HOST:PORT (PORT 0..65535, 0 or * for any free
    one) or ipc://PATH."""
    if not isinstance(addr, str):
        raise ValueError(f"FleetConfig.{name} must be a str (tcp://HOST:PORT or ipc://PATH) or None, got {addr!r}")
    scheme, sep, rest = addr.partition("://")
    if sep and scheme == "ipc" and rest:
        return
    if sep and scheme == "tcp" and rest == rest.strip() and split_host_port(rest, any_port=True) is not None:
        return
    raise ValueError(f"FleetConfig.{name} must be tcp://HOST:PORT with a port in 0..65535 (0: a free one) or "
                     f"ipc://PATH, got {addr!r}")


@document_fields
@dataclass(kw_only=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5
    """Most restarts of one worker within ``window_s``; beyond that it stays dead."""
    window_s: float = 300.0
    """Length of the sliding window for max_restarts."""
    backoff_s: float = 0.5
    """Delay before the first restart; doubles with each restart in the window."""
    max_backoff_s: float = 10.0
    """Upper bound of the delay (it wins over a larger backoff_s)."""

    def __post_init__(self) -> None:
        _int_field("RestartPolicy", "max_restarts", self.max_restarts, 0)
        for name in ("window_s", "backoff_s", "max_backoff_s"):
            _real_field("RestartPolicy", name, getattr(self, name))
        if not (self.window_s > 0 and self.backoff_s >= 0 and self.max_backoff_s >= 0):  # NaN refused
            raise ValueError(f"RestartPolicy: window_s must be > 0 and backoffs >= 0, got window_s={self.window_s}, "
                             f"backoff_s={self.backoff_s}, max_backoff_s={self.max_backoff_s}")


HEARTBEAT_INTERVAL_S = 1.0
"""FleetConfig.heartbeat_interval_s's default: how often a worker sends a heartbeat."""

REPORT_INTERVAL_S = 0.5
"""FleetConfig.report_interval_s's default: how often a worker reports its running requests' new
tokens (those not streamed)."""


@document_fields
@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """Everything a Supervisor needs to run a fleet; each field is documented where it is
    declared (``help(FleetConfig)`` lists them). Bad values are refused here with ValueError,
    engine options and weight settings included, before any worker starts."""

    engine: str = "torch"
    """Engine of every worker: echo, torch, vllm or sglang."""
    mode: str = "hybrid"
    """Deployment mode: hybrid, standalone or colocated (see MODES)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the engine adapter (model path, dtype, ...)."""
    num_workers: int = 1
    """Worker processes to start."""
    devices: list[str] | None = None
    """Device of each worker, e.g. ['cuda:0', 'cuda:1'] or ['cpu']*2; None: cpu."""
    worker_addr: str | None = None
    """Address the worker socket binds; None: ipc:// in the private directory."""
    frontend_addr: str | None = "tcp://127.0.0.1:0"
    """Client-facing ROUTER address; None disables it. Port 0 picks a free port. Anything but
    loopback requires ``curve_keys_dir``."""
    curve_keys_dir: str | None = None
    """Directory made by ``rollfleet keys``: turns on CurveZMQ encryption and authentication
    on every tcp:// socket (required for non-loopback addresses)."""
    start_timeout_s: float = 120.0
    """How long a worker may take to start its engine and register."""
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    """How often workers send heartbeats."""
    report_interval_s: float = REPORT_INTERVAL_S
    """How often a worker reports the new tokens of requests that are not streamed (all of them
    in one message): the partial output a request resumes from if its worker dies. Longer means
    less work for the supervisor with many requests running, and more tokens made again after a
    worker's death. Each report costs the supervisor's loop a few microseconds per running
    request: 1,024 requests running took 0.05-0.08 of its core reported every 0.05 s and
    0.02-0.035 every 0.5 s (bench_scaling.py, its running section, on a 2-core VM and H200 hosts)."""
    heartbeat_timeout_s: float = 30.0
    """A worker silent this long is considered hung and is killed (silence counts only while
    the supervisor runs: a supervisor stopped meanwhile, e.g. a suspended job, does not count it)."""
    shutdown_timeout_s: float = 10.0
    """Grace period for workers to exit before they are terminated, then killed."""
    call_timeout_s: float = 60.0
    """Timeout of control calls to workers (stats, sleep, ...)."""
    resume: bool = True
    """Default for requests: resume after a weight update or a dead worker (else hard abort)."""
    max_resume_attempts: int = 64
    """Most times one request is interrupted and resumed before it fails with ResumeExhausted
    (RL jobs update weights often: a long rollout may see many updates)."""
    max_inflight_per_client: int = 100_000
    """Requests one client may have in flight; more are refused with 'overloaded'. The
    in-process clients of a fleet (fleet.client(), SyncClient) count as one client, as they
    share request ids and abort_all; each RemoteClient (each frontend connection) is one."""
    restart: RestartPolicy | None = field(default_factory=RestartPolicy)
    """How dead workers are restarted; None: never."""
    max_message_bytes: int = 1 << 30
    """Largest message accepted on any socket."""
    max_client_message_bytes: int = 64 << 20
    """Largest message header a client may send (a larger one is answered too_large without
    being decoded): decoding one blocks the supervisor's loop, some 25 ms per MiB of token
    ids on a 2-core VM (decoded, checked and sent on: 0.4 s for 17 MiB). 64 MiB holds prompts
    of over 10 million tokens. A value above ``max_message_bytes`` is taken as that: a bigger
    frame never reaches the fleet (ZeroMQ drops its sender)."""
    client_send_hwm: int = 100_000
    """Most messages waiting to go out to one client (a batch counts once). A client with
    more waiting (it stopped reading, or reads more slowly than its answers come: a burst of
    answers can fill the queue before ZeroMQ empties it) is treated as gone: its requests are
    cancelled on the workers (no more is sent for them) and stats count it under
    ``dropped_frames['slow_client']``.
    0: no limit (its answers then pile up in the supervisor's memory for as long as it
    does not read)."""
    max_sticky: int = 65536
    """Session ids remembered for sticky routing (LRU); requests without a session take none."""
    deterministic_routing: bool = False
    """Tie-break by worker order instead of randomly (tests)."""
    private_dir_root: str | None = None
    """An existing directory, where the fleet's private directory is created; None: the system temp dir."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for worker processes."""
    worker_nice: int = 0
    """Niceness the worker processes add to this one's (0..19; their engines' own processes
    inherit it). Where workers share cores with the supervisor (CPU engines, more workers than
    cores), a few points keep its event loop from waiting behind them for a core: on a 2-core
    machine with 16 engine-paced workers, 10 halved the time a request spent outside its worker
    (bench_scaling's ``--paced-worker-nice``). 0: as this process."""
    weights: dict[str, Any] = field(default_factory=dict)
    """Weight transfer settings (weights.WeightSyncConfig fields: bucket_bytes, transport, ...)."""
    keep_last_weights: bool = True
    """Keep a CPU copy of every tensor updates sent, each as last sent, so a restarted worker
    (or one a failed update left with part of its tensors) can be brought to the current
    version: its initial weights plus these, partial and empty updates included. Turn off for
    big models and pass update_weights a callable that yields all the tensors instead: with
    neither, such a worker serves its initial weights (version 0, as its results say) until
    an update that sends again every tensor sent before it; one that does not restarts it
    again (it would hold a mix of its initial weights and that update)."""
    stall_timeout_s: float | None = None
    """A running request that gets no token for this long while its worker still heartbeats
    means a stuck engine: the worker is killed and restarted and its requests resume. Set
    it above the longest legitimate wait (queueing in a full engine, a long prefill); checks
    pause while the engines are paused or asleep. None: off."""
    accept_remote_workers: bool = False
    """Also serve workers that node agents on other hosts start (actors.node): a worker the
    supervisor did not spawn is admitted when it connects over CurveZMQ with a key admitted
    through ``Supervisor.allow_worker_key`` (node.publish_router does that from the job's
    store) and registers an id of the form ``<node>/<slot>-<generation>``. Needs a tcp://
    ``worker_addr`` and ``curve_keys_dir``. Their node agents restart them, not the supervisor."""
    keep_dead_remote_slots: int = 64
    """How many slots of remote workers that are gone stats keeps (state ``dead``), those
    that died last; older ones are forgotten, and a worker that registers in a forgotten slot
    later takes a new index. A node agent started again fills new slots, so without a bound a
    long-served fleet would keep a row for every worker of every agent it ever had."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1 at this port (0: a free one, see
    Supervisor.metrics_address); needs prometheus-client. None: off."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.engine not in ENGINE_NAMES:
            raise ValueError(f"engine must be one of {ENGINE_NAMES}, got {self.engine!r}")
        check_engine_options(self.engine, self.engine_options)
        if self.engine in ("vllm", "sglang") and not (self.engine_options or {}).get("model"):
            raise ValueError(f"the {self.engine} engine needs engine_options['model'] (a model directory or name)")
        if self.devices is not None and len(self.devices) != self.num_workers:
            raise ValueError(f"devices has {len(self.devices)} entries for {self.num_workers} workers")
        for name in ("start_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "call_timeout_s",
                     "report_interval_s"):
            if not getattr(self, name) > 0:  # NaN included
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        if not self.shutdown_timeout_s >= 0:  # 0: terminate at once; NaN refused
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if type(self.worker_nice) is not int or not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice must be an int in 0..19, got {self.worker_nice!r}")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 or None, got {self.stall_timeout_s}")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 2 * self.report_interval_s:
            # a request that is not streamed gets its tokens once per report_interval_s
            raise ValueError(f"stall_timeout_s ({self.stall_timeout_s}) must exceed twice report_interval_s "
                             f"({self.report_interval_s}): tokens that are not streamed come once per report")
        if self.accept_remote_workers and not (self.curve_keys_dir and (self.worker_addr or "").startswith("tcp://")):
            raise ValueError("accept_remote_workers needs a tcp:// worker_addr and curve_keys_dir")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 or None, got {self.metrics_port}")
        for name in ("curve_keys_dir", "private_dir_root"):  # at start they would be a FileNotFoundError
            path = getattr(self, name)
            if path is not None and not os.path.isdir(path):
                hint = " (`rollfleet keys DIR` makes one)" if name == "curve_keys_dir" else ""
                raise ValueError(f"FleetConfig.{name} must be an existing directory or None, got {path!r}{hint}")
        for name in ("worker_addr", "frontend_addr"):
            addr = getattr(self, name)
            if addr:
                _check_address(name, addr)
                check_bind(addr, self.curve_keys_dir)  # a non-loopback address needs CurveZMQ keys
        from ..weights.config import WeightSyncConfig

        try:  # checked now, not at the first update
            WeightSyncConfig(**self.weights)
        except (TypeError, ValueError) as exc:  # TypeError: a key that is not one of its fields
            raise ValueError(f"weights (the fields of weights.WeightSyncConfig): {exc}") from None

    def _check_types(self) -> None:
        """Each field's type, before any check of its value: a wrong one is a ValueError that
        names the field, not a TypeError of a comparison (or, later, of a worker's start)."""
        for name in ("engine", "mode"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"FleetConfig.{name} must be a str, got {getattr(self, name)!r}")
        for name, low in (("num_workers", 1), ("max_resume_attempts", 0), ("max_inflight_per_client", 1),
                          ("max_message_bytes", 1024), ("max_client_message_bytes", 1024), ("client_send_hwm", 0),
                          ("max_sticky", 0), ("keep_dead_remote_slots", 0)):
            _int_field("FleetConfig", name, getattr(self, name), low)
        _int_field("FleetConfig", "metrics_port", self.metrics_port, 0, none=True)
        for name in ("start_timeout_s", "heartbeat_interval_s", "report_interval_s", "heartbeat_timeout_s",
                     "shutdown_timeout_s", "call_timeout_s", "stall_timeout_s"):
            _real_field("FleetConfig", name, getattr(self, name), none=name == "stall_timeout_s")
        for name in ("resume", "deterministic_routing", "keep_last_weights", "accept_remote_workers"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"FleetConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("curve_keys_dir", "private_dir_root"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"FleetConfig.{name} must be a directory's path (a str) or None, "
                                 f"got {getattr(self, name)!r}")
        for name in ("engine_options", "weights"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"FleetConfig.{name} must be a dict, got {getattr(self, name)!r}")
        env = self.worker_env
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError(f"FleetConfig.worker_env must be a dict of str to str, got {env!r}")
        if self.devices is not None and (isinstance(self.devices, str) or not isinstance(self.devices, (list, tuple))
                                         or not all(isinstance(d, str) for d in self.devices)):
            raise ValueError(f"FleetConfig.devices must be a list of str (one per worker, e.g. ['cuda:0']) or None, "
                             f"got {self.devices!r}")
        if self.restart is not None and not isinstance(self.restart, RestartPolicy):
            raise ValueError(f"FleetConfig.restart must be a RestartPolicy or None, got {self.restart!r}")

    def weight_transport(self) -> str:
        """The transport weight updates use unless a call overrides it."""
        explicit = self.weights.get("transport")
        if explicit:
            return str(explicit)
        return "collective" if self.mode == "standalone" else "auto"

    def device_of(self, index: int) -> str:
        return self.devices[index] if self.devices else "cpu"
