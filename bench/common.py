"""Helpers shared by every bench script: arguments, machine facts, tables, JSON, percentiles.

How bench scripts import this module: ``bench/`` is not a package. Run a script by its path,
``python bench/bench_rpc.py`` (from the repository root or anywhere else); Python then puts
the script's own folder first on ``sys.path``, so a plain ``from common import ...`` finds
this file whatever the working directory. Scripts started some other way (``runpy``, a
test importing them) should put ``bench/`` on ``sys.path`` first.

Every script takes ``--quick`` (a short run: 15 s to 2 minutes on a 2-core machine),
``--json PATH`` (a flat object of named metrics: numbers, booleans, strings) and
``--png PATH`` (defaults to the JSON path with a ``.png`` suffix when ``--json`` is given).

Every script's JSON also carries the machine facts of ``machine_info()``, the keys listed in
``MACHINE_KEYS``: ``machine_cores`` (cores this process may run on), ``machine_memory_gb``,
``machine_cpu`` (the CPU model), ``machine_gpu`` ("none", or the number of CUDA devices and
the first one's name), ``machine_os``, ``machine_python`` and ``machine_load_1m`` (the
1-minute load average when it was read, -1.0 where the OS has none). Measurements whose
names also start with ``machine_`` (bench_scaling's ``machine_busy_{n}w``) are not among them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "MACHINE_KEYS",
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
]


def bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser with the options every bench script shares; add your own before parsing."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="Short run (15 s to 2 minutes on a 2-core machine) for smoke tests.")
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
