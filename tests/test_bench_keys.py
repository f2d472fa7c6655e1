"""Each bench script's JSON, the "Keys:" paragraph of its docstring (what --help prints),
bench/README.md and the report rows of bench/run_all name the same metrics.

``check_keys`` is what the smoke tests that run a script call on its JSON: every key written is
documented (a ``{n}`` in a documented name stands for a number), and every documented key is
written unless it belongs to a baseline that may be absent (Ray, vLLM, a GPU). The other smoke
test files load this one by path, as they load bench/common.py.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPTS = ("bench_rpc", "bench_scaling", "bench_weights", "bench_engines", "bench_resume", "soak")

# Double-backquoted names in a "Keys:" paragraph that are not keys (a family, an option value).
NOT_KEYS = {
    "bench_rpc": {"..._seq_rps"},
    "bench_weights": {"..._gbps", "shm"},
    "bench_engines": {"torch_...", "vllm_..."},
    "bench_resume": {"update_weights"},
}
# Keys that only a run with an optional baseline writes, and the reasons written when it did not run.
NOT_MEASURED = {"ray_not_measured_reason", "cuda_ipc_not_measured_reason", "vllm_not_measured_reason"}
RAY = {"ray_not_measured_reason", "ray_sync_rps", "ray_sync_p50_us", "ray_sync_p99_us", "fleet_vs_ray_rps", "goal_ray_met", "num_ray_calls"}
GPU = {"cuda_ipc_not_measured_reason", "d2d_gbps", "bytes_cuda", "cuda_reps", "cuda_ipc_gbps", "cuda_ipc_buffered_gbps", "cuda_ipc_gbps_{mb}mb",
       "cuda_ipc_buffered_gbps_{mb}mb", "cuda_ipc_vs_d2d", "cuda_ipc_buffered_vs_d2d"}
VLLM = {"vllm_not_measured_reason", "vllm_direct_tps", "vllm_fleet_tps", "vllm_fleet_vs_direct", "vllm_direct_latency_p50_s",
        "vllm_fleet_latency_p50_s", "vllm_tokens_match", "vllm_start_s", "goal_vllm_overhead_met"}
# Keys from the kernel's scheduler statistics, which a kernel built without them lacks.
SCHEDSTAT = {"supervisor_loop_wait_{n}w", "paced_loop_wait_{n}w"}
OPTIONAL = {"bench_rpc": RAY, "bench_weights": GPU, "bench_engines": VLLM, "bench_scaling": SCHEDSTAT}
# Backquoted words in bench/README.md's script sections that are not keys.
README_NOT_KEYS = {"generate_batch", "update_weights", "cuda_ipc"}  # methods, a transport


def load_by_path(name: str, path: str):
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


common = load_by_path("rollfleet_bench_common", os.path.join(BENCH, "common.py"))


def script_path(name: str) -> str:
    return os.path.join(BENCH, f"{name}.py")


def keys_paragraph(name: str) -> str:
    with open(script_path(name), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    assert doc and "Keys:" in doc, f"{name}: the module docstring has no 'Keys:' paragraph"
    return doc[doc.index("Keys:"):]


def documented(name: str) -> set[str]:
    """The keys (or key patterns, with ``{n}``) the docstring's "Keys:" paragraph names."""
    named = set(re.findall(r"``([a-z.][a-z0-9_{}.]*)``", keys_paragraph(name)))
    stale = NOT_KEYS.get(name, set()) - named
    assert not stale, f"{name}: NOT_KEYS names what the docstring no longer says: {stale}"
    return named - NOT_KEYS.get(name, set())


def pattern(key: str) -> re.Pattern:
    """A documented name as a regex: ``{n}`` (any word in braces) is a number."""
    return re.compile("^" + re.sub(r"\\\{[a-z]+\\\}", r"\\d+", re.escape(key)) + "$")


def check_keys(name: str, metrics: dict, optional: set[str] = frozenset()) -> None:
    """Every key of ``metrics`` is documented by the script; every documented key is there,
    those of ``OPTIONAL[name]`` (and ``optional``) only if their baseline ran."""
    patterns = {k: pattern(k) for k in documented(name)}
    machine = set(common.MACHINE_KEYS)
    assert machine <= set(metrics), f"{name}: machine facts missing: {machine - set(metrics)}"
    undocumented = sorted(k for k in metrics if k not in machine and not any(p.match(k) for p in patterns.values()))
    assert not undocumented, f"{name} writes keys its docstring does not name: {undocumented}"
    may_miss = OPTIONAL.get(name, set()) | set(optional)
    missing = sorted(k for k, p in patterns.items() if k not in may_miss and not any(p.match(m) for m in metrics))
    assert not missing, f"{name}'s docstring names keys its JSON lacks: {missing}"


def readme_sections() -> dict[str, str]:
    with open(os.path.join(BENCH, "README.md"), encoding="utf-8") as f:
        text = f.read()
    parts = re.split(r"^## ", text, flags=re.M)
    return {m.group(1): part for part in parts if (m := re.match(r"(\w+)\.py", part))}


