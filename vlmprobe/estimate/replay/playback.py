"""A logged program played back into the allocator model: where a tensor sits in its storage (View), and the
events of an AllocationLog replayed as the same allocations and frees, in the same order, with fresh tensors put
where the logged step had its own. The step, block and built-model replays all play their logs through it.
"""

from __future__ import annotations

import torch

from vlmprobe.estimate.fast_fake import empty_strided
from vlmprobe.estimate.tracker import LiveBytesTracker

__all__ = ["View", "byte_buffer", "play", "play_events", "tensor_layout"]


def byte_buffer(nbytes: int, device: torch.device, tracker: LiveBytesTracker) -> torch.Tensor:
    """A new storage of `nbytes` (one uint8 tensor over it), charged by `tracker`."""
    return empty_strided(tracker, (nbytes,), (1,), torch.uint8, device)


class View:
    """Where a tensor sits in its storage: rebuilt on a fresh storage of the same size."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.size, self.stride, self.offset = t.dtype, tuple(t.shape), t.stride(), t.storage_offset()
        self.device, self.element_size = t.device, t.element_size()

    def fills(self, nbytes: int) -> bool:
        """Whether this tensor alone is what torch.empty_strided makes of a storage of `nbytes`."""
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride)) if all(self.size) else 0
        return self.offset == 0 and extent * self.element_size == nbytes

    def new(self, tracker: LiveBytesTracker) -> torch.Tensor:
        return empty_strided(tracker, self.size, self.stride, self.dtype, self.device)

    def on(self, storage: torch.Tensor) -> torch.Tensor:
        return storage.view(self.dtype).as_strided(self.size, self.stride, self.offset)

    def fresh(self, nbytes: int, tracker: LiveBytesTracker) -> torch.Tensor:
        """This tensor alone on a new storage of `nbytes`, charged by `tracker`: made directly where it fills it
        (one op, not three), else a view of a byte buffer."""
        if self.fills(nbytes):
            return self.new(tracker)
        return self.on(byte_buffer(nbytes, self.device, tracker))

    @property
    def layout(self) -> tuple:
        return self.size, self.stride, self.offset, self.dtype, self.device


def play_events(events: list[int], span, views: dict, freed_at: dict, held_before: int) -> list[tuple]:
    """The log's events in `span` as play plays them: a free, fresh tensors (`views` of a storage), or a bare
    block. A fresh storage freed at or after event `held_before` is held by the replay until then."""
    out = []
    for i in span:
        size = events[i]
        if size < 0:  # (what Python freed between the forward and the backward, it frees again)
            out.append(("free", -1 - size))
        elif i in views:
            out.append(("tensors", i, size, views[i], held_before <= freed_at.get(i, -1)))
        else:
            out.append(("block", i, size))
    return out


def play(tracker, events, blocks: dict, place) -> None:
    """Play `events` into the tracker's allocator model; `blocks` holds what is allocated and not yet freed (a
    bare block's handle, or a fresh storage the replay holds); `place(kind, where, tensor)` puts each fresh
    tensor where the logged step had its tensor."""
    allocator = tracker.allocator
    for event in events:
        if event[0] == "block":
            blocks[event[1]] = allocator.malloc(event[2])
        elif event[0] == "free":
            block = blocks.pop(event[1])
            if isinstance(block, int):
                allocator.free(block)
            # else a fresh storage, dropped here: the tracker frees its block as it dies, now
        else:
            _, index, size, views, held = event
            # a new storage, charged by the tracker at this point of the log: the one tensor on it (most
            # gradients), else views of a byte buffer
            if len(views) == 1:
                storage = views[0][1].fresh(size, tracker)
                tensors = [storage]
            else:
                storage = byte_buffer(size, views[0][1].device, tracker)
                tensors = [view.on(storage) for _, view in views]
            for ((kind, where), _), tensor in zip(views, tensors):
                place(kind, where, tensor)
            if held:
                blocks[index] = storage


def tensor_layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device
