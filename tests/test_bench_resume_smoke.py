"""The partial-rollout benchmark runs end to end and its accounting adds up."""

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


NUMBERS = [
    "resume_tps", "restart_tps", "wasted_tokens_resume", "wasted_tokens_restart", "update_pause_ms",
    "update_pause_ms_resume", "update_pause_ms_restart", "generated_tps_resume", "generated_tps_restart",
    "wasted_tokens_resume_client", "wasted_tokens_restart_client", "wasted_per_update_restart",
    "update_call_ms_resume", "completed_resume", "updates_resume", "updates_restart", "engine_cpu_share_resume",
    "engine_cpu_share_restart", "machine_cores",
]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_resume_quick_measures_both_strategies_and_resume_wastes_nothing(tmp_path):
    out = tmp_path / "resume.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_resume.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "useful tok/s" in proc.stdout and "restart" in proc.stdout
    m = json.loads(out.read_text())
    assert all(not isinstance(v, (dict, list)) for v in m.values())
    keys.check_keys("bench_resume", m)
    assert m["resume_vs_restart_tps"] == pytest.approx(m["resume_tps"] / m["restart_tps"])
    for key in NUMBERS:
        value = m.get(key)
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value >= 0, (key, value)
    assert m["resume_tps"] > 0 and m["completed_resume"] > 0
    assert m["updates_resume"] > 0 and m["updates_restart"] > 0
    assert m["wasted_tokens_resume"] <= m["wasted_tokens_restart"]
    # What the engines generated and what the clients received agree token for token:
    # resumed requests keep every partial token, hard-aborted ones lose exactly what they had.
    assert m["wasted_tokens_resume"] == 0 and m["wasted_tokens_resume_client"] == 0
    assert m["wasted_tokens_restart"] == m["wasted_tokens_restart_client"]
    assert m["wrong_length_resume"] == 0 and m["wrong_length_restart"] == 0
    # Every update was followed by generation under its new version.
    assert m["pauses_measured_resume"] == m["updates_resume"]
    assert m["update_pause_ms"] == m["update_pause_ms_resume"] > 0
    png = tmp_path / "resume.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
