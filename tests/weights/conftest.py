import os
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def procs():
    """Start harness subprocesses; every one still running is killed at the end."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "weights_harness.py"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
