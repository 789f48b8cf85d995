"""The estimate's training steps replayed from logged allocations, without running the model again: a point's
later forward and backward from its first ones, and its optimizer steps from an earlier point's.

A plain step (one device, one micro batch a step) runs the same program on the same shapes every time, so step 1 runs
for real while its requests and frees are logged (LiveBytesTracker.log), and each later forward and backward replays
that log into the allocator model. The replay leaves Python as the real pass would: results and gradients are fresh
fake tensors allocated where step 1's were, every other block a bare block of the allocator model. A log is replayed
only if it accounts for every block it touched; else every step runs. Which engines repeat their steps alike is the
engine's to say (Engine.repeats_steps). Optimizer steps replay an earlier point's logs of the same key
(OptimizerPlans). The cpu backend never replays, so estimate == cpu checks the replay. The details: docs/estimate.md.
"""

from __future__ import annotations

import collections
import functools

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from vlmprobe.estimate.replay.blocks import BlockReplay
from vlmprobe.estimate.replay.playback import View, play, play_events, tensor_layout
from vlmprobe.estimate.tracker import AllocationLog, LiveBytesTracker

__all__ = ["OPTIMIZER_PLANS", "OptimizerPlans", "StepReplay"]


_PLAIN = (type(None), bool, int, float, str)


class StepReplay:
    """Wraps a point's forward, backward and optimizer step (see the module doc): the first forward and backward
    run and are logged, and later ones replay that log once it accounts for every block; each optimizer step is
    replayed from the logs of an earlier point of this process with the same optimizer key, or run (and logged
    where no such log is kept yet)."""

    def __init__(self, tracker: LiveBytesTracker, optimizer: torch.optim.Optimizer, towers=()):
        self.tracker = tracker
        self.optimizer = optimizer  # its parameters are the ones the backward gives gradients
        self.towers = towers  # lists of blocks that run one program, replayed within step 1 (block_replay)
        self._blocks = None  # the installed BlockReplay, during step 1's forward and backward
        self.plan: _Plan | None = None
        self.recorded = False  # step 1's forward and backward have run (replayable or not)
        self.refused: str | None = None  # why the log is not replayed
        self._log: AllocationLog | None = None
        self._results = None  # the logged forward's results, described (no tensor of them is kept)
        self._steps = 0  # optimizer steps this point will run
        self._stepped = 0  # optimizer steps run or replayed so far
        self._key = None  # the optimizer's key (OptimizerPlans.key), from its first step
        self._optimizer_plans: list | None = None  # one per step, where every one is known

    def wrap(self, forward, backward, step, steps: int, accum: int):
        """The loop's forward, backward and optimizer step (callables as train_steps calls them) for a point of
        `steps` optimizer steps of `accum` micro batches. The forward and backward are replayed only without
        accumulation: a micro step's backward adds into the gradients the one before it made, so micro steps
        differ. The optimizer step sees whole gradients either way."""
        self._steps = steps
        step = functools.partial(self.step, step)
        if accum > 1:
            return forward, backward, step
        return functools.partial(self.forward, forward), functools.partial(self.backward, backward), step

    def forward(self, run):
        """`run()`'s (loss, outputs): run and logged the first time, replayed once the log is usable."""
        if self.plan is not None:
            return self.plan.forward()
        if self.recorded:
            return run()
        self._log = self.tracker.log = AllocationLog()
        if self.towers:
            self._blocks = BlockReplay(self.tracker, self.towers).install()
        try:
            results = run()
        except BaseException:  # (an out-of-memory: the point ends here)
            self.tracker.log = None
            self._abandon_blocks()
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
        except BaseException:
            self._abandon_blocks()
            raise
        finally:
            self.tracker.log = None
            self.recorded = True
        if self._blocks is not None:
            blocks, self._blocks = self._blocks, None
            blocks.close()  # block_replay.Mismatch: the point is measured again, every block run
        self.plan, self.refused = _Plan.of(self._log, self._results, _parameters(self.optimizer), self.tracker)
        self._log = self._results = None

    def _abandon_blocks(self) -> None:
        if self._blocks is not None:
            self._blocks.abandon()
            self._blocks = None

    def step(self, run) -> None:
        """`run()` (the engine's optimizer step), or its replay: every step of this point is replayed where this
        process keeps a log of each for the optimizer's key; else each runs, logged if no log of it is kept."""
        index, self._stepped = self._stepped, self._stepped + 1
        if index == 0:
            self._key = OPTIMIZER_PLANS.key(self.optimizer)
            self._optimizer_plans = OPTIMIZER_PLANS.every(self._key, self._steps)
        if self._optimizer_plans is not None:
            self._optimizer_plans[index].run(self.tracker, self.optimizer)
        elif self._key is None or OPTIMIZER_PLANS.known(self._key, index):
            run()
        else:
            OPTIMIZER_PLANS.record(self._key, index, run, self.tracker, self.optimizer)


