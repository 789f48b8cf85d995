"""A model's repeated blocks replayed within a point's first step: the first and the last block of a tower run, the
ones between replay their allocations, in the forward and in the backward.

The blocks of a tower run one program (the same class, settings and parameter shapes, on inputs of the same shape),
so they ask the allocator for the same blocks in the same order. Which towers are such is the model family's to say
(ModelSpec.repeated_blocks: nanoVLM's), and the blocks must match module by module. Block 0's forward and block N-1's
backward, logged (tracker.AllocationLog), are the templates blocks 1 .. N-2 play: bare blocks of the allocator model,
fresh tensors for outputs and gradients, each freed where the template freed its own. Anything that breaks this is a
Mismatch: the point is measured again with every block run (vlmprobe.point.measure.measure). The cpu backend runs
every block, so estimate == cpu checks the replay (tests/test_block_replay.py). The details: docs/estimate.md.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from vlmprobe.estimate.replay.playback import View

__all__ = ["BlockReplay", "Mismatch"]


class Mismatch(Exception):
    """The blocks did not repeat block 0's program as the replay needs: measure the point again without it."""


class BlockReplay:
    """Installed on the towers' blocks for the first forward and backward of a point (see the module doc)."""

    def __init__(self, tracker, towers):
        self.tracker = tracker
        self.problems: list[str] = []
        self.towers = [_Tower(self, list(blocks)) for blocks in towers if len(blocks) >= 3]
        self.towers = [tower for tower in self.towers if tower.usable]

    def install(self) -> BlockReplay:
        for tower in self.towers:
            tower.install()
        return self

    def close(self) -> None:
        """Uninstall; raise Mismatch if the replay could not stand for every block's run."""
        for tower in self.towers:
            tower.uninstall()
        if self.problems:
            raise Mismatch("; ".join(dict.fromkeys(self.problems)))

    def abandon(self) -> None:
        """Uninstall after the step failed (an out-of-memory): its figures are the failure's, nothing to check."""
        for tower in self.towers:
            tower.uninstall()


class _Segment:
    """A block's forward in the log: its events with frees relative to the segment, its output's allocation and
    view, and what it left alive."""

    def __init__(self, events, output, view, alive):
        self.events, self.output, self.view, self.alive = events, output, view, alive

    @classmethod
    def of(cls, log, tracker, start: int, out) -> _Segment | str:
        end = len(log.events)
        if not isinstance(out, torch.Tensor):
            return "its output is not one tensor"
        output = log.index_of(tracker, out)
        if output is None or output < start:
            return "its output is not a storage it allocated"
        events, freed = [], set()
        for e in log.events[start:end]:
            if e >= 0:
                events.append(e)
            elif -1 - e >= start:
                events.append(e + start)  # -1 - (index within the segment)
                freed.add(-1 - e - start)
            else:
                return "it freed a block allocated before it"
        alive = [k for k, e in enumerate(events) if e >= 0 and k not in freed]
        return cls(events, output - start, View(out), alive)

    def same(self, other: _Segment) -> bool:
        return self.events == other.events and self.output == other.output and self.view.layout == other.view.layout


