"""Render bench results as one Markdown page: machines, headline ratios, a table per script,
plots, and where the bottleneck of the scaling run is. Used by bench/run_all.

Every figure on the page comes from a script's JSON; nothing here is a number of its own.
"""

from __future__ import annotations

import datetime as dt
import operator
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

from common import ENGINES_SATURATED, MACHINE_KEYS

__all__ = ["Row", "Spec", "Outcome", "write_report", "bottleneck_text", "copy_png"]

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
# Units by key suffix, longest first; ratios get an "x".
# (what a key's name ends with, its unit): the first that matches counts
UNITS = [("tokens_per_s", "tok/s"), ("per_cpu_s", "tok/CPU-s"), ("us_per_req", "us"), ("us", "us"), ("ms", "ms"), ("gbps", "GB/s"),
         ("rps", "req/s"), ("tps", "tok/s"), ("s", "s")]
# What may follow the unit in a key: a fleet size, a bucket size, a strategy.
TAIL = r"(_\d+w|_\d+r|_\d+c|_\d+mb|_resume|_restart|_best)?$"


@dataclass(kw_only=True, slots=True)
class Row:
    label: str
    """What the figure is, in words; ``{n}`` repeats the row for every fleet size in the JSON."""
    key: str
    """The metric; may contain ``{n}`` like the label."""
    baseline: str | None = None
    """The metric it is compared against, if any."""
    against: str = ""
    """The baseline, in words."""
    ratio: str | None = None
    """The script's own ratio key; else value / baseline."""
    goal: tuple | None = None
    """(op, threshold) on the ratio, or (op, threshold, 'value') on the value itself."""
    headline: bool = False
    """Quoted in the headline table (for a ``{n}`` row: its largest n)."""
    gpu: bool = False
    """Measured only on a machine with a GPU."""
    missing: str = ""
    """Why the figure can be absent, said in the report when it is."""
    why_key: str | None = None
    """A key in which the script says why it did not measure the figure; said instead of
    ``missing`` when the JSON holds it."""

    def __post_init__(self) -> None:
        if self.goal is not None and (len(self.goal) not in (2, 3) or self.goal[0] not in OPS):
            raise ValueError(f"goal must be (op, threshold[, 'value']) with op in {list(OPS)}, got {self.goal!r}")


@dataclass(kw_only=True, slots=True)
class Spec:
    title: str
    about: str
    rows: list[Row]


@dataclass(kw_only=True, slots=True)
class Outcome:
    name: str
    status: str
    """'ok' or 'not run'."""
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    png: str | None = None
    origin: str = ""
    """'' for this run, else the folder the results were included from."""
    seconds: float | None = None


def fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    unit = "" if "_vs_" in key else next((u for name, u in UNITS if re.search(rf"(^|_){name}{TAIL}", key)), "")
    v = float(value)
    if isinstance(value, int):  # a count: 64 requests, not 64.0
        text = f"{value:,}"
    elif v == 0 or abs(v) >= 100:
        text = f"{v:,.0f}"
    else:
        text = f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return f"{text} {unit}".strip()


def goal_shown(number: float, text: str, goal: tuple | None, met: bool | None) -> str:
    """``text`` (``number`` rounded, maybe with a unit or an "x"), or ``number`` with more decimals
    when the rounded figure would seem to meet a goal it misses, or miss one it meets (0.9454
    next to a goal of >= 0.95 shows as 0.945x, not 0.95x)."""
    if goal is None or met is None:
        return text
    head, sep, unit = text.partition(" ")
    suffix = "x" if head.endswith("x") else ""
    for digits in range(3, 9):
        try:
            shown = float(head.rstrip("x").replace(",", ""))
        except ValueError:
            return text
        if OPS[goal[0]](shown, goal[1]) == met:
            break
        head = f"{number:.{digits}f}{suffix}"
    return head + sep + unit


def expand(row: Row, metrics: dict[str, Any]) -> list[tuple[Row, bool]]:
    """The row, or one per n found in the JSON for a ``{n}`` row; with each, whether it is the
    headline one."""
    if "{n}" not in row.key:
        return [(row, row.headline)]
    pattern = re.compile("^" + re.escape(row.key).replace(r"\{n\}", r"(\d+)") + "$")
    ns = sorted(int(m.group(1)) for k in metrics if (m := pattern.match(k)))
    rows = []
    for n in ns:
        head = row.headline and n == ns[-1] and n != 1
        label = re.sub(r"\b1 (worker|receiver|rank|client process)(?:es|s)\b", r"1 \1", row.label.format(n=n))
        rows.append((Row(label=label, key=row.key.format(n=n),
                         baseline=row.baseline and row.baseline.format(n=n), against=row.against,
                         ratio=row.ratio and row.ratio.format(n=n), goal=row.goal, gpu=row.gpu,
                         missing=row.missing, why_key=row.why_key, headline=head), head))
    return rows


