"""Shared fixtures: fleets of real worker processes on real sockets."""

from __future__ import annotations

import os

import psutil
import pytest

from .helpers import alive

# Imported early on purpose: importing hypothesis lazily, at the end of a session, has
# crashed this CPython (3.11.7) with "AST constructor recursion depth mismatch".
try:
    import hypothesis  # noqa: F401
except ImportError:  # machines that only run the GPU tests may lack it
    pass

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


@pytest.fixture
def no_leaks():
    """Asserts that the test left no child process behind."""
    before = child_pids()
    yield
    left = alive(child_pids() - before)
    assert not left, f"processes left behind: {left}"
