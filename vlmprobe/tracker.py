"""Live tensor-storage bytes, counted the way the CUDA caching allocator would charge them.

Used by the cpu backend (real CPU tensors) and the estimate backend (fake tensors): a TorchDispatchMode
sees every aten op below autograd, so it sees the forward, the tensors autograd saves, the backward and
the optimizer alike. Each storage an op returns that was not seen before is charged its size rounded up
to 512 bytes (the caching allocator's block granularity); when the storage dies its bytes are released.
Storages that exist before the tracker starts are not counted, nor tensors made from Python data
(`torch.tensor(...)`): a real run creates those without dispatching an allocation (only fake mode lifts
them through `lift_fresh`), and in training code they are scalars kept on the CPU even under CUDA, such
as AdamW's step counters.
"""

from __future__ import annotations

import re
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_FROM_PYTHON_DATA = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
BLOCK = 512  # bytes: the CUDA caching allocator rounds every block up to a multiple of this


def charged_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator reports as allocated for a request of `nbytes`."""
    return -(-nbytes // BLOCK) * BLOCK


class LiveBytesTracker(TorchDispatchMode):
    """Counts live storage bytes; optionally raises OutOfMemoryError past `capacity` bytes, like a device."""

    def __init__(self, capacity: int | None = None):
        super().__init__()
        self.capacity = capacity
        self.current = 0  # bytes live now
        self.peak = 0  # max of `current` since the last reset_peak()
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def reset_peak(self) -> None:
        self.peak = self.current

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def _charge(self, storage) -> None:
        nbytes = charged_bytes(storage.nbytes())
        if self.capacity is not None and self.current + nbytes > self.capacity:
            raise torch.OutOfMemoryError(
                f"vlmprobe tracker: out of memory. Tried to allocate {nbytes} bytes with {self.current} bytes "
                f"allocated of a capacity of {self.capacity} bytes"
            )
        self._seen.add(storage)
        weakref.finalize(storage, self._release, nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FROM_PYTHON_DATA:
            return out
        inputs = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage in self._seen:
                continue
            if inputs is None:  # an output aliasing an input (in-place op, view) allocated nothing new
                inputs = {id(a.untyped_storage()) for a in tree_leaves((args, kwargs))
                          if isinstance(a, torch.Tensor) and a.layout == torch.strided}
            if id(storage) not in inputs:
                self._charge(storage)
        return out


_REQUEST = re.compile(r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB|TiB)")
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(message: str) -> int | None:
    """The allocation an out-of-memory message says failed (CUDA's and the tracker's wording), in bytes."""
    match = _REQUEST.search(message)
    return round(float(match.group(1)) * _UNITS[match.group(2)]) if match else None
