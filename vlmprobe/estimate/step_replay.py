"""The estimate's later training steps replayed from the first one's allocations, without running the model again.

An estimate point spends most of its time in per-op fake-tensor dispatch, and a plain step (one device, one micro
batch a step) runs the same program on the same shapes every time: the forward and the backward of step 2 ask the
allocator for exactly what step 1's did, in the same order. Only the allocator's state differs (step 1's optimizer
made AdamW's state), and the allocator model is what turns the same requests into the figures. So step 1 runs
for real while its requests and frees are logged (LiveBytesTracker.log), and each later forward and backward
replays that log into the allocator model: the same blocks in the same order, each freed where it was freed. The
optimizer step always runs for real (step 1's made the state; the later ones do not).

The replay has to leave Python as the real pass would, because what Python holds decides what is freed after it:
- the forward's results (loss, outputs): fresh fake tensors of the same shapes, strides and dtypes on a fresh
  storage of the same size, allocated at the point of the log where step 1 allocated theirs. The step loop then
  drops and holds them as it held step 1's (measure.hold_outputs), so the frees Python makes happen where they
  did. A result that autograd saved for the backward is held here until the log's point where the backward
  freed it;
- the backward's gradients: fresh fake tensors at the log's points where step 1's were allocated, set as each
  parameter's .grad, so the optimizer step reads them and zero_grad frees them as it freed step 1's;
- every other block (saved activations, temporaries): a bare block of the allocator model, allocated and freed
  at its logged points.

A log is replayed only if it accounts for every block it touched: the forward's blocks still alive when it
returns are the results or are freed in the backward; the backward's blocks still alive at its end are
gradients; no block allocated before the log is freed in it; nothing is allocated between the forward and the
backward. Anything else (a module caching a tensor on its first call, a wrapper that rebuilds buffers on its
second step as DDP does), and every step runs for real. Which engines repeat their steps alike is the
engine's to say (Engine.repeats_steps); the cpu backend never replays, so estimate == cpu checks the replay.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from vlmprobe.estimate.tracker import AllocationLog, LiveBytesTracker


_PLAIN = (type(None), bool, int, float, str)


class StepReplay:
    """Wraps a step's forward and backward: the first call of each runs and is logged; once both are and the log
    accounts for every block, later calls replay it (see the module doc)."""

    def __init__(self, tracker: LiveBytesTracker, parameters: list[torch.nn.Parameter]):
        self.tracker = tracker
        self.parameters = parameters
        self.plan: _Plan | None = None
        self.recorded = False  # step 1's forward and backward have run (replayable or not)
        self.refused: str | None = None  # why the log is not replayed
        self._log: AllocationLog | None = None
        self._results = None  # the logged forward's results, described (no tensor of them is kept)

    def forward(self, run):
        """`run()`'s (loss, outputs): run and logged the first time, replayed once the log is usable."""
        if self.plan is not None:
            return self.plan.forward()
        if self.recorded:
            return run()
        self._log = self.tracker.log = AllocationLog()
        try:
            results = run()
        except BaseException:  # (an out-of-memory: the point ends here)
            self.tracker.log = None
            raise
        self._log.mark()  # the forward ends: only Python's frees may come until the backward starts
        self._results = _Results.of(results, self._log, self.tracker)
        return results

    def backward(self, run, loss) -> None:
        if self.plan is not None:
            self.plan.backward()
            return
        if self.recorded:
            run(loss)
            return
        self._log.mark()
        try:
            run(loss)
        finally:
            self.tracker.log = None
            self.recorded = True
        self.plan, self.refused = _Plan.of(self._log, self._results, self.parameters, self.tracker)
        self._log = self._results = None


class _View:
    """Where a tensor sits in its storage: rebuilt on a fresh storage of the same size."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.size, self.stride, self.offset = t.dtype, tuple(t.shape), t.stride(), t.storage_offset()
        self.device, self.element_size = t.device, t.element_size()

    def fills(self, nbytes: int) -> bool:
        """Whether this tensor alone is what torch.empty_strided makes of a storage of `nbytes`."""
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride)) if all(self.size) else 0
        return self.offset == 0 and extent * self.element_size == nbytes

    def new(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)

    def on(self, storage: torch.Tensor) -> torch.Tensor:
        return storage.view(self.dtype).as_strided(self.size, self.stride, self.offset)


class _Results:
    """The forward's (loss, outputs) as a tree whose tensor leaves are described by the log index of their
    storage's allocation and their place in it; None if a leaf is neither such a tensor nor a plain value."""

    def __init__(self, slots, spec, views):
        self.slots = slots  # per leaf: ("value", v), or ("tensor", first leaf position of the same tensor)
        self.spec = spec
        self.views = views  # log index -> [(leaf position, _View)]

    @classmethod
    def of(cls, results, log: AllocationLog, tracker) -> _Results | None:
        leaves, spec = tree_flatten(results)
        slots, views, first = [], {}, {}
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in first:  # the same tensor twice (outputs.loss is the loss): rebuilt once
                    index = log.index_of(tracker, leaf)
                    if index is None:
                        return None  # not allocated by this forward
                    first[id(leaf)] = position
                    views.setdefault(index, []).append((position, _View(leaf)))
                slots.append(("tensor", first[id(leaf)]))
            elif isinstance(leaf, _PLAIN):
                slots.append(("value", leaf))
            else:
                return None
        return cls(slots, spec, views)


