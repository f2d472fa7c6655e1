"""Engine options are checked before any worker starts: a misspelt one is refused with the
list of those the engine takes, and every option an adapter reads is on that list."""

from __future__ import annotations

import pathlib
import re

import pytest

from rollfleet.actors import FleetConfig
from rollfleet.engines import ENGINE_NAMES, ENGINE_OPTIONS, check_engine_options

ENGINES_DIR = pathlib.Path(__file__).resolve().parents[2] / "engines"
MODULES = {"echo": "echo.py", "torch": "torch_engine.py", "vllm": "vllm_engine.py", "sglang": "sglang_engine.py"}


def test_a_misspelt_option_is_refused_by_the_config_naming_it_and_the_right_one():
    with pytest.raises(ValueError) as info:
        FleetConfig(engine="torch", engine_options={"max_batchsize": 4})
    text = str(info.value)
    assert "'max_batchsize'" in text and "max_batch_size" in text and "torch" in text
    # What it lists as taken is what a user may give: not the options the fleet sets itself.
    taken = text.split("it takes ", 1)[1].split(", ")
    assert "seed" in taken and "device" not in taken and "private_dir" not in taken


def test_engines_that_pass_arguments_through_point_to_extra():
    for name in ("vllm", "sglang"):
        with pytest.raises(ValueError, match="extra"):
            check_engine_options(name, {"enable_prefix_caching": True})
    with pytest.raises(ValueError) as info:
        check_engine_options("echo", {"bogus": 1})
    assert "extra" not in str(info.value)


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="unknown engine 'tensorrt'"):
        check_engine_options("tensorrt", {})


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_every_option_an_adapter_reads_is_accepted(name):
    source = (ENGINES_DIR / MODULES[name]).read_text()
    read = set(re.findall(r"(?:options|opts)(?:\.get\(|\[)\"([a-z_]+)\"", source))
    # the vLLM adapter copies a few straight into vLLM's arguments
    for group in re.findall(r"for key in \(([^)]*)\):", source):
        read |= set(re.findall(r"\"([a-z_]+)\"", group))
    assert read, f"no option reads found in {MODULES[name]}"
    assert read <= ENGINE_OPTIONS[name], read - ENGINE_OPTIONS[name]
    # all of them together pass, but those the fleet sets for each worker
    check_engine_options(name, dict.fromkeys(ENGINE_OPTIONS[name] - {"device", "private_dir"}, None))


@pytest.mark.parametrize("key, points_to", [("device", "FleetConfig.devices"),
                                            ("private_dir", "FleetConfig.private_dir_root")])
def test_an_option_the_fleet_sets_for_each_worker_is_refused_with_what_to_use(key, points_to):
    # Given, it overrode the fleet's own: a GPU fleet's workers on another device, or engine
    # files in a directory the fleet never removes.
    with pytest.raises(ValueError, match=f"'{key}' is set by the fleet for each worker: .*{points_to}"):
        FleetConfig(engine="echo", engine_options={key: "cpu" if key == "device" else "/tmp"})


@pytest.mark.parametrize("engine, options, says", [
    ("echo", {"tokens_per_s": -5}, "'tokens_per_s' must be a number >= 0"),
    ("echo", {"step_tokens": 0}, "'step_tokens' must be an int >= 1"),
    ("torch", {"dtype": "int8"}, "'dtype' must be one of"),
    ("torch", {"max_batch_size": "8"}, "'max_batch_size' must be an int >= 1"),
    ("vllm", {"model": "/m", "gpu_memory_utilization": 1.5}, "'gpu_memory_utilization' must be a number in (0, 1]"),
    ("torch", {"seed": 1.5}, "'seed' must be an int"),
    ("vllm", {"dtype": "bfloat16"}, "the vllm engine needs engine_options['model']"),
    ("sglang", {}, "the sglang engine needs engine_options['model']"),
])
def test_option_values_that_cannot_be_right_are_refused_before_any_worker_starts(engine, options, says):
    with pytest.raises(ValueError) as info:
        FleetConfig(engine=engine, engine_options=options)
    assert says in str(info.value)


def test_good_option_values_pass():
    FleetConfig(engine="echo", engine_options={"tokens_per_s": 0, "vocab_size": 64, "max_running": 0})
    FleetConfig(engine="torch", engine_options={"dtype": "bfloat16", "max_batch_size": 4, "seed": 3})
    FleetConfig(engine="vllm", engine_options={"model": "/models/x", "gpu_memory_utilization": 0.5,
                                               "max_model_len": 512, "dtype": "auto"})