def evaluate(row: Row, m: dict[str, Any]) -> dict[str, Any] | None:
    """Value, baseline, ratio and goal of a row; None when the JSON lacks the figure."""
    value = m.get(row.key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    base = m.get(row.baseline) if row.baseline else None
    ratio = m.get(row.ratio) if row.ratio else None
    if ratio is None and isinstance(base, (int, float)) and base:
        ratio = value / base
    if row.baseline and base is None:
        return None  # a comparison without its baseline says nothing
    met = None
    if row.goal is not None:
        op, threshold = row.goal[0], row.goal[1]
        on = value if len(row.goal) == 3 else ratio
        met = OPS[op](on, threshold) if on is not None else None
    return {"value": value, "base": base, "ratio": ratio, "met": met}


def ratio_text(row: Row, ev: dict[str, Any]) -> str:
    """A row's ratio as shown, e.g. 0.95x; exact enough to agree with its goal's verdict."""
    goal = row.goal if row.goal is not None and len(row.goal) == 2 else None
    return goal_shown(ev["ratio"], f"{ev['ratio']:.2f}x", goal, ev["met"])


def value_text(row: Row, ev: dict[str, Any]) -> str:
    """A row's value as shown, with its unit; exact enough to agree with a goal on the value."""
    goal = row.goal if row.goal is not None and len(row.goal) == 3 else None
    return goal_shown(ev["value"], fmt(row.key, ev["value"]), goal, ev["met"])


def goal_text(row: Row) -> str:
    if row.goal is None:
        return "-"
    what = "" if len(row.goal) == 3 else "ratio "
    return f"{what}{row.goal[0]} {row.goal[1]:g}"


def machine_of(m: dict[str, Any], here: dict[str, Any], origin: str) -> tuple[str, ...]:
    """The machine a result came from, as (cores, memory, cpu, gpu); this run's machine when
    the JSON has no machine_* keys and was made here."""
    if "machine_cores" in m:
        src = m
    elif not origin:
        src = here
    else:
        return ("?", "?", "unknown (the JSON names no machine)", "?")
    return (str(src.get("machine_cores", "?")), f"{src.get('machine_memory_gb', '?')} GB",
            str(src.get("machine_cpu", "?")), str(src.get("machine_gpu", "none")))


def copy_png(src: str, dst: str) -> None:
    """Copy a plot, reduced to a 256-colour palette when Pillow is there (plots have few
    colours; this makes the committed files several times smaller)."""
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    try:
        from PIL import Image

        with Image.open(src) as img:
            img.convert("RGB").quantize(colors=256).save(dst, optimize=True)
    except Exception:  # no Pillow, or an odd PNG: the plain file is still fine
        shutil.copyfile(src, dst)


def sizes_in(m: dict[str, Any], prefix: str, suffix: str = "w") -> list[int]:
    """The sizes n of the keys ``{prefix}{n}{suffix}`` in m, ascending."""
    found = (re.fullmatch(rf"{re.escape(prefix)}(\d+){suffix}", k) for k in m)
    return sorted(int(f.group(1)) for f in found if f)


def listed(m: dict[str, Any], template: str, sizes: list[int], form: str) -> str:
    """The figures ``template.format(n)`` for each size n, formatted and comma-separated."""
    return ", ".join(format(m[template.format(n)], form) for n in sizes)


def bottleneck_text(m: dict[str, Any]) -> str:
    """A paragraph on where the scaling run spent its CPU, from the bench_scaling keys."""
    ns = sizes_in(m, "rps_")
    if not ns or f"supervisor_loop_cpu_{ns[-1]}w" not in m:
        return "The scaling run recorded no CPU figures."
    top, cores = ns[-1], m.get("machine_cores", "?")
    loop, sup = m[f"supervisor_loop_cpu_{top}w"], m[f"supervisor_cpu_{top}w"]
    work, busy = m[f"workers_cpu_{top}w"], m[f"machine_busy_{top}w"]
    loop_us = [m.get(f"loop_us_per_req_{n}w") for n in ns]
    work_us = [m.get(f"workers_us_per_req_{n}w") for n in ns]
    where = m.get(f"bottleneck_{top}w", "")
    text = [
        f"With {top} workers the fleet served {fmt('_rps', m[f'rps_{top}w'])}. The supervisor's event loop "
        f"(one thread: the one part of a fleet that cannot spread over cores) was busy {loop:.2f} of a core, "
        f"the whole supervisor process (loop, ZeroMQ I/O thread and the in-process client driving the load) "
        f"{sup:.2f} cores, the {top} worker processes {work:.2f} cores, and the machine {busy:.2f} of its "
        f"{cores} cores."]
    if all(x is not None for x in loop_us + work_us):
        text.append(
            f"Per request, the loop spent {loop_us[0]:.0f} us of CPU with {ns[0]} worker{'s' if ns[0] > 1 else ''} "
            f"and {loop_us[-1]:.0f} us with "
            f"{top} (so on a core of its own it could carry about {fmt('_rps', m[f'loop_ceiling_rps_{top}w'])}); "
            f"the workers together spent {work_us[0]:.0f} us and {work_us[-1]:.0f} us.")
    if where == "supervisor event loop":
        text.append(f"**The supervisor is the bottleneck** at {top} workers: its loop is saturated, so more "
                    "workers cannot add throughput.")
    elif where == "machine cores (the loop waits for one)":
        text.append(
            f"**The bottleneck is the machine's {cores} cores, in bursts, not the supervisor**: on average "
            f"{busy:.2f} of them were busy and the loop had {max(1 - loop, 0):.0%} of a core to spare, but the "
            f"loop, ready to run, waited {m.get(f'supervisor_loop_wait_{top}w', 0):.2f} of the time for a core "
            "that other processes held (the workers, mostly). More workers on the same cores only share them.")
    elif where.startswith("machine cores"):
        others = max(busy - sup - work, 0.0)
        text.append(
            f"**The bottleneck is the machine's {cores} cores, not the supervisor**: every core was busy "
            f"({others:.2f} cores of it other work on this shared machine) while the loop still had "
            f"{max(1 - loop, 0):.0%} of a core to spare. More workers on the same cores only share them; "
            "with more cores, throughput rises until the loop's ceiling above.")
    else:
        text.append("Neither the loop nor the machine was saturated: throughput was bounded by round trips "
                    "(requests in flight / latency).")
    if all(f"batch_loop_us_per_req_{n}w" in m for n in ns):
        low = ns[0]
        text.append(
            f"Submitted as `generate_batch` calls instead (two batches of half the window in flight, as a rollout "
            f"step submits its prompts), the loop spent {listed(m, 'batch_loop_us_per_req_{}w', ns, '.0f')} us a "
            f"request with {', '.join(map(str, ns))} workers, was busy {listed(m, 'batch_loop_cpu_{}w', ns, '.2f')} "
            f"of a core, and with {low} worker{'s' if low > 1 else ''} the limit was: "
            f"{m.get(f'batch_bottleneck_{low}w', '?')}.")
    rs = sizes_in(m, "ranks_rps_", "r")
    if len(rs) > 1 and "ranks_workers" in m:
        r, w = rs[-1], m["ranks_workers"]
        loops = listed(m, "ranks_loop_cpu_max_{}r", rs, ".2f")
        where = m.get(f"ranks_bottleneck_{r}r", "")
        text.append(
            f"Spread over ranks, as a job runs a fleet per rank (examples/torchrun_rl.py), the same {w} no-model "
            f"workers as {', '.join(map(str, rs))} ranks (a process, a supervisor and a flood each, the same "
            f"requests in flight in all) served {', '.join(fmt('_rps', m[f'ranks_rps_{k}r']) for k in rs)} "
            f"({m['ranks_rps_scaling_max']:.2f}x from {rs[0]} to {r}); the busiest rank's loop was busy {loops} of a "
            f"core, and with {r} ranks the limit was: {where}"
            + (f" ({m.get(f'ranks_machine_busy_{r}r', 0):.2f} of {cores} cores busy)." if where.startswith("machine")
               else "."))
    cs = sizes_in(m, "clients_rps_", "c")
    if cs and "clients_workers" in m:
        c, w = cs[-1], m["clients_workers"]
        where = m.get(f"clients_bottleneck_{c}c", "")
        text.append(
            f"Fed through its frontend by client processes instead (RemoteClient, as agent-loop processes would "
            f"share one fleet), one fleet of the same {w} workers served "
            f"{', '.join(fmt('_rps', m[f'clients_rps_{k}c']) for k in cs)} with {', '.join(map(str, cs))} client "
            f"process{'es' if len(cs) > 1 or cs[0] > 1 else ''}. Its loop, which then routes requests and runs no "
            f"client, spent {listed(m, 'clients_loop_us_per_req_{}c', cs, '.0f')} us of CPU a request and was busy "
            f"{listed(m, 'clients_loop_cpu_{}c', cs, '.2f')} of a core; the client processes spent "
            f"{listed(m, 'clients_client_us_per_req_{}c', cs, '.0f')} us "
            f"a request; with {c} the limit was: {where}"
            + (f" (machine busy {m.get(f'clients_machine_busy_{c}c', 0):.2f} of its {cores} cores)."
               if where == "none saturated" or where.startswith("machine") else "."))
    ps = sizes_in(m, "paced_rps_")
    if ps and "paced_loop_ceiling_workers" in m:
        p = ps[-1]
        share = listed(m, "paced_vs_capacity_{}w", ps, ".2f")
        where = m.get(f"paced_bottleneck_{p}w", "")
        text.append(
            f"Paced like real engines ({m['paced_running']} requests at once per worker, "
            f"{m['paced_tokens_per_s']:g} tokens/s each, {m['paced_tokens']} tokens a request: "
            f"{fmt('_rps', m[f'paced_capacity_rps_{p}w'] / p)} per worker), the fleet delivered {share} of the engines' "
            f"capacity with {', '.join(map(str, ps))} workers ({fmt('_rps', m[f'paced_rps_{p}w'])} at {p}). "
            f"There the loop was busy {m[f'paced_loop_cpu_{p}w']:.2f} of a core ({m[f'paced_loop_us_per_req_{p}w']:.0f} us "
            f"per request, its progress reports included), so one loop could feed about "
            f"{m['paced_loop_ceiling_workers']:,.0f} such workers"
            + (f". Below 0.9 of the capacity at {p} workers, and neither the loop nor the machine saturated on "
               f"average (machine busy {m.get(f'paced_machine_busy_{p}w', 0):.2f} of its {cores} cores)."
               if where == "none saturated" else f"; the limit at {p} workers: {where}."))
        if f"paced_outside_mean_ms_{p}w" in m:  # (not in JSON from older scripts)
            text.append(
                f"Outside its worker a request spent {listed(m, 'paced_outside_mean_ms_{}w', ps, '.1f')} ms on "
                f"average with {', '.join(map(str, ps))} workers; of that, finished, it waited "
                f"{listed(m, 'paced_caller_wait_ms_{}w', ps, '.1f')} ms for its caller to run on the loop. Per round "
                f"of every request in flight the loop spent {listed(m, 'paced_loop_round_ms_{}w', ps, '.0f')} ms of "
                "CPU in all (results, new requests, progress reports): results that finish together queue for "
                "part of it, one after the other.")
        if f"paced_queued_rps_{p}w" in m:  # (not in JSON from older scripts)
            text.append(
                f"With {m['paced_queued_batches']} full batches per worker in flight instead (one running, one "
                f"waiting on the engine, as a rollout step's prompts outnumber its engines' slots) the same fleets "
                f"delivered {listed(m, 'paced_queued_vs_capacity_{}w', ps, '.2f')} of the engines' capacity, the "
                f"loop busy {listed(m, 'paced_queued_loop_cpu_{}w', ps, '.2f')} of a core: a request still spent "
                f"{listed(m, 'paced_queued_outside_mean_ms_{}w', ps, '.1f')} ms outside its worker, but its engine "
                "had the next one meanwhile"
                + (", so the supervisor's work per round no longer cost the engines time."
                   if m.get("paced_queued_vs_capacity_min", 0) >= ENGINES_SATURATED else
                   f"; below {ENGINES_SATURATED:g} of the capacity at "
                   f"{min(ps, key=lambda n: m[f'paced_queued_vs_capacity_{n}w'])} workers all the same."))
        rs = sizes_in(m, "paced_ranks_rps_", "r")
        if len(rs) > 1 and "paced_ranks_workers" in m:
            text.append(
                f"The same {m['paced_ranks_workers']} paced workers as {', '.join(map(str, rs))} ranks (a fleet and a "
                f"loop each) delivered {listed(m, 'paced_ranks_vs_capacity_{}r', rs, '.2f')} of their capacity, a "
                f"request spending {listed(m, 'paced_ranks_outside_mean_ms_{}r', rs, '.1f')} ms outside its worker on "
                "average.")
    if "running_loop_cpu_500ms" in m and "running_loop_cpu_50ms" in m:
        text.append(
            f"With {m['running_requests']:,} long requests running on {m['running_workers']} workers and none "
            f"finishing, the loop's work is their workers' reports of new tokens: it was busy "
            f"{m['running_loop_cpu_50ms']:.3f} of a core with a report every 0.05 s and "
            f"{m['running_loop_cpu_500ms']:.3f} every 0.5 s (the fleet's default), so one loop could keep track of "
            f"about {m['running_loop_ceiling_50ms']:,.0f} and {m['running_loop_ceiling_500ms']:,.0f} running requests.")
    ks = sizes_in(m, "gbps_")
    if len(ks) > 1:
        curve = listed(m, "gbps_{}w", ks, ".2f")
        change = m[f"gbps_{ks[-1]}w"] / m[f"gbps_{ks[0]}w"] - 1
        text.append(f"Weight updates to {', '.join(map(str, ks))} receiving workers ran at {curve} GB/s (model bytes "
                    f"over update time; {change:+.0%} from {ks[0]} to {ks[-1]}). The trainer fills each shared-memory "
                    "bucket once for all receivers, so what grows with them is their acknowledgements and reads, "
                    "not the trainer's copies.")
    return " ".join(text)


def section(o: Outcome, spec: Spec | None, machine: str, png_link: str | None) -> tuple[list[str], list]:
    """The lines of one script's section, and its headline rows."""
    where = f" (results from `{o.origin}`)" if o.origin else ""
    lines = [f"## {spec.title if spec else o.name}: `{o.name}`{where}", ""]
    if spec:
        lines += [spec.about, ""]
    m = o.metrics
    took = f", {o.seconds:.0f} s" if o.seconds is not None else ""
    lines += [f"Machine {machine}; load average at start {m.get('machine_load_1m', '?')}"
              f"{'; quick run' if m.get('quick') else ''}{took}.", ""]
    heads = []
    if spec:
        lines += ["| figure | value | baseline | baseline value | ratio | goal | met |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for base_row in spec.rows:
            for row, head in expand(base_row, m):
                if row.key == row.baseline:
                    continue  # the baseline itself: shown in the other rows' baseline column
                ev = evaluate(row, m)
                value = m.get(row.key)
                if ev is None and not row.missing and isinstance(value, (int, float)) and not isinstance(value, bool):
                    # Measured, but its baseline was not (e.g. bench_scaling --workers 2,4 has no rps_1w).
                    lines.append(f"| {row.label} | {fmt(row.key, value)} | {row.against or '-'} | not in this run "
                                 f"(`{row.baseline}`) | - | {goal_text(row)} | - |")
                    continue
                if ev is None:
                    why = row.missing or "not in this run's JSON"
                    if row.gpu and "no GPU" in machine:
                        why = "needs a GPU; this machine has none"
                    if row.why_key and isinstance(m.get(row.why_key), str) and m[row.why_key]:
                        why = m[row.why_key]  # the script knows the actual reason
                    lines.append(f"| {row.label} | not measured: {why} | {row.against or '-'} | - | - | "
                                 f"{goal_text(row)} | - |")
                    continue
                met = "-" if ev["met"] is None else ("**yes**" if ev["met"] else "**no**")
                ratio = "-" if ev["ratio"] is None else ratio_text(row, ev)
                lines.append(f"| {row.label} | {value_text(row, ev)} | {row.against or '-'} | "
                             f"{fmt(row.baseline or '', ev['base'])} | {ratio} | {goal_text(row)} | {met} |")
                if head:
                    heads.append((o.name, machine, row, ev))
    else:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| `{k}` | {fmt(k, v)} |" for k, v in sorted(m.items()) if k not in MACHINE_KEYS]
    own = {k: v for k, v in m.items() if k.startswith("goal_") and isinstance(v, bool)}
    if own:
        lines += ["", "The script's own goal checks: " + ", ".join(
            f"`{k}` {'yes' if v else '**no**'}" for k, v in sorted(own.items()))]
    if png_link:
        lines += ["", f"![{o.name}]({png_link})"]
    elif o.origin:
        # The plots are drawn from a run's samples, which its JSON does not keep: say why there is none.
        lines += ["", f"No plot: `{o.origin}` holds no `{o.name}.png` (a script draws its plot from the run's "
                      "samples, which its JSON does not keep; copy the PNG along with the JSON)."]
    # Only the machine facts of common.machine_info() stay out: a measurement whose name starts
    # with machine_ (bench_scaling's machine_busy_{n}w) is listed like any other.
    rest = {k: v for k, v in sorted(m.items()) if k not in MACHINE_KEYS}
    lines += ["", f"<details><summary>All {len(rest)} metrics of this run</summary>", "",
              "| metric | value |", "| --- | --- |"]
    lines += [f"| `{k}` | {fmt(k, v)} |" for k, v in rest.items()]
    lines += ["", "</details>", ""]
    return lines, heads


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")


def link_to(target: str, folder: str) -> str:
    """A Markdown link to ``target`` from a page in ``folder``: relative, so it resolves wherever
    the page was written (bench/RESULTS.md or a --report elsewhere), with / separators."""
    return os.path.relpath(os.path.abspath(target), folder).replace(os.sep, "/")


def write_report(path: str, outcomes: list[Outcome], specs: dict[str, Spec], *, here: dict[str, Any], command: str,
                 quick: bool, started: dt.datetime, elapsed_s: float, unselected: list[str]) -> None:
    """Write the Markdown page to ``path`` and its plots to ``results/`` beside it."""
    folder = os.path.dirname(os.path.abspath(path))
    results = os.path.join(folder, "results")
    machines: dict[tuple[str, ...], str] = {}
    body: list[str] = []
    heads: list = []
    skipped = [o for o in outcomes if o.status != "ok"]
    for o in outcomes:
        if o.status != "ok":
            continue
        key = machine_of(o.metrics, here, o.origin)
        letter = machines.setdefault(key, chr(ord("A") + len(machines)))
        machine = f"{letter} ({key[0]} cores, {key[1]} memory, {key[3] if key[3] != 'none' else 'no GPU'})"
        link = None
        if o.png:
            suffix = "" if not o.origin else f"-{letter.lower()}"
            plot = os.path.join(results, f"{o.name}{suffix}.png")
            copy_png(o.png, plot)
            link = link_to(plot, folder)
        lines, h = section(o, specs.get(o.name), machine, link)
        body += lines
        heads += h
        if o.name == "bench_scaling":
            body += ["### Where the bottleneck is", "", bottleneck_text(o.metrics), ""]
    out = [
        "# Benchmark results", "",
        f"Written by `{command}` on {started:%Y-%m-%d %H:%M} UTC in {elapsed_s:.0f} s"
        f"{' (quick runs: short, so noisier than full ones)' if quick else ''}. Run it again to refresh "
        f"this page; each script's own options are in [bench/README.md]({link_to(README, folder)}).", "",
        "These machines are shared and noisy: compare the **ratios**, each measured against its baseline in "
        "the same run on the same machine, not the absolute figures. The load average when each script "
        "started is given with it.", "",
        "## Machines", "", "| machine | cores | memory | CPU | GPU |", "| --- | --- | --- | --- | --- |",
    ]
    out += [f"| {letter} | {k[0]} | {k[1]} | {k[2]} | {k[3]} |" for k, letter in machines.items()]
    if not machines:
        out.append(f"| - | {here.get('machine_cores')} | {here.get('machine_memory_gb')} GB | "
                   f"{here.get('machine_cpu')} | {here.get('machine_gpu')} |")
    out += ["", "## Headline ratios", "", "| bench | figure | against | ratio | goal | met | machine |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, machine, row, ev in heads:
        shown = ratio_text(row, ev) if ev["ratio"] is not None else value_text(row, ev)
        met = "-" if ev["met"] is None else ("yes" if ev["met"] else "**no**")
        out.append(f"| {name} | {row.label} | {row.against or '-'} | {shown} | {goal_text(row)} | {met} | "
                   f"{machine.split(' ')[0]} |")
    out.append("")
    if skipped or unselected:
        out += ["## Not run", ""]
        out += [f"- `{o.name}`: not run: {o.reason}" for o in skipped]
        out += [f"- `{n}`: not run: not selected (`--only`)" for n in unselected]
        out.append("")
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out + body).rstrip() + "\n")
