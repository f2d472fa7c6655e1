"""Each package's __all__ names exactly what it exports, and everything named exists."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rollfleet

PACKAGES = ["rollfleet.actors", "rollfleet.transport", "rollfleet.engines", "rollfleet.weights", "rollfleet.errors"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_exist(name):
    module = importlib.import_module(name)
    assert module.__all__, f"{name} has an empty __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names missing attributes: {missing}"
    assert len(set(module.__all__)) == len(module.__all__)


def test_py_typed_is_shipped():
    assert (Path(rollfleet.__file__).parent / "py.typed").exists()


def test_no_pickle_in_the_wire_or_runtime():
    root = Path(rollfleet.__file__).parent
    offenders = []
    for folder in ("transport", "actors", "weights", "engines"):
        for path in (root / folder).glob("*.py"):
            text = path.read_text()
            if "import pickle" in text or "pickle.loads" in text or "cloudpickle" in text:
                offenders.append(str(path))
    assert not offenders, offenders


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "rollfleet.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("demo", "serve", "stats", "keys"):
        assert command in out.stdout


def test_stats_without_a_fleet_says_so_in_one_line_and_exits_1():
    for address in ("tcp://127.0.0.1:1", "ipc:///nonexistent/fleet.sock"):  # a malformed one exits 2 (test_cli)
        out = subprocess.run([sys.executable, "-m", "rollfleet.cli", "stats", address, "--timeout", "0.5"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.startswith(f"rollfleet stats: {address}: ") and out.stderr.count("\n") == 1


def test_demo_runs_on_the_echo_engine_and_exits_cleanly(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", "demo", "--engine", "echo", "--requests", "12", "--max-tokens", "400"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {k: v.strip() for k, v in (line.split("  ", 1) for line in out.stdout.splitlines()
                                       if "  " in line and not line.startswith(("-", "rollouts")))}
    assert rows["aborted"] == "1", out.stdout
    # The update goes out a third of the way through (1 s requests at 400 tokens/s: a busy machine
    # still has 0.6 s to push it before they end), and the requests it interrupts resume: what the
    # demo is for.
    assert "pushed weights version 1" in out.stdout and "while" in out.stdout.split("pushed weights", 1)[1].split("\n")[0]
    assert int(rows["resumed (preemptions)"]) >= 1, out.stdout
    assert "weight versions seen" in out.stdout and "fleet shut down cleanly" in out.stdout
    # Each token counted under the weights that made it: some before the update, some after.
    by_version = dict(item.split(": ") for item in rows["tokens by weight version"].split(", "))
    assert set(by_version) == {"v0", "v1"}, out.stdout
    assert sum(map(int, by_version.values())) == int(rows["tokens generated"]), out.stdout
    # tokens/s is over the rollouts' time: from the requests' start to the last one's end, which
    # is their slowest latency give or take the abort's and the update's tails; not the seconds
    # the weights to push took to build (torch's import, here), which once came first on that clock.
    elapsed = int(rows["tokens generated"]) / float(rows["tokens/s"])
    assert elapsed <= float(rows["latency p99 (s)"]) + 0.5, out.stdout
    assert not [p for p in os.listdir(tmp_path) if p.startswith("rollfleet-")]


def test_the_readme_python_example_runs_as_written(tmp_path):
    text = (Path(rollfleet.__file__).parent / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first.endswith("[0]") and second.endswith("[1]")  # weight versions before and after the update
    assert first.split("]")[0] != second.split("]")[0]  # other weights, other tokens


def test_help_of_each_settings_class_documents_every_field():
    # The fields' docs are string literals under their declarations; help() shows them.
    import dataclasses
    import pydoc

    from rollfleet.actors.config import FleetConfig, RestartPolicy
    from rollfleet.transport.messages import SamplingParams
    from rollfleet.weights.config import WeightSyncConfig

    for cls in (FleetConfig, RestartPolicy, WeightSyncConfig, SamplingParams):
        text = pydoc.plain(pydoc.render_doc(cls))
        for f in dataclasses.fields(cls):
            entry = text.split(f"\n |  {f.name}: ", 1)
            assert len(entry) == 2, f"{cls.__name__}.{f.name} is not documented in help()"
            doc = entry[1].split("\n", 2)[1]  # the line under "name: type = default"
            assert doc.startswith(" |      ") and doc.strip(" |"), f"{cls.__name__}.{f.name}: no doc under it"


def test_packages_import_their_modules_when_first_named():
    """rollfleet and rollfleet.actors import nothing heavy themselves, and each of their modules
    (found in the package's directory) is there on first use; the command line's __main__ is not
    one of them, and a name that is nothing raises AttributeError."""
    code = r"""
import sys
import rollfleet.actors.boot
heavy = sorted({"zmq", "msgpack", "asyncio", "psutil", "torch", "rollfleet.actors.worker"} & set(sys.modules))
assert not heavy, heavy
import rollfleet, rollfleet.actors
assert rollfleet.errors.RolloutError and rollfleet.actors.supervisor.Supervisor is rollfleet.actors.Supervisor
assert rollfleet.actors.State is rollfleet.actors.inflight.State
assert {"supervisor", "boot", "worker"} <= set(dir(rollfleet.actors)), dir(rollfleet.actors)
for package, name in ((rollfleet, "nothing"), (rollfleet, "__main__"), (rollfleet.actors, "nothing")):
    try:
        getattr(package, name)
    except AttributeError:
        pass
    else:
        raise AssertionError(f"{package.__name__}.{name} exists")
assert "rollfleet.__main__" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


def test_actors_lazy_names_match_what_type_checkers_are_told():
    """actors/__init__ tells type checkers where each name comes from (its TYPE_CHECKING
    imports) and looks names up in _HOME at run time: the two and __all__ must agree."""
    import ast

    import rollfleet.actors as actors

    tree = ast.parse(Path(actors.__file__).read_text())
    told = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.dump(imp)
                for alias in imp.names:
                    assert alias.asname == alias.name  # `X as X`: a re-export, to a type checker
                    told[alias.name] = imp.module
    assert told == actors._HOME
    assert sorted(told) == sorted(actors.__all__)
    for name, module in told.items():
        assert getattr(importlib.import_module(f"rollfleet.actors.{module}"), name) is getattr(actors, name)
