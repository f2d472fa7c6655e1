"""The RPC benchmark runs end to end and writes the metrics it promises; its helpers behave."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")

from . import test_bench_keys as keys  # check_keys holds each JSON to its script's docstring

common = keys.common  # bench/common.py, loaded by path there (bench/ is not a package)

REQUIRED = [
    "raw_rtt_p50_us", "raw_rtt_p99_us", "raw_pipelined_rps",
    "fleet_rtt_p50_us", "fleet_rtt_p99_us", "fleet_rtt_p50_us_4w", "fleet_rtt_p99_us_4w",
    "fleet_rps_1w", "fleet_rps_4w", "fleet_rps_best", "remote_rtt_p50_us", "remote_rps_1w",
    "remote_client_us_per_req", "remote_vs_raw_rps", "remote_vs_fleet_rps",
    "fleet_vs_raw_p50", "fleet_vs_raw_rps", "machine_cores", "machine_memory_gb",
]


@pytest.mark.slow
def test_bench_rpc_quick_writes_flat_json_with_positive_metrics_and_a_plot(tmp_path):
    out = tmp_path / "rpc.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_rpc.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fleet LLMClient" in proc.stdout and "raw zmq+msgpack" in proc.stdout
    assert "RemoteClient, own process" in proc.stdout
    assert "--remote-client" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    metrics = json.loads(out.read_text())
    for key in REQUIRED:
        value = metrics.get(key)
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    assert all(not isinstance(v, (dict, list)) for v in metrics.values())
    keys.check_keys("bench_rpc", metrics)
    for key in ("goal_p50_met", "goal_rps_met", "ray_measured", "quick"):
        assert isinstance(metrics[key], bool), key
    if metrics["ray_measured"]:
        assert metrics["ray_sync_rps"] > 0 and metrics["fleet_vs_ray_rps"] > 0
        assert isinstance(metrics["goal_ray_met"], bool)
    else:
        assert "ray_sync_rps" not in metrics
    # Every ratio is the quotient of this run's figures, every goal flag its documented threshold.
    assert metrics["fleet_vs_raw_p50"] == pytest.approx(metrics["fleet_rtt_p50_us"] / metrics["raw_rtt_p50_us"])
    assert metrics["fleet_vs_raw_rps"] == pytest.approx(metrics["fleet_rps_best"] / metrics["raw_pipelined_rps"])
    assert metrics["remote_vs_fleet_rps"] == pytest.approx(metrics["remote_rps_1w"] / metrics["fleet_rps_1w"])
    assert metrics["goal_p50_met"] == (metrics["fleet_vs_raw_p50"] <= 1.5)
    assert metrics["goal_rps_met"] == (metrics["fleet_vs_raw_rps"] >= 0.5)
    if not metrics["ray_measured"]:
        assert "ray actor: " in proc.stdout  # the table says why Ray is missing
    # The fleet cannot beat two processes doing nothing but the same exchange.
    assert metrics["fleet_rtt_p50_us"] > metrics["raw_rtt_p50_us"]
    png = tmp_path / "rpc.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [10.0, 1.0, 4.0, 7.0]  # unsorted on purpose
    assert common.percentile(values, 0) == 1.0
    assert common.percentile(values, 100) == 10.0
    assert common.percentile(values, 50) == 5.5
    assert common.percentile(values, 25) == pytest.approx(3.25)
    assert common.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        common.percentile([], 50)
    with pytest.raises(ValueError):
        common.percentile([1.0], 101)


def test_write_json_refuses_nested_or_non_finite_values(tmp_path):
    path = tmp_path / "sub" / "m.json"
    common.write_json(str(path), {"b_rps": 2.5, "a_met": True, "cpu": "x", "n": 3})
    assert json.loads(path.read_text()) == {"a_met": True, "b_rps": 2.5, "cpu": "x", "n": 3}
    with pytest.raises(ValueError):
        common.write_json(str(path), {"goals": {"p50": True}})
    with pytest.raises(ValueError):
        common.write_json(str(path), {"rps": float("nan")})


def test_png_path_follows_json_unless_given():
    parser = common.bench_parser("x")
    assert common.png_path(parser.parse_args(["--json", "out/rpc.json"])) == "out/rpc.png"
    assert common.png_path(parser.parse_args(["--json", "out/rpc"])) == "out/rpc.png"
    assert common.png_path(parser.parse_args(["--json", "a.json", "--png", "b.png"])) == "b.png"
    assert common.png_path(parser.parse_args(["--quick"])) is None


def test_machine_info_is_flat_and_names_cores_and_memory():
    info = common.machine_info()
    assert info["machine_cores"] >= 1 and info["machine_memory_gb"] > 0
    assert isinstance(info["machine_cpu"], str) and info["machine_cpu"]
    assert all(isinstance(v, (int, float, str)) for v in info.values())


def test_print_table_aligns_columns(capsys):
    common.print_table(["path", "p50 us"], [("raw", 42.1), ("fleet", 1234.5), ("ray", None)], title="t")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "t"
    assert len({len(line) for line in lines[1:]}) == 1  # every row as wide as the header
    assert lines[-1].endswith("-") and "1,234" in lines[-2]


@pytest.mark.parametrize("args", [("--buckets-mb", "abc"), ("--buckets-mb", "64,0"), ("--transports", "foo"),
                                  ("--transports", "shm,nccl"), ("--reps", "0"), ("--reps", "-1"),
                                  ("--total-gb", "0"), ("--cuda-total-gb", "-4")])
def test_bench_weights_refuses_bad_sizes_and_unknown_transports_before_measuring(args):
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_weights.py"), *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"argument {args[0]}" in out.stderr


@pytest.mark.parametrize("args", [("--duration", "0"), ("--concurrency", "0"), ("--kill-every", "-1"),
                                  ("--timeout", "0"), ("--workers", "1"), ("--png", "soak.png"),
                                  ("--duration", "nan"), ("--tokens-per-s", "inf")])
def test_soak_refuses_nonsense_options_before_starting_a_fleet(args):
    # --duration 0 once meant the 10-minute default and --concurrency 0 a soak of no requests that passed.
    out = subprocess.run([sys.executable, os.path.join(BENCH, "soak.py"), *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "error:" in out.stderr and "soak:" not in out.stdout


@pytest.mark.parametrize("script, args", [
    ("bench_resume.py", ("--duration", "nan")), ("bench_resume.py", ("--every", "inf")),
    ("bench_resume.py", ("--echo-tokens-per-s", "nan")), ("bench_scaling.py", ("--paced-tokens-per-s", "nan")),
    ("bench_scaling.py", ("--paced-tokens-per-s", "inf")), ("run_all", ("--timeout", "nan")),
])
def test_float_options_refuse_nan_and_infinity_with_a_usage_error(script, args):
    # float() takes "nan" and "inf", and a nan passes every "<= 0" check: soak.py --duration nan
    # once ran no requests and passed, bench_scaling --paced-tokens-per-s nan ended in a traceback.
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"argument {args[0]}: expected a finite number" in out.stderr
