"""Helpers shared by every bench script: arguments, machine facts, tables, JSON, percentiles.

How bench scripts import this module: ``bench/`` is not a package. Run a script by its path,
``python bench/bench_rpc.py`` (from the repository root or anywhere else); Python then puts
the script's own folder first on ``sys.path``, so a plain ``from common import ...`` finds
this file whatever the working directory. Scripts started some other way (``runpy``, a
test importing them) should put ``bench/`` on ``sys.path`` first.

Every script takes ``--quick`` (a short run: 5 s to 3 minutes on a 2-core machine),
``--json PATH`` (a flat object of named metrics: numbers, booleans, strings) and
``--png PATH`` (defaults to the JSON path with a ``.png`` suffix when ``--json`` is given).

Every script's JSON also carries the machine facts of ``machine_info()``, the keys listed in
``MACHINE_KEYS``: ``machine_cores`` (cores this process may run on), ``machine_memory_gb``,
``machine_cpu`` (the CPU model), ``machine_gpu`` ("none", or the number of CUDA devices and
the first one's name), ``machine_os``, ``machine_python`` and ``machine_load_1m`` (the
1-minute load average when it was read, -1.0 where the OS has none). Measurements whose
names also start with ``machine_`` (bench_scaling's ``machine_busy_{n}w``) are not among them.

Every script calls ``stop_signals()`` before its heavy imports, runs its coroutines with
``run_loop`` and its ``main`` through ``run_main``: SIGINT (Ctrl-C), SIGTERM and SIGHUP then end
it like an exception (a cancelled coroutine inside ``run_loop``), so its ``finally`` and ``with``
blocks run (temporary directories, fleets, child processes), and it exits 128 + the signal's
number with one line on stderr. A script's own child processes call ``stop_signals(child=True)``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib.util
import json
import logging
import math
import os
import platform
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

__all__ = [
    "MACHINE_KEYS",
    "OneLineParser",
    "bench_parser",
    "finite_float",
    "quick_defaults",
    "png_path",
    "machine_info",
    "percentile",
    "summarize",
    "print_table",
    "write_json",
    "plot_cdfs_and_bars",
    "CHILD_ENV",
    "STOP_SIGNALS",
    "child_env",
    "stop_signals",
    "stopped_by",
    "run_main",
    "run_loop",
]


CHILD_ENV = "ROLLFLEET_BENCH_CHILD"
"""Set to "1" in the environment of a bench script's own child processes (``child_env()``), so
that ``stop_signals()`` treats them as children from their first line on."""
ENGINES_SATURATED = 0.9  # of paced engines' capacity: delivered that, they were the limit
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_stopped_by: int | None = None  # the signal that is stopping this process, once one came
_quiet = False  # a child process: its parent says what happened
_main_task: asyncio.Task | None = None  # run_loop's coroutine, while it runs


def _say_stopped() -> None:
    name = os.path.basename(sys.argv[0]) or "bench"
    print(f"{name}: stopped by {signal.Signals(_stopped_by).name}; cleaned up", file=sys.stderr, flush=True)


def _on_stop_signal(signum: int, _frame: Any) -> None:
    global _stopped_by
    if _stopped_by is not None:
        return  # already stopping: a second Ctrl-C must not cut the cleanup short (SIGKILL still does)
    _stopped_by = signum
    # The fleet's complaints about workers that the same signal stopped are noise now.
    logging.disable(logging.ERROR)
    if not _quiet:
        atexit.register(_say_stopped)  # also when the signal ends the script while it imports
    task = _main_task
    if task is not None:
        # Inside run_loop: cancel its coroutine, as asyncio.run does on Ctrl-C, so the stop comes
        # at an await and every ``async with`` (fleets, child processes) closes in order; an
        # exception raised here could land in the middle of a library's callback instead, or
        # cut short the loop's own shutdown once the coroutine is done.
        if not task.done():
            task.cancel()
            task.get_loop().call_soon_threadsafe(lambda: None)  # wake the loop to see it
        return
    raise SystemExit(128 + signum)


def stop_signals(*, child: bool = False) -> None:
    """Stop cleanly on SIGINT, SIGTERM and SIGHUP, once: Python's default for SIGTERM and SIGHUP
    ends the process without running any ``finally``, so temporary directories and child
    processes stayed behind. A signal cancels ``run_loop``'s coroutine while one runs, else
    raises SystemExit(128 + signum) in the main thread; ``run_main`` turns either into the exit
    status. Call it first thing (scripts do, before their heavy imports).

    ``child=True``, or ``CHILD_ENV`` in the environment, is for a bench script's own child
    processes: they ignore SIGINT (a Ctrl-C reaches the whole process group; the parent stops its
    children as it cleans up, as rollfleet's workers are stopped by their supervisor) and stop
    quietly on SIGTERM and SIGHUP."""
    global _quiet
    _quiet = child = child or os.environ.get(CHILD_ENV) == "1"
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN if child and sig == signal.SIGINT else _on_stop_signal)


def child_env() -> dict[str, str]:
    """The environment for a child process of a bench script: this one, with ``CHILD_ENV``."""
    return dict(os.environ, **{CHILD_ENV: "1"})


def stopped_by() -> int | None:
    """The signal that is stopping this process, or None: cleanup code uses it to stop child
    processes at once rather than wait for them to finish their work."""
    return _stopped_by


def run_main(main: Any, *args: Any) -> int:
    """Run a script's ``main(*args)`` with ``stop_signals()`` in force (unless a child mode set
    them already); return its exit status.

    Stopped by a signal, whatever exception the stop surfaced as (the SystemExit, a
    CancelledError, or the error of a child process that was stopped first), it returns 128 +
    the signal's number (130 for Ctrl-C) with one line on stderr, and no traceback."""
    if signal.getsignal(signal.SIGTERM) is not _on_stop_signal:
        stop_signals()
    try:
        status = main(*args) or 0
    except BaseException:
        if _stopped_by is None:
            raise
    else:
        if _stopped_by is None:
            return status
    return 128 + _stopped_by


