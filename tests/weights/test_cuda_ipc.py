"""cuda_ipc between two processes on one GPU (skipped without CUDA)."""

import json

import pytest
import torch

from test_processes import wait_line

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("cuda_source", [False, True])
def test_cuda_ipc_update_is_bit_exact(procs, tmp_path, cuda_source):
    addr = f"ipc://{tmp_path}/hub.sock"
    procs("worker", "--addr", addr, "--id", "w0", "--device", "cuda:0")
    args = ["--transport", "auto", "--bucket", "65536", "--big", "300000", "--version", "4"]
    sender = procs("sender", "--addr", addr, *args, *(["--cuda-source"] if cuda_source else []))
    result = json.loads(wait_line(sender, "RESULT ", timeout=120))
    assert sender.wait(30) == 0
    assert result["report"]["workers"]["w0"]["transport"] == "cuda_ipc"
    assert result["received"]["w0"]["version"] == 4
    assert result["received"]["w0"]["digests"] == result["expected"]


@needs_cuda
def test_share_and_open_roundtrip_description_is_msgpack_clean():
    import msgpack

    from rollfleet.weights.cuda_ipc import share

    desc = share(torch.zeros(1024, dtype=torch.uint8, device="cuda"))
    assert msgpack.unpackb(msgpack.packb(desc, use_bin_type=True), raw=False) == desc
