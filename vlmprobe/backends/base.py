"""The small interface every backend implements."""

from __future__ import annotations

import abc
import contextlib

import torch

from vlmprobe.gpu.alloc_conf import AllocatorSettings
from vlmprobe.gpu.device_profile import DeviceProfile
from vlmprobe.sizes import segment_bytes_in_message

__all__ = ["Backend"]


class Backend(abc.ABC):
    name: str
    device_type: str  # where tensors live and which autocast runs
    isolate: bool  # whether each point must run in a fresh process (device allocator state leaks otherwise)

    @abc.abstractmethod
    def session(self, capacity: int | None, record_history: str = "alloc", device: DeviceProfile | None = None,
                settings: AllocatorSettings | None = None,
                allowed_maximum: int | None = None) -> contextlib.AbstractContextManager:
        """Context for one point (build, batch, steps); yields the Meter, whose `capacity` says what was
        imposed. `capacity`: device bytes the point may use (an allocation past it raises OutOfMemoryError):
        the allocator model's capacity without a device, the caching allocator's limit on cuda.
        `record_history`: measure.record_history (off | alloc | all), for backends with allocation history.
        `device`: the point's target card (vlmprobe.gpu.device_profile), or None.
        `settings`, `allowed_maximum`: measure.alloc_conf parsed, and the memory fraction's allowed maximum
        (vlmprobe.gpu.alloc_conf), for backends that model the allocator; cuda's allocator reads the
        environment the sweep gave its worker."""

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def autocast(self, dtype: torch.dtype | None):
        return autocast_factory(self.device_type, dtype)

    def select_device(self, local_rank: int) -> None:
        """Make this process's device the one of `local_rank` (one rank of a launched job); before session()."""

    def write_snapshot(self, meter, path) -> bool:
        """Write an allocator snapshot (history of every allocation) to `path`; False where there is none."""
        return False

    def load_model(self, meter, key: str | None, build):
        """(model, build peak) of the point: `build(mark)`'s (it calls `mark()` where it reads the build's peak),
        or where this backend keeps built models, a kept one of the same `key` (vlmprobe.estimate.replay.built_models;
        None: never kept). Here every point builds its own."""
        return build(lambda: None)

    def step_replay(self, meter, engine, towers=()):
        """What replays later training steps from the first one's allocations (vlmprobe.estimate.replay.steps),
        where this backend can and the engine repeats its steps alike; None: every step runs. `towers`: the
        model's lists of blocks that run one program (ModelSpec.repeated_blocks), replayed within the first step
        (vlmprobe.estimate.replay.blocks)."""
        return None

    def oom_columns(self, meter, message: str) -> dict:
        """What an out-of-memory asked for: `oom_segment_bytes`, the segment the allocator tried to reserve
        (the size CUDA's message prints), and `oom_block_bytes`, the block it was asked for (the tensor's
        bytes rounded up to 512)."""
        return {"oom_segment_bytes": segment_bytes_in_message(message), "oom_block_bytes": None}

    def oom_filled(self, meter, engine) -> str | None:
        """What filled the memory when the point ran out (the row's oom_filled: the largest live groups by module,
        kind and dtype), `engine` the point's (None where it ran out while loading); None where this backend cannot
        say. Here none: cuda would need the allocator's history of every live block, read from a snapshot, which
        is not done."""
        return None

    def timeline(self, meter) -> dict | None:
        """Allocated and reserved over the point's run with its phases (vlmprobe.estimate.allocator.Timeline.data),
        for timeline.png; None where this backend keeps none (cuda: not sampled)."""
        return None

    def predicted_device_bytes(self, meter, device: DeviceProfile | None) -> int | None:
        """What the target card would show in use at the point's peak, where this backend predicts rather
        than measures it (vlmprobe.gpu.device_profile.predicted_device_bytes); None here."""
        return None

    def final_stats(self, meter) -> dict:
        """Columns only this backend knows (reserved, NVML, allocator counters); read after the steps."""
        return {}

    def describe(self) -> dict:
        """Provenance for env.json: what the figures were taken on."""
        return {"backend": self.name}


def autocast_factory(device_type: str, dtype: torch.dtype | None):
    """A zero-arg factory of the forward's autocast context (a no-op context without autocast)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type, dtype=dtype)
