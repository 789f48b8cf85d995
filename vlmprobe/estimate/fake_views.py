"""FakeTensorMode with view ops answered by torch's meta kernel directly, without its dispatch cache.

Why: DeepSpeed ZeRO-3 cuts flat buffers into per-parameter pieces with narrow/slice/view at a new offset each
time (tens of thousands per step on a 7B model). FakeTensorMode keys its cache on the offsets, so every such
view misses: it pays the key, a Python decomposition (slice), the meta kernel and a new cache entry, ~0.5 ms
a view on a 2-core machine, about a third of a ZeRO-3 estimate's time.

Why the answer is the same: a view's output (size, stride, storage offset, dtype, device, and the storage it
aliases) is a pure function of its inputs' metadata and its arguments; FakeTensorMode computes it by running
the op's meta kernel on its inputs as meta tensors and wrapping the outputs (the last step of
FakeTensorMode._dispatch_impl), and a cache hit rebuilds that same output. That step is run here as is. Only
where FakeTensorMode would do something else first is it left to do so: an input that is not one of this
mode's fake tensors (a real tensor to convert, another subclass), a constant fake (it propagates the value),
symbolic shapes or real-tensor propagation (neither is used by the estimate). Views allocate nothing, so
the tracker's figures cannot move; tests/test_fake_views.py compares every view op's output with
FakeTensorMode's own, and the estimate == cpu tests check the bytes.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

from vlmprobe.estimate.tracker import aliases_inputs


class FakeTensorModeWithDirectViews(FakeTensorMode):
    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if aliases_inputs(func) and not self.propagate_real_tensors and self.shape_env is None:
            source = only_tensor(args, kwargs)
            if type(source) is FakeTensor and source.fake_mode is self and source.constant is None:
                with in_kernel_invocation_manager(self):
                    out = func(*args, **kwargs)
                # what wrap_meta_outputs_with_default_device_logic makes of it: the one input's device is the
                # common device, each new meta output becomes a FakeTensor there (its memo of the meta tensor is
                # left out: nothing else holds that tensor), an output that is the input itself stays as is
                device = source.fake_device
                wrap = lambda t: t if type(t) is FakeTensor else FakeTensor(self, t, device)  # noqa: E731
                return type(out)(map(wrap, out)) if isinstance(out, (list, tuple)) else wrap(out)
        return super().dispatch(func, types, args, kwargs)


def only_tensor(args, kwargs):
    """The op's first argument when it is its only tensor (a view's `self`; a plain loop, as pytree costs more
    than the view itself), else None."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return None
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, torch.Tensor) or (
                isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)):
            return None
    return first
