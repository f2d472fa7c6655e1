"""PROTOCOL.md against the code it describes, where a mismatch cannot show on the wire."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _section(title: str) -> str:
    text = (ROOT / "PROTOCOL.md").read_text()
    start = text.index(f"\n### {title}")
    return text[start:text.index("\n### ", start + 1)]


def test_every_dropped_frames_key_the_supervisor_counts_is_documented():
    source = (ROOT / "actors" / "supervisor.py").read_text()
    keys = set(re.findall(r'_drops\.log\(\s*"(\w+)"', source))
    assert {"bad_client_frame", "slow_client", "bad_worker_frame"} <= keys  # the pattern still finds them
    documented = set(re.findall(r"^\| `(\w+)` \|", _section("6.5 Stats and control"), re.MULTILINE))
    assert keys <= documented, f"not in PROTOCOL.md 6.5: {sorted(keys - documented)}"
