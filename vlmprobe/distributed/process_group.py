"""The process group one rank runs in, and its device mesh.

- fake: `init_process_group("fake", FakeStore)`: one process plays rank r of N, every collective returns at
  once without moving data. The estimate backend simulates a rank this way.
- real: the group torchrun's environment describes: gloo on real CPU tensors for backend cpu, nccl with one
  GPU per rank for backend cuda.
The 1-D mesh of all ranks is made when the group starts, before the backend's session, so neither fake tensors
nor the tracker see its small CPU index tensors.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["fake_group", "fake_group_active", "mesh", "rank", "real_group"]

COLLECTIVES = {"cpu": "gloo", "cuda": "nccl"}
_mesh = None


def mesh():
    """The device mesh of the group this process is in."""
    if _mesh is None:
        raise RuntimeError("no process group: a distributed engine runs inside fake_group() or real_group()")
    return _mesh


@contextlib.contextmanager
def _with_mesh(device_type: str):
    global _mesh
    from torch.distributed.device_mesh import init_device_mesh

    try:
        _mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        yield dist.get_rank()
    finally:
        _mesh = None
        dist.destroy_process_group()


def rank() -> int:
    """This process's rank in its group (fake or real); 0 outside one."""
    return dist.get_rank() if dist.is_initialized() else 0


def fake_group_active() -> bool:
    """Whether this process plays a rank on a fake group (the estimate): collectives move no data."""
    return dist.is_initialized() and dist.get_backend() == "fake"


@contextlib.contextmanager
def fake_group(rank: int, world_size: int, device_type: str = "cpu", ranks_per_node: int = 8):
    import os
    from unittest import mock

    from torch.testing._internal.distributed.fake_pg import FakeStore

    # what a launcher gives a rank's environment; DeepSpeed reads it (runtime/zero/utils.py reads LOCAL_RANK)
    environment = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % ranks_per_node),
                   "LOCAL_WORLD_SIZE": str(min(ranks_per_node, world_size))}
    with mock.patch.dict(os.environ, environment):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        with _with_mesh(device_type) as this_rank:
            yield this_rank


@contextlib.contextmanager
def real_group(device_type: str):
    """Join the group of the launcher's job (torchrun's environment variables); yields this rank."""
    dist.init_process_group(COLLECTIVES[device_type])
    with _with_mesh(device_type) as rank:
        yield rank
