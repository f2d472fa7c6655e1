"""The torchrun example runs for real: 2 ranks, each with its own torch-engine worker."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_rl.py"


@pytest.mark.slow
def test_torchrun_two_ranks_generate_train_and_push_versions(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found next to the interpreter"
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", str(EXAMPLE), "--steps", "3", "--batch", "4"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        steps = re.findall(rf"rank {rank} step (\d+): generated under versions \[([\d, ]+)\]", out.stdout)
        # Step k generates under the weights pushed at step k-1.
        assert [(int(s), v) for s, v in steps] == [(1, "0"), (2, "1"), (3, "2")], out.stdout
        assert f"rank {rank} done: final weight versions [3]" in out.stdout
    assert not [p for p in os.listdir(tmp_path) if p.startswith("rollfleet-")]