def run_loop(coro: Any, *, use_uvloop: bool = True) -> Any:
    """Run a coroutine to its end on uvloop where it is installed (as the CLI runs a fleet; and
    ``use_uvloop``), else on asyncio. A stop signal meanwhile cancels it (``stop_signals``)."""

    global _main_task

    async def main() -> Any:
        global _main_task
        _main_task = asyncio.current_task()
        return await coro

    run = asyncio.run
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # the fleet runs on plain asyncio too, only slower
            pass
        else:
            run = uvloop.run
    try:
        return run(main())
    finally:
        _main_task = None  # set until the loop has shut down: no signal may raise inside that


class OneLineParser(argparse.ArgumentParser):
    """Bad options: one line on stderr, ``prog: error: message``, and exit 2 (the usage is
    what --help is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser with the options every bench script shares; add your own before parsing."""
    parser = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="Short run (5 s to 3 minutes on a 2-core machine) for smoke tests.")
    parser.add_argument("--json", metavar="PATH", help="Write a flat JSON object of named metrics here.")
    parser.add_argument("--png", metavar="PATH",
                        help="Write a plot here (default: next to --json, with a .png suffix).")
    return parser


def finite_float(text: str) -> float:
    """An argparse type: a float that is neither nan nor infinite (``float()`` takes both, and
    a nan slips past every ``<=`` check: ``--duration nan`` once ran a soak of no requests that
    passed). Range checks stay with each script."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def quick_defaults(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> None:
    """Fill each option left unset (None) with its (``--quick``, full run) default; an option
    given on the command line, 0 included, stays as given."""
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def png_path(args: argparse.Namespace) -> str | None:
    """Where the plot goes: --png if given, else the --json path with a .png suffix, else None."""
    if getattr(args, "png", None):
        return args.png
    if getattr(args, "json", None):
        root, ext = os.path.splitext(args.json)
        return (root if ext.lower() == ".json" else args.json) + ".png"
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float:
    try:
        import psutil

        return psutil.virtual_memory().total / 2**30
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _gpu() -> str:
    # Only ask torch when it is installed: a bench without torch must not need it.
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return "none"
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    except Exception:  # a broken CUDA install should not stop a CPU benchmark
        pass
    return "none"


MACHINE_KEYS = ("machine_cores", "machine_memory_gb", "machine_cpu", "machine_gpu", "machine_os",
                "machine_python", "machine_load_1m")
"""The keys ``machine_info()`` writes, exactly: facts about the machine, not measurements.
report_md.py leaves these out of each script's table of metrics; its machines table and each
section's first line give the cores, memory, CPU, GPU and load average."""


