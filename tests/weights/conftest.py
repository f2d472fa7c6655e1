import os
import signal
import subprocess
import sys

import pytest

# Import hypothesis's modules now, before tests start threads: its pytest plugin otherwise
# imports them at the very end, where CPython 3.11.7's parser can fail with "AST constructor
# recursion depth mismatch" (a CPython bug fixed in 3.11.8).
try:  # absent on some GPU machines; the tests that use it are skipped there anyway
    import hypothesis  # noqa: F401
    import hypothesis.internal.observability  # noqa: F401
except ImportError:
    pass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(autouse=True)
def fresh_buffers():
    """Each test starts without transfer buffers kept by an earlier test of this process."""
    from rollfleet.weights import release_buffers

    release_buffers()
    yield
    release_buffers()


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
