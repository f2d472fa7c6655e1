"""What a bench script says on the command line: a bad option gets one line that says just what is
wrong (exit 2); a printed table names the machine it ran on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.mark.parametrize("script, args, message", [
    ("bench_weights", ["--transports", ""], "argument --transports: is empty: name one or more of shm, gloo, cuda_ipc"),
    ("bench_weights", ["--transports", "shm,"], "argument --transports: an empty name in 'shm,'"),
    ("bench_scaling", ["--running-workers", "0"], "error: --running-workers must be >= 1"),
    ("bench_scaling", ["--running-per-worker", "0"], "error: --running-per-worker must be >= 1"),
    ("bench_resume", ["--duration", "0"], "error: --duration must be > 0"),
    ("bench_resume", ["--duration", "2", "--every", "3"], "error: --every must be > 0 and at most --duration"),
])
def test_a_bad_option_gets_one_line_that_says_what_is_wrong(script, args, message):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, f"{script}.py"), *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # the line alone: no usage above it
    last = lines[-1]
    assert message in last, proc.stderr
    assert "Traceback" not in proc.stderr
    if message.startswith("error: --"):
        assert last == f"{script}.py: {message}"  # nothing else in the line


def test_soak_names_the_machine_over_its_table(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "soak.py"), "--duration", "2", "--workers", "2",
                           "--concurrency", "4", "--kill-every", "1000", "--update-every", "1000"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    title = next(ln for ln in proc.stdout.splitlines() if ln.startswith("soak results"))
    assert " cores, " in title and " GB, " in title and ", load " in title
