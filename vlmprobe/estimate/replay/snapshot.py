"""A recorded CUDA allocator snapshot replayed through the allocator model: what the model says of allocated and
reserved bytes for the very allocations a real run made.

The snapshot is `torch.cuda.memory._snapshot()` pickled (`_dump_snapshot`; what `measure.snapshot=true` writes per
point on CUDA, to <results>/snapshots/). The model gets every `alloc` and `free_completed` of its trace; the recorded
reserved and requested bytes are compared after every alloc and free, allocated bytes at the end against the blocks
of the snapshot's segments (block sizes are not in the trace). The pickle is read with an unpickler that builds only
plain Python values, so a file that is not a snapshot is refused without running anything in it. The snapshot's
schema and trace actions: docs/estimate.md.
"""

from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmprobe.estimate.allocator import CachingAllocatorModel
from vlmprobe.gpu.alloc_conf import AllocatorSettings

__all__ = ["load", "NotASnapshot", "replay", "requests", "settings_text"]

SETTINGS_KEY = "PYTORCH_CUDA_ALLOC_CONF"  # allocator_settings' entry for the settings string (Module.cpp)
GROW = ("segment_alloc", "segment_map")
SHRINK = ("segment_free", "segment_unmap")


class NotASnapshot(ValueError):
    """The file is not a torch.cuda.memory._snapshot() pickle; the message is one line saying why."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it holds a {module}.{name} object, which a snapshot never does")


def load(path: Path) -> dict:
    """The snapshot in `path`; NotASnapshot (one line) when it is not one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise NotASnapshot(f"{path} cannot be read ({exc.strerror or exc})") from None
    try:
        snapshot = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling failure (not a pickle, truncated, classes) is bad input
        raise NotASnapshot(f"{path} is not a torch.cuda.memory._snapshot() pickle: {exc}".splitlines()[0]) from None
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list) or not isinstance(traces, list):
        raise NotASnapshot(f"{path} is not a torch.cuda.memory._snapshot() pickle: no 'segments' and 'device_traces' lists")
    if not any(traces):
        raise NotASnapshot(f"{path} has no allocation history (recorded without _record_memory_history; "
                           f"measure.record_history=off?): nothing to replay")
    return snapshot


def settings_text(snapshot: dict) -> str | None:
    """The PYTORCH_ALLOC_CONF the recorded run's allocator parsed, where the snapshot says."""
    return (snapshot.get("allocator_settings") or {}).get(SETTINGS_KEY) or None


def _trace(snapshot: dict, device: int | None) -> tuple[int, list]:
    """(device, its trace): `device`'s, or by default the one with the most events."""
    traces = snapshot["device_traces"]
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]))
    return device, traces[device]


def requests(snapshot: dict, device: int | None = None) -> collections.Counter:
    """How many times the recorded run asked the allocator for each size (bytes, as asked: `alloc` events), on
    `device` (default: the one with the most events): the run's allocations, to set beside the estimate's."""
    return collections.Counter(event["size"] for event in _trace(snapshot, device)[1] if event["action"] == "alloc")


@dataclass
class Replay:
    """Model vs recorded, over one device's trace."""

    events: int = 0  # alloc and free_completed events replayed
    streams: set = field(default_factory=set)
    unknown_frees: int = 0  # frees of blocks allocated before the history starts (the ring buffer dropped them)
    recorded_ooms: int = 0
    model_ooms_agreeing: int = 0  # recorded ooms the model raised too
    reserved_differs: int = 0  # events after which model and recorded reserved differ
    first_difference: int | None = None  # index of the first such event
    max_reserved_difference: int = 0  # largest |model - recorded| reserved, bytes
    peak: dict = field(default_factory=dict)  # figure -> (model, recorded)
    end: dict = field(default_factory=dict)


def replay(snapshot: dict, settings: AllocatorSettings, capacity: int | None = None,
           allowed_maximum: int | None = None, device: int | None = None) -> Replay:
    """Replay the trace of `device` (default: the one with the most events) through the model."""
    device, trace = _trace(snapshot, device)
    model = CachingAllocatorModel(capacity, settings, allowed_maximum)
    out = Replay()
    live: dict[int, int] = {}
    reserved = requested = peak_reserved = peak_requested = 0
    for index, event in enumerate(trace):
        action, size = event["action"], event.get("size", 0)
        out.streams.add(event.get("stream", 0))
        if action in GROW:
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
            continue
        if action in SHRINK:
            reserved -= size
            continue
        if action == "oom":
            out.recorded_ooms += 1
            try:  # the real allocator refused this request: does the model refuse it too?
                model.free(model.malloc(size))
            except torch.OutOfMemoryError:
                out.model_ooms_agreeing += 1
            continue
        if action == "alloc":
            live[event["addr"]] = model.malloc(size)
            requested += size
            peak_requested = max(peak_requested, requested)
        elif action == "free_completed":
            handle = live.pop(event["addr"], None)
            if handle is None:
                out.unknown_frees += 1
                continue
            model.free(handle)
            requested -= size
        else:  # free_requested, snapshot: nothing changes in the allocator's accounting
            continue
        out.events += 1
        difference = abs(model.reserved - reserved)
        if difference:
            out.reserved_differs += 1
            if out.first_difference is None:
                out.first_difference = index
            out.max_reserved_difference = max(out.max_reserved_difference, difference)
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    out.peak = {"reserved": (model.peak_reserved, peak_reserved), "requested": (model.peak_requested, peak_requested)}
    out.end = {
        "reserved": (model.reserved, sum(s["total_size"] for s in segments)),
        "allocated": (model.allocated, sum(b["size"] for s in segments for b in s["blocks"]
                                           if b["state"] == "active_allocated")),
        "requested": (model.requested, requested),
    }
    return out
