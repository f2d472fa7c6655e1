"""A DTensor (an FSDP2 or tensor-parallel shard) is refused by name, with what to send instead."""

import pytest
import torch
import torch.distributed as dist

from rollfleet.errors import WeightUpdateError
from rollfleet.weights.bucket import check_pair

pytest.importorskip("torch.distributed.tensor")


@pytest.fixture
def dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        yield distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    finally:
        dist.destroy_process_group()


def test_check_pair_refuses_a_dtensor_and_says_what_to_send(dtensor):
    with pytest.raises(ValueError, match=r"'w' is a DTensor .*full_tensor\(\)"):
        check_pair(("w", dtensor))
    with pytest.raises(ValueError, match="is a DTensor"):
        check_pair(("p", torch.nn.Parameter(dtensor)))
    name, tensor = check_pair(("w", dtensor.full_tensor()))  # the whole tensor is what to send
    assert name == "w" and type(tensor) is torch.Tensor


async def test_update_with_dtensors_fails_with_the_hint(dtensor):
    from rollfleet.actors import FleetConfig, Supervisor

    async with Supervisor(FleetConfig(engine="echo", num_workers=1, frontend_addr=None)) as fleet:
        with pytest.raises(ValueError, match=r"'w' is a DTensor .*full_tensor\(\)"):  # a list: before sending
            await fleet.update_weights([("w", dtensor)], version=1)
        with pytest.raises(WeightUpdateError, match=r"'w' is a DTensor .*full_tensor\(\)"):  # met as it is sent
            await fleet.update_weights(iter([("w", dtensor)]), version=1)
        assert fleet.weight_version == 0
        report = await fleet.update_weights([("w", dtensor.full_tensor())], version=1)
        assert report.ok and fleet.weight_version == 1
