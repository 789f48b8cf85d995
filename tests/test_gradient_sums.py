"""The autograd engine's sums of two gradients of one tensor: charged in place where the engine of a real run (no
dispatch mode) adds in place, and as a new block where it does not (vlmprobe.estimate.cuda_rules.gradient_sums)."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

from vlmprobe.estimate import tracker as tracker_module
from vlmprobe.estimate.tracker import AllocationLog, LiveBytesTracker

WORDS, WIDTH = 64, 16


def program(weight, ids):
    """Each way a gradient reaches a tensor twice: a tied weight (embedding and output projection), a residual, a
    path through a transposed view, and the same gradient sent to both inputs of `z + z`."""
    h = torch.nn.functional.embedding(ids, weight)
    y = h * 2 + h
    z = y.transpose(0, 1).sin().transpose(0, 1) + y
    s = z + z
    return torch.nn.functional.linear(s, weight).pow(2).sum()


def inputs():
    return torch.nn.Parameter(torch.randn(WORDS, WIDTH)), torch.randint(0, WORDS, (4, 8))


def real_engine_sums() -> tuple[int, int]:
    """(in place, out of place) sums the engine made in this program's backward with no dispatch mode on: its
    `old_var.add_(var)` and `old_var + var` (the program's backward formulas themselves add nothing)."""
    loss = program(*inputs())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    names = [event.name for event in prof.events()]
    return names.count("aten::add_"), names.count("aten::add")


def tracked_backward_allocations(fake: bool, engine_sums_in_place: bool, monkeypatch) -> int:
    if not engine_sums_in_place:
        monkeypatch.setattr(tracker_module, "first_summand", lambda func, args, kwargs: None)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        weight, ids = inputs()
        with LiveBytesTracker() as tracker:
            loss = program(weight, ids)
            tracker.log = log = AllocationLog()
            loss.backward()
    monkeypatch.undo()
    return sum(1 for event in log.events if event >= 0)


@pytest.mark.parametrize("fake", [True, False], ids=["fake tensors", "cpu tensors"])
def test_the_tracker_sums_gradients_in_place_exactly_where_a_real_engine_does(fake, monkeypatch):
    in_place, out_of_place = real_engine_sums()
    assert in_place >= 2 and out_of_place >= 2  # the program has both kinds
    # under any dispatch mode the engine itself sums every pair out of place: the tracker alone decides
    every_sum_allocates = tracked_backward_allocations(fake, False, monkeypatch)
    charged = tracked_backward_allocations(fake, True, monkeypatch)
    assert every_sum_allocates - charged == in_place


def test_a_summed_gradient_keeps_its_block_and_frees_it_once():
    x = torch.randn(1024, requires_grad=True)  # made before the tracker: x.grad is its only block at the end
    with LiveBytesTracker() as t:
        a = x.exp()
        loss = (a * 3 + a).pow(2).sum()  # a's two gradients: a residual sum, in place
        loss.backward()
        del a, loss
        assert t.current == 4096  # x.grad, 1024 floats
    assert x.grad.shape == x.shape
