"""FleetConfig refuses what it cannot use when it is made, not at the first call that uses it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollfleet.actors import FleetConfig


@pytest.mark.parametrize("weights, words", [
    ({"bucket_byte": 1 << 20}, "bucket_byte"),  # a misspelt key was accepted; every update then failed
    ({"bucket_bytes": 4}, "bucket_bytes must be an int >= 64"),
    ({"transport": "carrier"}, "transport must be"),
    ({"timeout_s": "soon"}, "weights"),
])
def test_weight_settings_are_checked_with_the_config(weights, words):
    with pytest.raises(ValueError, match=words):
        FleetConfig(engine="echo", weights=weights)


def test_checking_them_does_not_import_torch():
    code = ("import sys; from rollfleet.actors import FleetConfig; "
            "FleetConfig(engine='echo', weights={'bucket_bytes': 1 << 20}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("field", ["start_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "call_timeout_s",
                                   "report_interval_s", "stall_timeout_s", "shutdown_timeout_s"])
def test_a_nan_time_is_refused_like_a_negative_one(field):
    # NaN <= 0 is false: a NaN start timeout got past the check and failed at start-up instead.
    with pytest.raises(ValueError, match=field):
        FleetConfig(engine="echo", **{field: float("nan")})


def test_a_negative_shutdown_grace_is_refused_and_none_at_all_is_taken():
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        FleetConfig(engine="echo", shutdown_timeout_s=-1)
    assert FleetConfig(engine="echo", shutdown_timeout_s=0).shutdown_timeout_s == 0