class _Results:
    """The forward's (loss, outputs) as a tree whose tensor leaves are described by the log index of their
    storage's allocation and their place in it; None if a leaf is neither such a tensor nor a plain value, or if
    the tree cannot be rebuilt from its leaves (transformers' ModelOutput pytree rebuilds an output from its class's
    fields: Qwen3-VL-MoE's vision output, given router_logits by transformers' output capture, has no such field)."""

    def __init__(self, slots, spec, views):
        self.slots = slots  # per leaf: ("value", v), or ("tensor", first leaf position of the same tensor)
        self.spec = spec
        self.views = views  # log index -> [(leaf position, View)]

    @classmethod
    def of(cls, results, log: AllocationLog, tracker) -> _Results | None:
        leaves, spec = tree_flatten(results)
        try:
            tree_unflatten(leaves, spec)
        except TypeError:
            return None
        slots, views, first = [], {}, {}
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in first:  # the same tensor twice (outputs.loss is the loss): rebuilt once
                    index = log.index_of(tracker, leaf)
                    if index is None:
                        return None  # not allocated by this forward
                    first[id(leaf)] = position
                    views.setdefault(index, []).append((position, View(leaf)))
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
            return None, "a result is neither a tensor the forward allocated nor a plain value, or cannot be rebuilt"
        if any(e >= 0 for e in events[forward_end:backward_start]):
            return None, "allocated between the forward and the backward"
        freed_at = _freed_at(events)
        views = {index: [(("leaf", position), view) for position, view in pairs]
                 for index, pairs in results.views.items()}
        for p in parameters:
            if p.grad is not None:
                index = log.index_of(tracker, p.grad)
                if index is None or index < backward_start:
                    return None, "a gradient the backward did not allocate"
                views.setdefault(index, []).append((("grad", p), View(p.grad)))
        for index, size in enumerate(events):
            if size < 0 or index in views:
                continue
            freed = freed_at.get(index)
            if freed is None:
                return None, f"a block of {size} B outlives the step, neither a result nor a gradient"
            if index < forward_end <= freed < backward_start:
                return None, f"a block of {size} B that is not a result was freed after the forward"
        refused = _refusal(log, views)
        if refused:
            return None, refused
        # a result autograd saved is held by the replay until the backward frees it; Python holds the others
        held = functools.partial(play_events, events, views=views, freed_at=freed_at, held_before=backward_start)
        return cls(tracker, results, held(range(forward_end)), held(range(backward_start, len(events)))), None

    def forward(self):
        play(self.tracker, self.forward_events, self._blocks, self._place)
        leaves = [self._rebuilt[value] if kind == "tensor" else value for kind, value in self.results.slots]
        self._rebuilt.clear()
        return tree_unflatten(leaves, self.results.spec)

    def backward(self) -> None:
        play(self.tracker, self.backward_events, self._blocks, self._place)

    def _place(self, kind, where, tensor) -> None:
        if kind == "grad":
            where.grad = tensor
        else:
            self._rebuilt[where] = tensor


def _freed_at(events: list[int]) -> dict[int, int]:
    """A log's allocation index -> the index of its free, for the blocks it frees."""
    return {-1 - e: i for i, e in enumerate(events) if e < 0}


def _refusal(log: AllocationLog, views: dict) -> str | None:
    """Why a log whose fresh tensors are `views` (allocation index -> [(where, View)]) cannot be played back,
    whichever step it is of; None if it can."""
    if log.irregular:
        return "freed a block allocated before it, or resized one in place"
    if any(log.events[index] % view.element_size for index, pairs in views.items() for _, view in pairs):
        return "a storage that is not a whole number of its tensors' elements"
    return None