def machine_info() -> dict[str, Any]:
    """Facts about this machine, as flat ``machine_*`` keys (``MACHINE_KEYS``) ready to merge
    into the metrics."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    info = {
        "machine_cores": usable,
        "machine_memory_gb": round(_memory_gb(), 1),
        "machine_cpu": _cpu_model(),
        "machine_gpu": _gpu(),
        "machine_os": platform.platform(terse=True),
        "machine_python": platform.python_version(),
        # Other work on the machine shows up as latency tails; record how busy it was.
        "machine_load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0,
    }
    assert tuple(info) == MACHINE_KEYS, "MACHINE_KEYS must name exactly the keys written here"
    return info


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's
    default. Raises ValueError on an empty sequence or q outside [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99, mean, min and max of a sample."""
    ordered = sorted(values)
    return {
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "mean": sum(ordered) / len(ordered),
        "min": ordered[0],
        "max": ordered[-1],
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
                file: Any = None) -> None:
    """Print rows under headers in aligned columns: the first column left-aligned, the rest
    right-aligned (numbers line up); None prints as '-'."""
    out = file or sys.stdout
    body = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in body:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    if title:
        print(title, file=out)
    print("  ".join(h.ljust(widths[i]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(headers)),
          file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in body:
        print("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)),
              file=out)


def write_json(path: str, metrics: dict[str, Any]) -> None:
    """Write metrics as one flat JSON object (sorted keys).

    Raises ValueError when a value is not a scalar (number, bool, string or None) or a
    number is not finite, so a nested or broken result never reaches a dashboard.
    """
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric names must be strings, got {key!r}")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"metric {key!r} is not a scalar: {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"metric {key!r} is not finite: {value}")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=2, sort_keys=True)
        f.write("\n")


def plot_cdfs_and_bars(path: str, series: dict[str, Sequence[float]], bars: dict[str, float], *,
                       xlabel: str, left_title: str, right_title: str, ylabel: str = "requests / s") -> bool:
    """A PNG of two panels: the distribution (CDF, log x) of each named sample on the left,
    one bar per named value on the right. Returns False, writing nothing, when matplotlib
    is not installed (it is an optional extra: ``rollfleet[bench]``)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path}")
        return False
    matplotlib.use("Agg")  # no display: benches run on servers and in CI
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in series.items():
        ordered = sorted(values)
        left.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    left.set_xscale("log")
    left.set_xlabel(xlabel)
    left.set_ylabel("fraction of samples")
    left.set_title(left_title)
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    names = list(bars)
    right.bar(names, [bars[n] for n in names], color="tab:blue")
    for i, name in enumerate(names):
        right.text(i, bars[name], f"{bars[name]:,.0f}", ha="center", va="bottom")
    right.set_ylabel(ylabel)
    right.set_title(right_title)
    right.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def copy_gbps(weights, device: str, reps: int, threads: int | None = None) -> float:
    """One copy of the same bytes into preallocated tensors on ``device`` (best of reps)."""
    import time

    import torch  # here, not at the top: the scripts that need no copy start without torch

    dst = [torch.empty_like(t, device=device) for _, t in weights]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    best = 0.0
    try:
        for _ in range(reps + 1):  # the first pass faults the destination in
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for d, (_, t) in zip(dst, weights):
                d.copy_(t)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        torch.set_num_threads(before)
    return best


def memcpy_gbps(weights, reps: int) -> float:
    """The CPU copy baseline: the best at one thread or at torch's default (on a few shared
    cores, one thread often copies faster than several)."""
    return max(copy_gbps(weights, "cpu", reps, 1), copy_gbps(weights, "cpu", reps))