class _Tower:
    def __init__(self, replay: BlockReplay, blocks: list[nn.Module]):
        self.replay, self.tracker, self.blocks = replay, replay.tracker, blocks
        self.usable = _no_global_hooks() and len({_signature(b) for b in blocks}) == 1 and \
            len({id(p) for b in blocks for p in b.parameters()}) == sum(len(list(b.parameters())) for b in blocks)
        self._installed: list[tuple[nn.Module, object]] = []
        self.next = 0  # the block whose call comes next
        self.first: _Segment | None = None
        self.first_call = None  # block 0's input layout and other arguments
        self.last_start = self.last_input = None  # block N-1's forward segment start, its input's log index
        self.backward_start = self.grad_out = None  # block N-1's backward segment start, its incoming gradient's index
        self.backward: _Backward | None = None
        self.backward_made = False
        self.tickets: list[_Ticket] = []
        self.external = {}  # forward allocation (relative) -> {"first"/"last": log length after its free}
        self.callbacks: list[int] = []

    def problem(self, why: str) -> None:
        self.replay.problems.append(f"{type(self.blocks[0]).__name__} blocks: {why}")

    def install(self) -> None:
        for index, block in enumerate(self.blocks):
            self._installed.append((block, block.__dict__.get("forward")))
            block.forward = functools.partial(self.call, index, block.forward)

    def uninstall(self) -> None:
        for block, own in self._installed:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._installed.clear()
        for handle in self.callbacks:
            self.tracker.after_free.pop(handle, None)
        self.callbacks.clear()
        if self.next not in (0, len(self.blocks)):
            self.problem(f"{self.next} of {len(self.blocks)} blocks were called")
        for ticket in self.tickets:
            if ticket.kept or ticket.input is not None:
                self.problem("a replayed block's forward blocks outlived the backward")
            for p, handle in ticket.grads:
                if p.grad is None or self.tracker.handle_of(p.grad.untyped_storage()) != handle:
                    self.problem("autograd did not take a replayed gradient as the parameter's .grad")
        self.tickets.clear()

    # ---- the forward ----------------------------------------------------------------------------------------

    def call(self, index: int, forward, *args, **kwargs):
        log = self.tracker.log
        if index != self.next or log is None or not args or not isinstance(args[0], torch.Tensor):
            self.problem(f"block {index} was called out of order, outside the logged step, or without a hidden state")
            self.next = -1
            return forward(*args, **kwargs)
        self.next += 1
        last = len(self.blocks) - 1
        if index == 0 or index == last:
            return self._run(index, forward, args, kwargs, log)
        if self.first is None or self.backward_start is not None or self._call_of(args, kwargs) != self.first_call:
            self.problem(f"block {index} cannot replay block 0 (other arguments, or no template)")
            self.first = None
            return forward(*args, **kwargs)
        block = self.blocks[index]
        ticket = _Ticket(self, list(block.parameters()))
        # without a graph (a frozen tower) nothing holds the hidden state past the call: the caller drops it
        ticket.holds_input = torch.is_grad_enabled() and (args[0].requires_grad or any(p.requires_grad for p in ticket.params))
        self.tickets.append(ticket)
        return _Replayed.apply(ticket, args[0], *ticket.params)

    def _run(self, index: int, forward, args, kwargs, log):
        x = args[0]
        start = len(log.events)
        input_index = log.index_of(self.tracker, x)
        out = forward(*args, **kwargs)
        segment = _Segment.of(log, self.tracker, start, out)
        if isinstance(segment, str):
            self.problem(f"block {index}: {segment}")
            self.first = None
            return out
        handles = {index: handle for handle, index in log.live.items() if index >= start}
        kept = [k for k in segment.alive if k != segment.output]
        if index == 0:
            self.first, self.first_call = segment, self._call_of(args, kwargs)
            for k in kept:
                self._watch(handles[start + k], functools.partial(self._first_freed, k))
        else:
            if self.first is None or not segment.same(self.first) or self._call_of(args, kwargs) != self.first_call:
                self.problem(f"block {index}'s forward is not block 0's")
                self.first = None
                return out
            self.last_start, self.last_input = start, input_index
            for k in kept:
                self._watch(handles[start + k], functools.partial(self._last_freed, k))
            if out.requires_grad:
                out.register_hook(self._backward_begins)
        return out

    @staticmethod
    def _call_of(args, kwargs) -> tuple:
        """What a call must repeat: the hidden state's layout and grad flag; every other argument itself (a tensor
        by identity: one rotary table, one mask for every block)."""
        x = args[0]
        return View(x).layout, x.requires_grad, _plain(args[1:]), _plain(kwargs)

    def _watch(self, handle: int, callback) -> None:
        self.tracker.after_free[handle] = callback
        self.callbacks.append(handle)

    # ---- what the template kept, freed outside its backward -------------------------------------------------

    def _first_freed(self, k: int) -> None:
        """Block 0's kept allocation k was freed: outside the backward (autocast's cast cache), every replayed
        copy is freed with it."""
        if self.backward_start is not None:
            return  # in block 0's own backward: the copies went in their replayed backwards (checked on close)
        for ticket in self.tickets:
            handle = ticket.kept.pop(k, None)
            if handle is not None:
                self.tracker.free_block(handle)
        self._freed_outside(k, "first")

    def _last_freed(self, k: int) -> None:
        if self.backward_start is None:
            self._freed_outside(k, "last")

    def _freed_outside(self, k: int, which: str) -> None:
        log = self.tracker.log
        at = self.external.setdefault(k, {})
        at[which] = len(log.events)
        if len(at) == 2 and any(e >= 0 for e in log.events[min(at.values()) - 1:max(at.values())]):
            self.problem("blocks 0 and N-1 freed a kept block at different times")

    # ---- the backward ----------------------------------------------------------------------------------------

    def _backward_begins(self, grad) -> None:
        log = self.tracker.log
        self.backward_start = len(log.events)
        self.grad_out = log.index_of(self.tracker, grad)

    def backward_template(self, grad_in) -> _Backward | None:
        """Block N-1's backward, from its output's gradient to now (the first replayed block's backward starts),
        made a template; None (and a problem) where it does not account for every block."""
        if self.backward_made:
            return self.backward
        self.backward_made = True  # made once: a refusal stands for every replayed block
        if self.backward_start is None or self.first is None:
            self.problem("no backward template: block N-1 had no backward before the replayed ones")
            return None
        log, tracker, start = self.tracker.log, self.tracker, self.backward_start
        last = self.blocks[-1]
        end = len(log.events)
        forward_end = self.last_start + len(self.first.events)
        kept = {k for k in self.first.alive if k != self.first.output}
        events, freed = [], set()
        for e in log.events[start:end]:
            if e >= 0:
                events.append(("alloc", e))
                continue
            k = -1 - e
            if start <= k < end:
                events.append(("block", k - start))
                freed.add(k - start)
            elif self.last_start <= k < forward_end and k - self.last_start in kept:
                events.append(("kept", k - self.last_start))
                kept.discard(k - self.last_start)
            elif k == self.last_input:
                events.append(("input",))
            elif k == self.grad_out:
                events.append(("grad_out",))
            else:
                self.problem("block N-1's backward freed a block that is not its own, its input or its gradient")
                return None
        if any(len(self.external.get(k, ())) != 2 for k in kept):
            self.problem("block N-1 kept a block its backward did not free")
            return None
        fresh: dict[int, tuple] = {}
        for j, p in enumerate(last.parameters()):
            if p.grad is not None:
                index = log.index_of(tracker, p.grad)
                view = View(p.grad)
                if index is None or not start <= index < end or not view.fills(log.events[index]):
                    self.problem("a parameter's gradient is not a storage of its own from block N-1's backward")
                    return None
                fresh[index - start] = ("grad", j, view)
        passthrough = False
        index = log.index_of(tracker, grad_in)
        if index == self.grad_out:
            passthrough = True
        elif index is not None and start <= index < end and index - start not in fresh and \
                View(grad_in).fills(log.events[index]):
            fresh[index - start] = ("grad_in", None, View(grad_in))
        else:
            self.problem("the input's gradient is neither a storage block N-1's backward allocated nor its own")
            return None
        alive = [k for k, event in enumerate(events) if event[0] == "alloc" and k not in freed]
        if sorted(alive) != sorted(fresh):
            self.problem("a block of block N-1's backward outlives it, neither a gradient nor freed")
            return None
        self.backward = _Backward(events, fresh, passthrough)
        return self.backward


