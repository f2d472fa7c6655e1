"""bench/run_all runs bench scripts and writes one report: tables against baselines, the
machine of each figure, plots, the bottleneck paragraph, and "not run" with a reason for
what could not run. The report goes to a temporary path, never over bench/RESULTS.md."""

from __future__ import annotations

import importlib.util
import json
import re
import os
import subprocess
import sys

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_ALL = os.path.join(ROOT, "bench", "run_all")
HERE = {"machine_cores": 2, "machine_memory_gb": 23.5, "machine_cpu": "Test CPU", "machine_gpu": "none",
        "machine_load_1m": 0.5}


from . import test_bench_keys as keys  # check_keys holds each JSON to its script's docstring


def run_all(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # Through this interpreter (the venv's), as `bench/run_all` re-executes itself into it anyway.
    proc = subprocess.run([sys.executable, RUN_ALL, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_run_all_is_an_executable_script():
    assert os.access(RUN_ALL, os.X_OK)
    with open(RUN_ALL, encoding="utf-8") as f:
        assert f.readline().startswith("#!")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_scaling_run_writes_a_report_with_a_table_plot_and_bottleneck(tmp_path):
    out, report = tmp_path / "out", tmp_path / "R.md"
    run_all("--quick", "--only", "bench_scaling", "--out", str(out), "--report", str(report),
            "--extra", "--workers 1,2 --receivers 1,2 --weights-mb 8 --calls 900 --paced-running 8 "
            "--paced-tokens 16 --paced-batches 1 --running-workers 2 --running-per-worker 128", timeout=360)  # a busy 2-core machine
    metrics = json.loads((out / "bench_scaling.json").read_text())
    keys.check_keys("bench_scaling", metrics)  # --workers 1,2 and the rest: every documented key pattern
    for key in ("rps_1w", "rps_2w", "p99_us_1w", "p99_us_2w", "gbps_1w", "gbps_2w", "memcpy_gbps"):
        assert metrics[key] > 0, key
    for n in (1, 2):
        # The loop is one thread: it cannot use more than one core, nor less than nothing.
        assert 0 < metrics[f"supervisor_loop_cpu_{n}w"] <= 1.05
        # (read from /proc in 10 ms ticks: a quick run's workers may show none)
        assert metrics[f"workers_cpu_{n}w"] >= 0 and metrics[f"bottleneck_{n}w"]
    assert metrics["machine_cores"] >= 1
    for n in (1, 2):
        # Paced workers cannot finish more than their capacity (8 at once, 200 tokens/s, 16 tokens:
        # 100 req/s each), and a fleet that delivers nothing near it is broken.
        assert metrics[f"paced_capacity_rps_{n}w"] == pytest.approx(100 * n)
        assert 0.3 < metrics[f"paced_vs_capacity_{n}w"] <= 1.02
        assert 0 < metrics[f"paced_loop_cpu_{n}w"] <= 1.05 and metrics[f"paced_bottleneck_{n}w"]
        # 16 tokens at 200 tokens/s: at least 80 ms on the worker; the rest of a call's time is
        # the fleet's, which cannot be less than nothing.
        assert metrics[f"paced_worker_p50_ms_{n}w"] >= 80
        assert 0 <= metrics[f"paced_outside_p50_ms_{n}w"] <= metrics[f"paced_outside_p99_ms_{n}w"]
        # A finished request's wait for its caller is part of its time outside the worker (the
        # supervisor held it at least as long as the worker did); 0.01 ms for the clocks' rounding.
        assert -0.01 <= metrics[f"paced_caller_wait_ms_{n}w"] <= metrics[f"paced_outside_mean_ms_{n}w"] + 0.01
        # The loop's CPU per round cannot exceed the round's time (it is one thread), which a
        # call's latency is: a figure off by a unit would be a thousand times too big.
        assert 0 < metrics[f"paced_loop_round_ms_{n}w"] <= 1.05 * metrics[f"paced_p99_ms_{n}w"]
        assert 0 <= metrics.get(f"paced_loop_wait_{n}w", 0) <= 1.05
    assert metrics["paced_loop_ceiling_workers"] > 0
    # The same paced fleets with 2 batches per worker in flight, 4 rounds of them (2 x max(2, 1)):
    # an engine still cannot finish more than its capacity; its rate is taken from the middle of
    # the first round to the last's, which the rounds' spread can move by a few percent.
    assert metrics["paced_queued_batches"] == 2 and metrics["paced_queued_rounds"] == 4
    for n in (1, 2):
        assert 0.3 < metrics[f"paced_queued_vs_capacity_{n}w"] <= 1.1
        assert metrics[f"paced_queued_vs_capacity_{n}w"] == pytest.approx(metrics[f"paced_queued_rps_{n}w"] / (100 * n))
        assert 0 < metrics[f"paced_queued_loop_cpu_{n}w"] <= 1.05
        assert metrics[f"paced_queued_outside_mean_ms_{n}w"] > 0
    assert metrics["paced_queued_vs_capacity_min"] == min(metrics["paced_queued_vs_capacity_1w"],
                                                          metrics["paced_queued_vs_capacity_2w"])
    # The 2 paced workers again as 1 and as 2 ranks: the same engines' capacity in both.
    assert metrics["paced_ranks_workers"] == 2 and metrics["paced_ranks_max"] == 2
    for k in (1, 2):
        assert 0.3 < metrics[f"paced_ranks_vs_capacity_{k}r"] <= 1.02
        assert metrics[f"paced_ranks_vs_capacity_{k}r"] == pytest.approx(metrics[f"paced_ranks_rps_{k}r"] / 200)
        # 16 tokens at 200 tokens/s: a lane's cycle is 80 ms on its worker plus its time outside,
        # and the rate is the lanes over their cycle, so the time outside is less than the cycle.
        assert 0 <= metrics[f"paced_ranks_outside_mean_ms_{k}r"] < 80 / metrics[f"paced_ranks_vs_capacity_{k}r"]
        assert 0 < metrics[f"paced_ranks_loop_cpu_max_{k}r"] <= 1.05
    # The goal's figure is the busiest loop of all those engine-paced floods, and says which it was.
    paced_loops = [metrics[f"{kind}_{n}w"] for kind in ("paced_loop_cpu", "paced_queued_loop_cpu") for n in (1, 2)]
    paced_loops += [metrics[f"paced_ranks_loop_cpu_max_{k}r"] for k in (1, 2)]
    assert metrics["paced_loop_cpu_max"] == max(paced_loops) and metrics["paced_loop_cpu_max_run"]
    # 256 requests running, none finishing: reported every 0.05 s, ten times as many reports
    # reach the loop as every 0.5 s, and it spends more on them.
    assert metrics["running_requests"] == 256 and metrics["running_workers"] == 2
    for ms in (50, 500):
        assert 0 < metrics[f"running_loop_cpu_{ms}ms"] <= 1.05 and metrics[f"running_loop_us_per_report_{ms}ms"] > 0
        assert metrics[f"running_loop_ceiling_{ms}ms"] == pytest.approx(256 / metrics[f"running_loop_cpu_{ms}ms"])
    assert metrics["running_loop_cpu_50ms"] > metrics["running_loop_cpu_500ms"]
    # The 2-worker fleet (the only one that can be split) again as 1 and as 2 ranks, each rank a
    # process with a fleet of its own; none of those processes outlives the run.
    assert metrics["ranks_workers"] == 2 and metrics["ranks_max"] == 2
    for k in (1, 2):
        assert metrics[f"ranks_rps_{k}r"] > 0 and metrics[f"ranks_p99_us_{k}r"] > 0
        assert 0 < metrics[f"ranks_loop_cpu_max_{k}r"] <= 1.05 and metrics[f"ranks_bottleneck_{k}r"]
    assert metrics["ranks_rps_scaling_max"] == pytest.approx(metrics["ranks_rps_2r"] / metrics["ranks_rps_1r"])
    # The same 2 workers as one fleet fed through its frontend by 1 and 2 client processes.
    assert metrics["clients_workers"] == 2 and metrics["clients_max"] == 2
    for k in (1, 2):
        assert metrics[f"clients_rps_{k}c"] > 0 and metrics[f"clients_p99_us_{k}c"] > 0
        assert 0 < metrics[f"clients_loop_cpu_{k}c"] <= 1.05 and metrics[f"clients_cpu_{k}c"] > 0
        assert metrics[f"clients_loop_us_per_req_{k}c"] > 0 and metrics[f"clients_bottleneck_{k}c"]
    # The baseline of the client rows: the same fleet flooded by its in-process client, in turns with them.
    assert metrics["clients_in_process_rps"] > 0 and metrics["clients_in_process_rps"] != metrics["rps_2w"]
    leftover = ("--rank-worker", "--client-of")
    assert not [p.pid for p in psutil.process_iter(["cmdline"])
                if any(flag in (p.info["cmdline"] or []) for flag in leftover)]
    text = report.read_text()
    assert text.startswith("# Benchmark results")
    assert "| figure | value | baseline | baseline value | ratio | goal | met |" in text
    assert "| throughput, 2 workers |" in text and "| 1 worker |" in text
    assert "### Where the bottleneck is" in text and "event loop" in text and "Paced like real engines" in text
    assert "| engine-paced throughput, 2 workers |" in text
    assert "| engine-paced throughput, 2 workers, 2 batches per worker in flight (one waiting on the engine) |" in text
    assert "2 full batches per worker in flight instead" in text
    assert "| no-model throughput, the busiest fleet's workers as 2 ranks (a fleet each) |" in text
    assert "| the same workers as 1 rank |" in text and "Spread over ranks" in text
    assert "| no-model throughput, one fleet fed by 1 client process (RemoteClient) |" in text
    assert "| the same fleet driven by its in-process client |" in text and "Fed through its frontend" in text
    assert "`bench_rpc`: not run: not selected" in text
    assert "| A | " in text  # the machines table names this machine
    if importlib.util.find_spec("matplotlib") is not None:  # an optional extra: with it, the plot must be there
        assert "](results/bench_scaling.png)" in text
        assert (tmp_path / "results" / "bench_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_all_status(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """bench/run_all whatever its exit status."""
    return subprocess.run([sys.executable, RUN_ALL, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_only_naming_a_missing_script_is_refused_with_exit_2_before_anything_runs(tmp_path):
    report = tmp_path / "R.md"
    proc = run_all_status("--only", "rpc", "bench_nosuchthing", "--out", str(tmp_path / "out"), "--report", str(report))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == ["run_all: error: --only: no such script: bench/bench_nosuchthing.py"]
    assert "Traceback" not in proc.stderr and "== bench_rpc" not in proc.stdout
    assert not report.exists()


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_include_of_a_folder_that_is_missing_or_holds_no_results_is_refused_with_exit_2(tmp_path, what):
    folder, report = tmp_path / "gpu", tmp_path / "R.md"
    if what == "empty":
        folder.mkdir()
        (folder / "notes.txt").write_text("no results here")
    proc = run_all_status("--no-run", "--out", str(tmp_path / "out"), "--include", str(folder),
                          "--report", str(report))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"run_all: error: --include {folder}: " in proc.stderr and "Traceback" not in proc.stderr
    assert not report.exists()


def test_a_script_that_fails_makes_run_all_exit_1_after_the_report_naming_it(tmp_path):
    report = tmp_path / "R.md"
    # bench_rpc refuses --window 0 at once (exit 2): a failed script, cheaply.
    proc = run_all_status("--only", "rpc", "--extra", "--window 0", "--out", str(tmp_path / "out"),
                          "--report", str(report))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "`bench_rpc`: not run: exit status 2" in report.read_text()
    assert proc.stderr.strip().splitlines()[-1].startswith("run_all: 1 script failed or timed out: bench_rpc (exit status 2")


@pytest.mark.timeout(200)
def test_a_script_that_times_out_makes_run_all_exit_1_and_leaves_nothing_behind(tmp_path):
    report, tmp = tmp_path / "R.md", tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, RUN_ALL, "--quick", "--only", "rpc", "--extra=--no-ray", "--timeout", "3",
                           "--out", str(tmp_path / "out"), "--report", str(report)], capture_output=True, text=True,
                          timeout=150, cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "`bench_rpc`: not run: timed out after 3 s" in report.read_text()
    assert "bench_rpc (timed out after 3 s" in proc.stderr.strip().splitlines()[-1]
    # SIGTERM to its process group: bench_rpc cleaned up its socket folders and fleets itself.
    assert [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")] == []
    assert "stopped by SIGTERM" in (tmp_path / "out" / "bench_rpc.log").read_text()


def test_report_compares_against_baselines_and_marks_each_machine(tmp_path):
    """--no-run renders results already on disk; --include adds another machine's."""
    out, gpu, report = tmp_path / "out", tmp_path / "gpu", tmp_path / "R.md"
    out.mkdir()
    gpu.mkdir()
    rpc = {"raw_rtt_p50_us": 100.0, "raw_rtt_p99_us": 200.0, "fleet_rtt_p50_us": 120.0, "fleet_rtt_p99_us": 300.0,
           "fleet_vs_raw_p50": 1.2, "raw_pipelined_rps": 40000.0, "fleet_rps_best": 10000.0,
           "fleet_vs_raw_rps": 0.25, "goal_p50_met": True, "goal_rps_met": False, "ray_measured": False, **HERE}
    (out / "bench_rpc.json").write_text(json.dumps(rpc))
    weights = {"memcpy_gbps": 10.0, "shm_gbps": 6.0, "shm_vs_memcpy": 0.6, "d2d_gbps": 1000.0,
               "cuda_ipc_gbps": 800.0, "cuda_ipc_vs_d2d": 0.8,
               **HERE, "machine_cores": 16, "machine_gpu": "1x NVIDIA H100 80GB HBM3"}
    (gpu / "bench_weights.json").write_text(json.dumps(weights))
    run_all("--no-run", "--only", "bench_rpc", "bench_weights", "--out", str(out), "--include", str(gpu),
            "--report", str(report), "--json", str(tmp_path / "all.json"))
    text = report.read_text()
    # --json: every outcome the report shows, with its script's metrics as they were written.
    combined = json.loads((tmp_path / "all.json").read_text())
    rows = {(s["name"], s["origin"]): s for s in combined["scripts"]}
    assert set(rows) == {("bench_rpc", ""), ("bench_weights", ""), ("bench_weights", str(gpu))}
    assert rows["bench_rpc", ""]["status"] == "ok" and rows["bench_rpc", ""]["metrics"] == rpc
    assert rows["bench_weights", str(gpu)]["metrics"]["cuda_ipc_vs_d2d"] == 0.8
    assert rows["bench_weights", ""]["status"] == "not run" and rows["bench_weights", ""]["reason"]
    assert combined["quick"] is False and combined["machine"]
    # bench_rpc, from this folder: ratio, goal and verdict; Ray absent with the reason.
    assert "| p50 round trip, fleet, 1 worker | 120 us | raw pyzmq+msgpack | 100 us | 1.20x | ratio <= 1.5 | **yes** |" \
        in text
    assert "| throughput, best fleet | 10,000 req/s | raw pyzmq+msgpack, pipelined | 40,000 req/s | 0.25x | " \
           "ratio >= 0.5 | **no** |" in text
    assert "not measured: Ray is not installed here, --no-ray was given, or Ray failed to start" in text
    # The GPU machine's results are a second machine, and its cuda_ipc figure is there.
    assert "| B | 16 | 23.5 GB | Test CPU | 1x NVIDIA H100 80GB HBM3 |" in text
    assert "| cuda_ipc transport | 800 GB/s | one device-to-device copy | 1,000 GB/s | 0.80x | ratio >= 0.7 | **yes** |" \
        in text
    assert "| bench_weights | cuda_ipc transport | one device-to-device copy | 0.80x | ratio >= 0.7 | yes | B |" in text
    # bench_weights was not in this folder: it was not run here, and that is said too.
    assert "`bench_weights`: not run: no readable JSON" in text


def report_md():
    """bench/report_md.py, imported the way bench scripts import it (bench/ is not a package)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import report_md as module
    finally:
        sys.path.pop(0)
    return module


def test_report_units_follow_what_each_key_measures():
    fmt = report_md().fmt
    assert fmt("paced_tokens_per_s", 200.0) == "200 tok/s"  # a rate, not seconds
    assert fmt("useful_per_cpu_s_resume", 2553.0) == "2,553 tok/CPU-s"
    assert fmt("update_s_4w", 0.5) == "0.5 s"
    assert fmt("p99_us_16w", 35865.0) == "35,865 us"
    assert fmt("fleet_vs_raw_p50", 1.2) == "1.2"
    assert fmt("loop_us_per_req_16w", 45.04) == "45.0 us"  # CPU microseconds a request
    assert fmt("remote_client_us_per_req", 32.1) == "32.1 us"


def test_report_shows_counts_as_counts_and_ratios_that_agree_with_their_goal():
    r = report_md()
    Row, fmt, ratio_text, value_text = r.Row, r.fmt, r.ratio_text, r.value_text
    assert fmt("max_tokens", 64) == "64" and fmt("completed_resume", 1234) == "1,234"
    row = Row(label="x", key="k", baseline="b", goal=(">=", 0.95))
    # 0.9454 misses >= 0.95: it must not be shown rounded up to 0.95x next to "no".
    assert ratio_text(row, {"ratio": 0.9454, "met": False}) == "0.945x"
    assert ratio_text(row, {"ratio": 0.9612, "met": True}) == "0.96x"
    loop = Row(label="x", key="supervisor_loop_cpu_max", goal=("<", 0.9, "value"))
    assert value_text(loop, {"value": 0.8996, "met": True}) == "0.8996"
    assert value_text(loop, {"value": 0.941, "met": False}) == "0.941"


def test_a_figure_whose_baseline_did_not_run_is_shown_as_measured_not_as_missing(tmp_path):
    # bench_scaling --workers 2,4: no 1-worker fleet, so the rows against 1 worker have no baseline.
    out, report = tmp_path / "out", tmp_path / "R.md"
    out.mkdir()
    scaling = {"rps_2w": 20000.0, "rps_4w": 18000.0, "p99_us_2w": 900.0, "p99_us_4w": 1200.0, **HERE}
    (out / "bench_scaling.json").write_text(json.dumps(scaling))
    run_all("--no-run", "--only", "bench_scaling", "--out", str(out), "--report", str(report))
    text = report.read_text()
    assert "| throughput, 4 workers | 18,000 req/s | 1 worker | not in this run (`rps_1w`) | - | - | - |" in text
    assert "not measured: not in this run's JSON" not in text.split("| throughput, 4 workers |")[1].split("\n")[0]


def test_every_link_of_a_report_written_outside_bench_resolves(tmp_path):
    # The report in a folder of its own, away from bench/: its links to bench/README.md and to
    # the plots must be relative to that folder. An included folder without PNGs says so.
    out, gpu, report = tmp_path / "out", tmp_path / "gpu", tmp_path / "elsewhere" / "R.md"
    out.mkdir()
    gpu.mkdir()
    rpc = {"raw_rtt_p50_us": 100.0, "fleet_rtt_p50_us": 120.0, "fleet_vs_raw_p50": 1.2, "ray_measured": False,
           "ray_not_measured_reason": "ray is not importable (ModuleNotFoundError: No module named 'ray')", **HERE}
    (out / "bench_rpc.json").write_text(json.dumps(rpc))
    (out / "bench_rpc.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # copied as is when Pillow cannot read it
    (gpu / "bench_rpc.json").write_text(json.dumps({**rpc, "machine_cores": 16, "machine_memory_gb": 125.9}))
    run_all("--no-run", "--only", "rpc", "--out", str(out), "--include", str(gpu), "--report", str(report))
    text = report.read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert any(link.endswith("README.md") for link in links) and any(link.endswith(".png") for link in links)
    for link in links:
        assert os.path.exists(os.path.join(report.parent, link)), f"broken link {link} in {report}"
    assert f"No plot: `{gpu}` holds no `bench_rpc.png`" in text
    # Each section names its machine's memory; a figure not measured gives the script's own reason.
    assert "Machine A (2 cores, 23.5 GB memory, no GPU)" in text
    assert "Machine B (16 cores, 125.9 GB memory, no GPU)" in text
    assert "not measured: ray is not importable (ModuleNotFoundError: No module named 'ray')" in text


@pytest.mark.parametrize("where, says", [
    ("machine cores (the loop waits for one)", "in bursts"),
    ("machine cores (rollfleet)", "every core was busy"),
    ("supervisor event loop", "The supervisor is the bottleneck"),
])
def test_the_bottleneck_paragraph_says_every_core_was_busy_only_when_they_were(where, says):
    bottleneck_text = report_md().bottleneck_text
    busy = 1.71 if "waits" in where else 1.95
    m = {"machine_cores": 2, "rps_1w": 30000.0, "supervisor_loop_cpu_1w": 0.7, "supervisor_cpu_1w": 0.9,
         "workers_cpu_1w": 0.7, "machine_busy_1w": busy, "supervisor_loop_wait_1w": 0.22, "bottleneck_1w": where}
    text = bottleneck_text(m)
    assert says in text
    if "waits" in where:
        assert "every core was busy" not in text and "1.71 of them were busy" in text and "waited 0.22" in text
