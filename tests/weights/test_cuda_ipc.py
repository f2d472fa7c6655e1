"""cuda_ipc between two processes on one GPU (skipped without CUDA)."""

import json

import pytest
import torch

from .test_processes import wait_line

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def update_one_gpu_worker(procs, tmp_path, *sender_args):
    """A worker on cuda:0 and a sender process with ``sender_args``: the sender's RESULT."""
    addr = f"ipc://{tmp_path}/hub.sock"
    procs("worker", "--addr", addr, "--id", "w0", "--device", "cuda:0")
    sender = procs("sender", "--addr", addr, *sender_args)
    result = json.loads(wait_line(sender, "RESULT ", timeout=120))
    assert sender.wait(30) == 0
    return result


@needs_cuda
@pytest.mark.parametrize("cuda_source", [False, True])
def test_cuda_ipc_update_is_bit_exact(procs, tmp_path, cuda_source):
    args = ["--transport", "auto", "--bucket", "65536", "--big", "300000", "--version", "4"]
    result = update_one_gpu_worker(procs, tmp_path, *args, *(["--cuda-source"] if cuda_source else []))
    assert result["report"]["workers"]["w0"]["transport"] == "cuda_ipc"
    assert result["received"]["w0"]["version"] == 4
    assert result["received"]["w0"]["digests"] == result["expected"]
    # The CUDA tensors of a MiB or more are read in place; CPU ones go through the buffers.
    in_place = result["report"]["in_place_bytes"]
    assert (in_place == (4 + 2 + 1) << 20) if cuda_source else in_place == 0


@needs_cuda
def test_cuda_ipc_in_place_over_several_updates_with_fresh_memory(procs, tmp_path):
    """Each update sends freshly allocated tensors (the last update's are freed and the
    allocator's cache emptied while the worker may still map them): every update arrives
    bit-exact, and the worker keeps no mapping of memory the last update did not name."""
    result = update_one_gpu_worker(procs, tmp_path, "--transport", "cuda_ipc", "--bucket", str(1 << 20),
                                   "--cuda-source", "--updates", "3", "--version", "7")
    assert [r["version"] for r in result["reports"]] == [5, 6, 7]
    assert all(r["in_place_bytes"] == 7 << 20 for r in result["reports"])
    assert result["received"]["w0"]["version"] == 7
    assert result["received"]["w0"]["digests"] == result["expected"]
    assert 1 <= result["received"]["w0"]["mapped_segments"] <= 2  # the last update's two allocations


@needs_cuda
def test_cuda_ipc_without_in_place_sends_every_byte_through_the_buffers(procs, tmp_path):
    result = update_one_gpu_worker(procs, tmp_path, "--transport", "cuda_ipc", "--bucket", str(1 << 20),
                                   "--cuda-source", "--in-place", "off", "--version", "2")
    assert result["report"]["in_place_bytes"] == 0
    assert result["received"]["w0"]["digests"] == result["expected"]
    assert result["received"]["w0"]["mapped_segments"] == 0


@needs_cuda
def test_share_and_open_roundtrip_description_is_msgpack_clean():
    import msgpack

    from rollfleet.weights.cuda_ipc import share

    desc = share(torch.zeros(1024, dtype=torch.uint8, device="cuda"))
    assert msgpack.unpackb(msgpack.packb(desc, use_bin_type=True), raw=False) == desc


@needs_cuda
def test_exported_allocations_are_remembered_only_while_their_storage_lives():
    """Tensors in an allocation exported before reuse its handle without a driver call; once
    the storage exported is gone (freed, or a parameter's data swapped), the next tensor at
    those addresses is exported afresh: the handle always names the live allocation."""
    from rollfleet.weights.cuda_ipc import _Exports, export

    mb = 1 << 20
    cache = _Exports()
    whole = torch.empty(8 * mb, dtype=torch.uint8, device="cuda")
    first, second = whole[: 4 * mb], whole[4 * mb :]
    handle = export(whole)[0]
    assert cache.find(first, 4 * mb) == (handle, export(first)[2])
    assert cache.find(second, 4 * mb) == (handle, export(second)[2])
    assert export(second)[2] - export(first)[2] == 4 * mb

    param = torch.nn.Parameter(torch.empty(6 * mb, dtype=torch.uint8, device="cuda"), requires_grad=False)
    before = cache.find(param, 6 * mb)
    assert before is not None and before[0] == export(param)[0]
    param.data = torch.empty(6 * mb, dtype=torch.uint8, device="cuda")  # the old storage dies
    assert cache.find(param, 6 * mb) == (export(param)[0], export(param)[2])

    del first, second, whole
    torch.cuda.empty_cache()  # the allocation goes back to the driver; its addresses may be reused
    again = torch.empty(8 * mb, dtype=torch.uint8, device="cuda")
    fresh = export(again)
    assert cache.find(again, 8 * mb) == (fresh[0], fresh[2])