class _Backward:
    def __init__(self, events, fresh, passthrough):
        self.events = events  # ("alloc", bytes) | ("block", k) | ("kept", k) | ("input",) | ("grad_out",)
        self.fresh = fresh  # event index -> ("grad", parameter position, view) | ("grad_in", None, view)
        self.passthrough = passthrough  # the input's gradient is the gradient it was given


class _Ticket:
    """One replayed block: what its forward left allocated, until its backward frees it."""

    def __init__(self, tower: _Tower, params: list):
        self.tower, self.tracker, self.params = tower, tower.tracker, params
        self.kept: dict[int, int] = {}  # template allocation (relative) -> bare block handle
        self.input = None  # the hidden state it was given: freed where the template's input was
        self.holds_input = True  # False without a graph (set by the caller)
        self.grads: list[tuple] = []  # (parameter, handle of the gradient made for it)

    def forward(self, x):
        segment, tracker = self.tower.first, self.tracker
        blocks, out = {}, None
        for k, e in enumerate(segment.events):
            if e < 0:
                tracker.free_block(blocks.pop(-1 - e))
            elif k == segment.output:
                out = segment.view.fresh(e, tracker)
            else:
                blocks[k] = tracker.malloc_block(e)
        self.kept, self.input = blocks, (x if self.holds_input else None)
        return out

    def backward(self, grad_out):
        template = self.tower.backward_template(grad_out)
        grads = [None] * len(self.params)
        if template is None:
            self.kept.clear()
            self.input = None
            return None, grads
        tracker, blocks, grad_in = self.tracker, {}, None
        for k, event in enumerate(template.events):
            kind = event[0]
            if kind == "alloc":
                fresh = template.fresh.get(k)
                if fresh is None:
                    blocks[k] = tracker.malloc_block(event[1])
                    continue
                tensor = fresh[2].fresh(event[1], tracker)
                if fresh[0] == "grad":
                    grads[fresh[1]] = tensor
                    self.grads.append((self.params[fresh[1]], tracker.handle_of(tensor.untyped_storage())))
                else:
                    grad_in = tensor
            elif kind == "block":
                tracker.free_block(blocks.pop(event[1]))
            elif kind == "kept":
                handle = self.kept.pop(event[1], None)
                if handle is None:
                    self.tower.problem("a kept block the template freed in backward was freed before")
                else:
                    tracker.free_block(handle)
            elif kind == "input":
                if self.input is None or not tracker.release(self.input.untyped_storage()):
                    self.tower.problem("a replayed block's input was not a live block where the template freed its own")
                self.input = None
            elif not tracker.release(grad_out.untyped_storage()):
                self.tower.problem("a replayed block's gradient was not a live block where the template freed its own")
        return (grad_out if template.passthrough else grad_in), grads


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ticket, x, *params):
        ctx.ticket = ticket
        return ticket.forward(x)

    @staticmethod
    def backward(ctx, grad_out):
        grad_in, grads = ctx.ticket.backward(grad_out)
        ctx.ticket = None
        return (None, grad_in, *grads)


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
# settings that name a module's place and nothing else: peft's LoRA layer keeps the name it was injected at
# (kwargs["target_name"], read when adapters are added, never in forward)
_NAMES = {"target_name"}


