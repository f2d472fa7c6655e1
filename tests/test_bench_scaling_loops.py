"""bench_scaling's figure for the goal "the supervisor's loop below 0.9 of a core" is the busiest loop
of every no-model flood it measures, and its docs say how the per-request CPU relates to req/s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from . import test_bench_keys as keys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_no_model_loop_cpu_max_is_the_busiest_loop_of_every_no_model_flood(tmp_path):
    out = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_scaling.py"), "--quick", "--workers", "1,2",
                           "--receivers", "", "--paced-batches", "0", "--running-intervals", "0", "--calls", "300",
                           "--clients", "1", "--ranks", "1,2", "--json", str(out), "--png", str(tmp_path / "s.png")],
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads(out.read_text())
    # Every key it writes is documented; the paced, running and weight-update runs were left out.
    skipped = {k for k in keys.documented("bench_scaling") if k.startswith(("paced_", "running_", "gbps_", "update_s_",
                                                                              "weights_"))}
    keys.check_keys("bench_scaling", m, optional=skipped | {"memcpy_gbps", "max_receivers", "gbps_scaling_max"})
    loops = {k: v for k, v in m.items()
             if re.fullmatch(r"(supervisor_loop_cpu_\d+w|batch_loop_cpu_\d+w|ranks_loop_cpu_max_\d+r|"
                             r"clients_loop_cpu_\d+c|clients_in_process_loop_cpu)", k)}
    assert len(loops) == 2 + 2 + 2 + 1 + 1, sorted(loops)
    assert m["no_model_loop_cpu_max"] == max(loops.values())
    assert m["no_model_loop_cpu_max"] >= max(m["supervisor_loop_cpu_max"], m["batch_loop_cpu_max"])
    assert isinstance(m["no_model_loop_cpu_max_run"], str) and m["no_model_loop_cpu_max_run"]


def test_the_docs_say_what_per_request_cpu_is_against_req_per_s():
    help_text = subprocess.run([sys.executable, os.path.join(BENCH, "bench_scaling.py"), "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    flat = " ".join(help_text.split())
    assert "every req/s figure is the median of the rounds' rates" in flat
    assert "CPU seconds of all rounds / the calls of all rounds" in flat
    assert "10 ms ticks" in flat
    with open(os.path.join(BENCH, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    assert "cores / (all calls / all wall time)" in readme and "10 ms ticks" in readme