def test_every_script_has_a_readme_section_and_a_keys_paragraph():
    assert set(readme_sections()) == set(SCRIPTS)
    for name in SCRIPTS:
        assert documented(name)
        # --help prints the docstring: the keys paragraph is what a user reads there.
        out = subprocess.run([sys.executable, script_path(name), "--help"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert "Keys:" in out.stdout


def test_readme_names_only_keys_that_the_scripts_document():
    for name, section in readme_sections().items():
        # A documented name with {n} as an example string, so README patterns can be matched against it.
        examples = {re.sub(r"\{[a-z]+\}", "1", k) for k in documented(name)} | set(common.MACHINE_KEYS)
        for word in re.findall(r"`([^`\n]+)`", section):
            if word.startswith(("-", ".venv", "bench/", "python", "/")) or " " in word or word in README_NOT_KEYS:
                continue
            if not re.fullmatch(r"[a-z.][a-z0-9_{}*.]*", word) or "_" not in word:
                continue
            regex = re.compile("^" + re.sub(r"\\\{[a-z]+\\\}", r"\\d+", re.escape(word))
                               .replace(r"\*", ".*").replace(r"\.\.\.", ".*") + "$")
            assert any(regex.match(e) for e in examples), f"bench/README.md, {name}: `{word}` is no key of {name}"


def test_report_rows_of_run_all_name_documented_keys(monkeypatch):
    monkeypatch.setenv("ROLLFLEET_RUN_ALL_REEXEC", "1")  # load it here, never re-executed into another python
    run_all = load_by_path("rollfleet_bench_run_all", os.path.join(BENCH, "run_all"))
    # run_all runs every bench_*.py (soak.py is not one, on purpose) and has report rows for each.
    assert set(run_all.discover(None)) == set(run_all.SPECS) == {n for n in SCRIPTS if n.startswith("bench_")}
    for name, spec in run_all.SPECS.items():
        keys = documented(name)
        examples = {re.sub(r"\{[a-z]+\}", "1", k) for k in keys}
        for row in spec.rows:
            for key in (row.key, row.baseline, row.ratio):
                if key:  # a {n} row, or one member of a documented family (running_loop_cpu_500ms, say)
                    assert (any(pattern(key).match(e) for e in examples)
                            or any(pattern(k).match(key) for k in keys)), f"run_all's {name} row uses {key!r}"


@pytest.mark.slow
def test_bench_weights_without_a_gpu_says_cuda_ipc_was_not_measured_and_documents_every_key(tmp_path):
    out = tmp_path / "weights.json"
    proc = subprocess.run([sys.executable, script_path("bench_weights"), "--quick", "--total-gb", "0.3",
                           "--buckets-mb", "32,16", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads(out.read_text())
    check_keys("bench_weights", m)
    assert m["buckets_mb"] == "16,32"  # by size: shm_as_allocated at the largest, gloo (--quick) at the smallest
    assert "shm_as_allocated_gbps_32mb" in m and "gloo_gbps_16mb" in m and "gloo_gbps_32mb" not in m
    # The bucket sizes are MiB, in the options and the keys alike: so are the table's headers.
    assert "16 MiB" in proc.stdout and "32 MiB" in proc.stdout and " MB " not in proc.stdout
    if m["machine_gpu"] == "none":
        assert m["cuda_ipc_measured"] is False and "cuda_ipc_gbps" not in m
        assert "cuda_ipc: not measured (no CUDA device here)" in proc.stdout
        assert m["cuda_ipc_not_measured_reason"] == "no CUDA device here"
    else:
        assert m["cuda_ipc_measured"] is True and m["cuda_ipc_vs_d2d"] > 0


@pytest.mark.slow
def test_bench_engines_without_vllm_has_a_not_measured_row_and_documents_every_key(tmp_path):
    # A vllm package that fails to import, ahead of the real one: the default run must leave vLLM out.
    fake = tmp_path / "novllm" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('vllm left out by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "engines.json"
    proc = subprocess.run([sys.executable, script_path("bench_engines"), "--quick", "--requests", "2",
                           "--max-tokens", "4", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads(out.read_text())
    check_keys("bench_engines", m)
    assert m["vllm_measured"] is False and not any(k.startswith("vllm_") and k not in (
        "vllm_measured", "vllm_omp_threads_bind", "vllm_not_measured_reason") for k in m)
    assert "vllm: not measured (cannot be imported: ImportError: vllm left out by the test)" in proc.stdout
    # The actual reason, for the report to quote rather than a list of possible ones.
    assert m["vllm_not_measured_reason"] == "cannot be imported: ImportError: vllm left out by the test"
    assert m["torch_fleet_vs_direct"] == pytest.approx(m["torch_fleet_tps"] / m["torch_direct_tps"])


@pytest.mark.slow
def test_soak_documents_every_key_it_writes(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, script_path("soak"), "--duration", "3", "--workers", "2",
                           "--concurrency", "4", "--kill-every", "1000", "--update-every", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads(out.read_text())
    check_keys("soak", m)
    assert m["passed"] is True and m["requests"] > 0 and m["updates_ok"] > 0
    assert type(m["supervisor_rss_growth_second_half_mb"]) is float