def _plain(value):
    """A comparable description of a module attribute or a call's argument: plain values as themselves, containers
    item by item, functions and partials by what they call, anything else by identity (a shared config object, a
    tensor every block is given)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_plain(v) for v in value)
    if isinstance(value, set):
        return "set", tuple(sorted(map(repr, value)))
    if isinstance(value, dict):
        return "dict", tuple((k, _plain(v)) for k, v in value.items() if k not in _NAMES)
    if isinstance(value, functools.partial):
        return "partial", _plain(value.func), tuple(_plain(a) for a in value.args), _plain(value.keywords)
    if hasattr(value, "__func__"):  # a bound method: the function (its object is the module being compared)
        return "method", value.__func__.__qualname__
    if callable(value) and hasattr(value, "__qualname__"):
        return "function", value.__module__, value.__qualname__
    return "object", id(value)


def _signature(block: nn.Module) -> tuple:
    """What decides a block's program: per module its class, attributes, parameters and buffers (layout, dtype,
    grad flag); a module with hooks gives a signature of its own (id), so its tower is not replayed."""
    out = []
    for name, module in block.named_modules():
        if any(getattr(module, hooks, None) for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                           "_backward_pre_hooks")):
            return ("hooked", id(block))
        attrs = tuple((k, _plain(v)) for k, v in sorted(vars(module).items())
                      if not k.startswith("_") and not isinstance(v, nn.Module))
        tensors = tuple((k, tuple(t.shape), t.stride(), t.dtype, t.requires_grad, t.grad is None)
                        for k, t in (*module._parameters.items(), *module._buffers.items()) if t is not None)
        out.append((name, type(module), module.training, attrs, tensors))
    return tuple(out)


def _no_global_hooks() -> bool:
    from torch.nn.modules import module

    return not any(getattr(module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))
