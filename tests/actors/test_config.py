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


@pytest.mark.parametrize("fields, words", [
    ({"restart": 5}, "restart must be a RestartPolicy"),  # was taken, and a worker's death then hung the fleet
    ({"restart": {"max_restarts": 1}}, "restart must be a RestartPolicy"),
    ({"num_workers": "2"}, "num_workers must be an int"),  # was a TypeError of a comparison
    ({"num_workers": True}, "num_workers must be an int"),  # was one worker
    ({"num_workers": 1.5}, "num_workers must be an int"),  # failed at start
    ({"max_resume_attempts": 1.5}, "max_resume_attempts must be an int"),
    ({"max_inflight_per_client": 2.5}, "max_inflight_per_client"),
    ({"max_message_bytes": 0}, "max_message_bytes must be an int >= 1024"),  # the workers could not register
    ({"max_client_message_bytes": 2048.5}, "max_client_message_bytes"),
    ({"client_send_hwm": "5"}, "client_send_hwm"),
    ({"max_sticky": -1}, "max_sticky"),  # refused only at start
    ({"metrics_port": True}, "metrics_port"),  # was port 1
    ({"metrics_port": 1.5}, "metrics_port"),
    ({"start_timeout_s": "10"}, "start_timeout_s must be a number"),
    ({"call_timeout_s": None}, "call_timeout_s must be a number"),
    ({"stall_timeout_s": "5"}, "stall_timeout_s must be a number or None"),
    ({"resume": "no"}, "resume must be True or False"),  # ran with resume on
    ({"keep_last_weights": "no"}, "keep_last_weights"),
    ({"deterministic_routing": 1}, "deterministic_routing"),
    ({"worker_addr": 123}, "worker_addr must be a str"),
    ({"frontend_addr": "tcp://127.0.0.1"}, "frontend_addr must be tcp://HOST:PORT"),  # failed at start
    ({"frontend_addr": "udp://127.0.0.1:5"}, "frontend_addr"),
    ({"frontend_addr": "tcp://127.0.0.1:65536"}, "frontend_addr must be tcp://HOST:PORT"),
    ({"frontend_addr": "tcp://[]:5"}, "frontend_addr must be tcp://HOST:PORT"),  # brackets around no host
    ({"worker_addr": "tcp://127.0.0.1:5 "}, "worker_addr must be tcp://HOST:PORT"),  # zmq would not bind it
    ({"worker_addr": "ipc://"}, "worker_addr"),
    ({"worker_env": {"A": 1}}, "worker_env must be a dict of str to str"),
    ({"devices": [5]}, "devices must be a list of str"),
    ({"devices": "cpu"}, "devices must be a list of str"),  # was 'devices has 3 entries'
    ({"engine_options": None}, "engine_options must be a dict"),
    ({"curve_keys_dir": 3}, "curve_keys_dir"),
    ({"curve_keys_dir": "/nonexistent/keys"}, "curve_keys_dir must be an existing directory"),  # failed at start
    ({"private_dir_root": "/nonexistent/root"}, "private_dir_root must be an existing directory"),  # the same
    ({"private_dir_root": ""}, "private_dir_root must be an existing directory"),
    ({"engine": ["echo"]}, "engine must be a str"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_it(fields, words):
    with pytest.raises(ValueError, match=words):
        FleetConfig(**{"engine": "echo", **fields})


@pytest.mark.parametrize("fields, words", [
    ({"max_restarts": "3"}, "max_restarts must be an int"),
    ({"max_restarts": 1.5}, "max_restarts must be an int"),
    ({"window_s": float("nan")}, "window_s must be > 0"),
    ({"backoff_s": None}, "backoff_s must be a number"),
])
def test_a_restart_policy_of_the_wrong_type_is_refused_naming_the_field(fields, words):
    from rollfleet.actors import RestartPolicy

    with pytest.raises(ValueError, match=words):
        RestartPolicy(**fields)


def test_addresses_and_values_of_the_right_types_are_taken():
    for addr in ("tcp://127.0.0.1:0", "tcp://[::1]:5555", "tcp://localhost:*", "ipc:///tmp/x.sock"):
        assert FleetConfig(engine="echo", frontend_addr=addr, worker_addr=addr).frontend_addr == addr
    config = FleetConfig(engine="echo", devices=("cpu", "cpu"), num_workers=2, start_timeout_s=5, stall_timeout_s=2,
                         metrics_port=0, max_message_bytes=1024, worker_env={"A": "1"}, frontend_addr=None)
    assert config.devices == ("cpu", "cpu") and config.start_timeout_s == 5