class _Plan:
    """One logged step made replayable: the forward's and the backward's events in order, each a bare block,
    fresh tensors (results, gradients), or a free."""

    def __init__(self, tracker, results: _Results, forward_events, backward_events):
        self.tracker, self.results = tracker, results
        self.forward_events, self.backward_events = forward_events, backward_events
        self._blocks: dict[int, object] = {}  # log index -> a bare block's handle, or a fresh storage kept alive
        self._rebuilt: dict[int, torch.Tensor] = {}  # leaf position -> the result tensor rebuilt in this forward

    @classmethod
    def of(cls, log: AllocationLog, results: _Results | None, parameters, tracker) -> tuple[_Plan | None, str | None]:
        """The plan of a log of one forward and backward, or None and why, if the log does not account for
        every block (see the module doc)."""
        events, (forward_end, backward_start) = log.events, log.marks
        if results is None:
            return None, "a result is neither a tensor the forward allocated nor a plain value"
        if log.irregular:
            return None, "freed a block allocated before it, or resized one in place"
        if any(e >= 0 for e in events[forward_end:backward_start]):
            return None, "allocated between the forward and the backward"
        freed_at = {-1 - e: i for i, e in enumerate(events) if e < 0}  # allocation index -> its free's index
        views = {index: [(("leaf", position), view) for position, view in pairs]
                 for index, pairs in results.views.items()}
        for p in parameters:
            if p.grad is not None:
                index = log.index_of(tracker, p.grad)
                if index is None or index < backward_start:
                    return None, "a gradient the backward did not allocate"
                views.setdefault(index, []).append((("grad", p), _View(p.grad)))
        for index, size in enumerate(events):
            if size < 0 or index in views:
                continue
            freed = freed_at.get(index)
            if freed is None:
                return None, f"a block of {size} B outlives the step, neither a result nor a gradient"
            if index < forward_end <= freed < backward_start:
                return None, f"a block of {size} B that is not a result was freed after the forward"
        if any(events[index] % view.element_size for index, pairs in views.items() for _, view in pairs):
            return None, "a storage that is not a whole number of its tensors' elements"

        def replayed(span):
            out = []
            for i in span:
                size = events[i]
                if size < 0:  # (what Python freed between the forward and the backward, it frees again)
                    out.append(("free", -1 - size))
                elif i in views:
                    # held here until the backward frees it (autograd held it), else Python holds it
                    out.append(("tensors", i, size, views[i], backward_start <= freed_at.get(i, -1)))
                else:
                    out.append(("block", i, size))
            return out

        return cls(tracker, results, replayed(range(forward_end)), replayed(range(backward_start, len(events)))), None

    def forward(self):
        self._run(self.forward_events)
        leaves = [self._rebuilt[value] if kind == "tensor" else value for kind, value in self.results.slots]
        self._rebuilt.clear()
        return tree_unflatten(leaves, self.results.spec)

    def backward(self) -> None:
        self._run(self.backward_events)

    def _run(self, events) -> None:
        allocator = self.tracker.allocator
        for event in events:
            if event[0] == "block":
                self._blocks[event[1]] = allocator.malloc(event[2])
            elif event[0] == "free":
                block = self._blocks.pop(event[1])
                if isinstance(block, int):
                    allocator.free(block)
                # else a fresh storage, dropped here: the tracker frees its block as it dies, now
            else:
                _, index, size, views, kept = event
                # a new storage, charged by the tracker at this point of the log: the one tensor on it made
                # directly where it fills it (most gradients: one op, not three), else views of a byte buffer
                if len(views) == 1 and views[0][1].fills(size):
                    storage = views[0][1].new()
                    tensors = [storage]
                else:
                    storage = torch.empty(size, dtype=torch.uint8, device=views[0][1].device)
                    tensors = [view.on(storage) for _, view in views]
                for ((kind, where), _), tensor in zip(views, tensors):
                    if kind == "grad":
                        where.grad = tensor
                    else:
                        self._rebuilt[where] = tensor
                if kept:
                    self._blocks[index] = storage
