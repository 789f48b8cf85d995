"""The small interface every backend implements."""

from __future__ import annotations

import abc
import contextlib

import torch


class Backend(abc.ABC):
    name: str
    device_type: str  # where tensors live and which autocast runs
    isolate: bool  # whether each point must run in a fresh process (device allocator state leaks otherwise)

    @abc.abstractmethod
    def session(self, capacity: int | None) -> contextlib.AbstractContextManager:
        """Context for one point (build, batch, steps); yields the Meter. `capacity`: simulated device bytes
        for backends without a device (an allocation past it raises OutOfMemoryError), ignored by cuda."""

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def autocast(self, dtype: torch.dtype | None):
        from vlmprobe.step import autocast_factory

        return autocast_factory(self.device_type, dtype)

    def select_device(self, local_rank: int) -> None:
        """Make this process's device the one of `local_rank` (one rank of a launched job); before session()."""

    def write_snapshot(self, path) -> bool:
        """Write an allocator snapshot (history of every allocation) to `path`; False where there is none."""
        return False

    def final_stats(self, meter) -> dict:
        """Columns only this backend knows (reserved, NVML, allocator counters); read after the steps."""
        return {}

    def describe(self) -> dict:
        """Provenance for env.json: what the figures were taken on."""
        return {"backend": self.name}
