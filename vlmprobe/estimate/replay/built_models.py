"""Built models kept for the later points of a process, their build replayed into each point's allocator model.

Points that differ only in what the step sees build the same model with the same knobs: what is built is decided by
the point's `model` and `train` config (the key). A process that measures many points keeps the model such a point
built, knobs applied, with the log of its build's device allocations and frees (LiveBytesTracker.log); a later point
with that key plays the log into its own allocator model, charges the model's storages to its tracker
(LiveBytesTracker.adopt) and gets the model put back as the build left it. A build is kept only if its log accounts
for every block; only on the estimate backend (so estimate == cpu checks the reuse), and only for the single device
engine running SFT steps. The details: docs/estimate.md.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from vlmprobe.estimate.replay.playback import play, play_events, tensor_layout
from vlmprobe.estimate.tracker import AllocationLog, LiveBytesTracker

__all__ = ["BUILT_MODELS"]

_CONTAINERS = (dict, collections.OrderedDict, set, list)  # module attributes changed in place, not replaced


class _Built:
    """A kept model, its build's log as step_replay plays logs (up to where the build read its peak, and after), the
    storages alive at the log's end with the index of the event that allocated each, and the model as the build
    left it: each module's attributes, each parameter's requires_grad, and each tensor the modules hold with its
    storage and layout."""

    def __init__(self, model: nn.Module, log: AllocationLog, storages: list, modules: list, params: list,
                 tensors: list):
        self.model, self.storages, self.modules, self.params, self.tensors = model, storages, modules, params, tensors
        mark = log.marks[0]
        self.build_events = play_events(log.events, range(mark), {}, {}, 0)
        self.adapt_events = play_events(log.events, range(mark, len(log.events)), {}, {}, 0)

    @classmethod
    def of(cls, model: nn.Module, log: AllocationLog, tracker: LiveBytesTracker) -> _Built | None:
        """The build to keep, or None where its log does not account for every block (module doc)."""
        if log.irregular or len(log.marks) != 1 or any(p.grad is not None for p in model.parameters()):
            return None
        tensors = _held_tensors(model)
        held = {id(storage) for _, storage, _ in tensors}
        handles = {handle: storage for storage, handle in tracker.charged()}
        storages = []
        for handle, index in log.live.items():
            storage = handles.get(handle)
            if storage is None or id(storage) not in held:  # a bare block, or a storage the model does not hold
                return None
            storages.append((storage, index))
        modules = [(module, dict(vars(module)),
                    {key: _contents(value) for key, value in vars(module).items() if type(value) in _CONTAINERS})
                   for module in model.modules()]
        params = [(p, p.requires_grad) for p in model.parameters()]
        return cls(model, log, storages, modules, params, tensors)

    def restore(self) -> bool:
        """Put the model back as the build left it; False where that cannot be done: its module tree changed, or a
        tensor it holds has another storage or layout (`param.data = ...`: QLoRA's first forward casts each 4-bit
        layer's bias, as bitsandbytes does, which a fresh build's first forward does again). The model is not
        taken then."""
        now = list(self.model.modules())
        if len(now) != len(self.modules) or any(a is not b for a, (b, _, _) in zip(now, self.modules)):
            return False
        for module, attributes, contents in self.modules:
            current = vars(module)
            for key in [key for key in current if key not in attributes]:
                del current[key]
            for key, value in attributes.items():
                current[key] = value
                if key in contents and not _same(value, contents[key]):
                    _refill(value, contents[key])
        if any(t.untyped_storage() is not storage or tensor_layout(t) != layout for t, storage, layout in self.tensors):
            return False
        for param, requires_grad in self.params:
            param.grad = None  # the last point's, made in its session (whose tracker no longer counts them)
            param.requires_grad_(requires_grad)
        return True

    def replay(self, tracker: LiveBytesTracker) -> int:
        """Play the build into `tracker`'s allocator model and charge the model's storages there; the build's peak
        (allocated bytes at the mark). An out-of-memory is raised where the build's own allocation would raise it."""
        blocks: dict[int, int] = {}  # event index -> handle, while allocated
        play(tracker, self.build_events, blocks, place=None)  # bare blocks only: nothing to place
        build_peak = tracker.allocator.peak_allocated
        play(tracker, self.adapt_events, blocks, place=None)
        for storage, index in self.storages:
            tracker.adopt(storage, blocks.pop(index))
        return build_peak


class BuiltModels:
    """The models this process keeps, by key (module doc), the least recently used dropped first."""

    LIMIT = 8  # a sweep's points share a few: one per model and knobs (grid100: 4)

    def __init__(self):
        self._kept: collections.OrderedDict[str, _Built] = collections.OrderedDict()

    def load(self, tracker: LiveBytesTracker, key: str, build) -> tuple[nn.Module, int]:
        """(model, build peak) of the point whose build `key` names: a kept model, its build replayed into
        `tracker`, or `build(mark)`'s (mark: called where the build reads its peak), kept where its log accounts
        for every block. `tracker` must have allocated nothing yet: else the model is built and not kept."""
        if tracker.log is not None or tracker.allocator.peak_reserved or tracker.host_tracked:
            return build(lambda: None)
        kept = self._kept.pop(key, None)
        if kept is not None and kept.restore():
            self._kept[key] = kept
            return kept.model, kept.replay(tracker)
        log = tracker.log = AllocationLog()
        try:
            model, build_peak = build(log.mark)
        finally:
            tracker.log = None
        kept = _Built.of(model, log, tracker)
        if kept is not None:
            self._kept[key] = kept
            while len(self._kept) > self.LIMIT:
                self._kept.popitem(last=False)
        return model, build_peak

    def clear(self) -> None:
        self._kept.clear()


def _held_tensors(model: nn.Module) -> list[tuple[torch.Tensor, object, tuple]]:
    """(tensor, its storage, its layout) of each tensor the model's modules hold: parameters, buffers, tensor
    attributes."""
    held = {}
    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor):
                held[id(value)] = (value, value.untyped_storage(), tensor_layout(value))
    return list(held.values())


def _contents(value):
    return list(value.items()) if isinstance(value, dict) else set(value) if isinstance(value, set) else list(value)


def _same(value, contents) -> bool:
    """Whether a container holds what it held (by identity: a tensor's == is an op)."""
    if len(value) != len(contents):
        return False
    if not contents:  # most: a module's hook dicts, empty
        return True
    if isinstance(value, set):  # of names (a module's non-persistent buffers)
        return value == contents
    if isinstance(value, dict):
        return all(a[0] == b[0] and a[1] is b[1] for a, b in zip(value.items(), contents))
    return all(a is b for a, b in zip(value, contents))


def _refill(value, contents) -> None:
    value.clear()
    if isinstance(value, list):
        value.extend(contents)
    else:
        value.update(contents)


BUILT_MODELS = BuiltModels()
