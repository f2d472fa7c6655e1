"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny random Llama (seed 0) saved once per session; see engines/tiny.py."""
    pytest.importorskip("transformers")
    from rollfleet.engines.tiny import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), seed=0)