class _OptimizerPlan:
    """One logged optimizer step made replayable: its temporaries as bare blocks, and the state it made (first
    steps) as fresh tensors put in the optimizer's state where the logged step put its own."""

    def __init__(self, events: list[tuple]):
        self.events = events

    @classmethod
    def of(cls, log: AllocationLog, optimizer, tracker) -> tuple[_OptimizerPlan | None, str | None]:
        """The plan of a log of one optimizer step, or None and why, if a block it left alive is not the
        storage of a state tensor, or it freed or resized a block allocated before it."""
        events = log.events
        views: dict[int, list] = {}
        for position, p in enumerate(_parameters(optimizer)):
            for key, t in optimizer.state.get(p, {}).items():
                index = log.index_of(tracker, t) if isinstance(t, torch.Tensor) else None
                if index is not None:
                    views.setdefault(index, []).append((("state", (position, key)), View(t)))
        freed_at = _freed_at(events)
        for index, size in enumerate(events):
            if size >= 0 and index not in views and index not in freed_at:
                return None, f"a block of {size} B outlives the optimizer step, not its state"
        refused = _refusal(log, views)
        if refused:
            return None, refused
        # the state outlives the step: held by the optimizer, never by the replay
        return cls(play_events(events, range(len(events)), views, freed_at, held_before=len(events))), None

    def run(self, tracker, optimizer) -> None:
        parameters = _parameters(optimizer)

        def place(kind, where, tensor):
            position, key = where
            optimizer.state.setdefault(parameters[position], {})[key] = tensor

        # Only the state tensors on the device are made: the host's (AdamW's scalar step counters) are read by
        # no figure, and no step of this point runs for real after a replayed one (StepReplay.step)
        play(tracker, self.events, {}, place)


def _parameters(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


class OptimizerPlans:
    """The optimizer step logs this process keeps, across the points it measures (a pool worker, or the sweep
    process under launcher=local, measures many one after another): by optimizer key and step index.

    Points that differ only in what the forward sees (batch, length, image size, how outputs are held, the
    allocator's settings) have optimizers that allocate the same blocks in the same order at each step: an
    optimizer step reads the parameters, their gradients and its own state, never the batch. So a later point
    with the same key replays each of its optimizer steps from the logs, when a log of every one of its steps is
    kept; else all run for real. The key holds what can change those blocks: the optimizer's class and every
    setting of each parameter group, and each parameter's and gradient's shape, strides, offset, dtype and
    device, in the optimizer's order. A step's log is kept only if it accounts for every block (_OptimizerPlan.of);
    one refused is kept as refused, so no later point logs it again."""

    LIMIT = 8  # keys kept, the oldest dropped first (a sweep's points share a few: one per model and knobs)

    def __init__(self):
        self._plans: collections.OrderedDict = collections.OrderedDict()  # key -> {step index: plan or reason}

    @staticmethod
    def key(optimizer) -> tuple | None:
        """What decides the blocks the optimizer's steps allocate (see the class doc), or None where a setting
        is not a plain value (a tensor learning rate, a closure): such an optimizer is never replayed."""
        groups = []
        for group in optimizer.param_groups:
            settings = tuple(sorted((k, v) for k, v in group.items() if k != "params"))
            if not all(_plain(v) for _, v in settings):
                return None
            groups.append((settings, tuple(tensor_layout(p) + (None if p.grad is None else tensor_layout(p.grad),)
                                           for p in group["params"])))
        return type(optimizer).__module__, type(optimizer).__qualname__, tuple(groups)

    def every(self, key, steps: int) -> list[_OptimizerPlan] | None:
        """A plan for each of `steps` steps, where all are kept for `key`; else None."""
        kept = self._plans.get(key, {}) if key is not None else {}
        plans = [kept.get(index) for index in range(steps)]
        return plans if all(isinstance(plan, _OptimizerPlan) for plan in plans) else None

    def known(self, key, index: int) -> bool:
        return index in self._plans.get(key, {})

    def record(self, key, index: int, run, tracker, optimizer) -> None:
        """Run step `index` logged; keep its plan, or why it is refused. An out-of-memory keeps nothing."""
        log = tracker.log = AllocationLog()
        try:
            run()
        finally:
            tracker.log = None
        plan, refused = _OptimizerPlan.of(log, optimizer, tracker)
        self._plans.setdefault(key, {})[index] = plan if plan is not None else refused
        self._plans.move_to_end(key)
        while len(self._plans) > self.LIMIT:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()


def _plain(value) -> bool:
    return isinstance(value, _PLAIN + (torch.dtype,)) or (
        isinstance(value, tuple) and all(_plain(v) for v in value))


OPTIMIZER_PLANS = OptimizerPlans()
