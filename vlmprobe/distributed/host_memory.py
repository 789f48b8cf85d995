"""Offload to the CPU where the device is the CPU too: which buffers DeepSpeed keeps in host memory.

On the cpu and estimate backends every tensor is a CPU tensor, so host and device memory are one pool. A
CUDA run tells them apart by the device each buffer is made on, and DeepSpeed names that device in its
own code: the accelerator's device (`get_accelerator().current_device_name()`, a tensor's `.device`) for
device buffers, the host as the string "cpu" (`self.device = 'cpu'` / `OffloadDeviceEnum.cpu` of the
offload paths, `remote_device` of partitioned parameters), no device at all (torch's default device is the
CPU on CUDA too: the pinned fp16 flat buffer of stage3.py:_create_param_groups_fp16_flat_cpu_memory), or
`.cpu()`. `host_placement()` reads those names where they are given and tells the tracker
(vlmprobe.estimate.tracker.PLACEMENT):
- the CPU accelerator's device name becomes `AcceleratorDevice("cpu")`, a str that is still "cpu" to torch
  and DeepSpeed but says "device" here; a torch.device object (a tensor's `.device`) says "device" too;
- torch.empty / zeros / ones / full (DeepSpeed's factories) place what they make by their `device`: a plain
  "cpu" string, or none, is the host (none: the device while the model is built, under `placed("device")`).
  deepspeed.zero.Init wraps the same factories while the model is built and puts back, when it ends, the
  ones it kept when DeepSpeed was imported (partition_parameters.py: `_orig_torch_empty`, ...): those are
  placed too, so its pieces made on `remote_device` "cpu" are the host and the placement outlives it;
- `Tensor.to` / `.cpu()` across sides copy, as on CUDA (on the CPU they would alias): the copy of an
  offloaded partition to the device before its all-gather (partition_parameters.py: `ds_tensor.to(
  current_device_name())`), the host gradient buffer brought to the device to add a micro step's gradient
  (stage3.py:partition_grads, `grad_buffer.to(grad_partition.device)`); `.to(dtype=...)` stays on its side;
- the accelerator's `pin_memory(t)` is a pinned copy of `t` on the host (torch's `t.pin_memory()`), and
  `on_accelerator(t)` answers whether `t` is a device buffer (stage3.py:partition_grads chooses its copy path
  by it).
Everything else is placed by the tracker: an op over host storages only runs on the host (the optimizer
step over the fp32 partitions, its moments, the gradient norms of the host gradients), any other on the
device (forward, backward, the gathered parameters, the reduce buckets).
Host figures are the bytes of live host buffers, pinned ones rounded up to a power of two as torch's
CachingHostAllocator rounds them; a freed pinned block that torch keeps cached for reuse is not counted (as a
freed device block is not in `allocated`). DeepSpeedCPUAdam's in-place update is not modelled (here torch's
AdamW over the host partitions, with its temporaries).
"""

from __future__ import annotations

import contextlib

import torch

from vlmprobe.estimate.tracker import PLACEMENT, LiveBytesTracker

FACTORIES = ("empty", "zeros", "ones", "full")  # the factories DeepSpeed makes its buffers with


class AcceleratorDevice(str):
    """The accelerator's device name: "cpu" to torch and DeepSpeed, the device here."""


@contextlib.contextmanager
def placed(where: str | None):
    token = PLACEMENT.set(where)
    try:
        yield
    finally:
        PLACEMENT.reset(token)


def side_of_device(device) -> str:
    """'device' or 'host': where a buffer made with this `device` argument lives on CUDA."""
    if device is None:  # torch's default device: the CPU, but the device where a caller placed it (the build)
        return PLACEMENT.get() or "host"
    if isinstance(device, (AcceleratorDevice, torch.device)):
        return "device"
    # a str: "cpu", or DeepSpeed's OffloadDeviceEnum.cpu (a str enum: its value, not its str(), says "cpu")
    return "host" if isinstance(device, str) and device.startswith("cpu") else "device"


def current_tracker() -> LiveBytesTracker:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    found = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveBytesTracker)]
    if not found:
        raise RuntimeError("host memory is told apart by the tracker: run inside the cpu or estimate backend")
    return found[-1]


def _to_target(args, kwargs):
    """What a Tensor.to(...) call names as its target (a device, or a tensor whose side to take), or None
    when it names only a dtype."""
    for value in (kwargs.get("device"), *args):
        if isinstance(value, (str, torch.device, torch.Tensor)):
            return value
    return None


@contextlib.contextmanager
def host_placement():
    """While on: the tracker counts host buffers apart, placed as the module doc says."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters

    tracker = current_tracker()
    tracker.track_host()
    side = lambda t: "host" if tracker.on_host(t) else "device"  # noqa: E731
    to, cpu = torch.Tensor.to, torch.Tensor.cpu

    def copy_across(source: torch.Tensor, out: torch.Tensor, target: str) -> torch.Tensor:
        if side(source) != target and out.untyped_storage() is source.untyped_storage():
            with placed(target):  # the CPU aliased what CUDA copies
                return out.clone()
        return out

    def tensor_to(self, *args, **kwargs):
        device = _to_target(args, kwargs)
        if device is None:
            return to(self, *args, **kwargs)
        target = side(device) if isinstance(device, torch.Tensor) else side_of_device(device)
        with placed(target):
            return copy_across(self, to(self, *args, **kwargs), target)

    def tensor_cpu(self, *args, **kwargs):
        with placed("host"):
            return copy_across(self, cpu(self, *args, **kwargs), "host")

    def factory(make):
        def placed_factory(*args, **kwargs):
            with placed(side_of_device(kwargs.get("device"))):
                return make(*args, **kwargs)

        return placed_factory

    def pin_memory(tensor, *args, **kwargs):
        """DeepSpeed's accelerator pins a copy of `tensor` (abstract_accelerator.py: tensor.pin_memory(), or a
        fresh pinned buffer of its shape with make_copy=False). torch's CachingHostAllocator gives a pinned
        block of the size rounded up to a power of two (ATen/core/CachingHostAllocator.h, allocate: at
        the default pinned_max_round_threshold), so the copy lies in a buffer of that size. It is detached from
        that buffer: a view's `_base` would keep the block alive after its tensor is pointed elsewhere, which
        CUDA's pinned copy (no view) does not. DeepSpeed does that to every parameter's pinned partition under
        offload_param (stage3.py:_move_to_flat_buffer, `src.data = dest.data` into the flat host buffer): on
        CUDA the partition's block is freed there (and kept in torch's pinned-block cache)."""
        block = 1 << max(tensor.nbytes - 1, 0).bit_length()
        # the host named: under deepspeed.zero.Init (offload_param's pinned partitions) torch.empty is its
        # wrapper, which gives a call that names no device the accelerator's
        with placed("host"):
            buffer = torch.empty(block // tensor.element_size(), dtype=tensor.dtype, device="cpu")
            return buffer[:tensor.numel()].view(tensor.shape).detach().copy_(tensor)

    accelerator = get_accelerator()
    factories = {name: factory(getattr(torch, name)) for name in FACTORIES}
    patches = {(torch.Tensor, "to"): tensor_to, (torch.Tensor, "cpu"): tensor_cpu,
               **{(torch, name): made for name, made in factories.items()},
               **{(partition_parameters, f"_orig_torch_{name}"): made for name, made in factories.items()},
               (accelerator, "current_device_name"): lambda: AcceleratorDevice("cpu"),
               (accelerator, "device_name"): lambda device_index=None: AcceleratorDevice("cpu"),
               (accelerator, "pin_memory"): pin_memory,
               (accelerator, "on_accelerator"): lambda t: not tracker.on_host(t)}
    saved = {(owner, name): owner.__dict__.get(name) for owner, name in patches}
    try:
        for (owner, name), value in patches.items():
            setattr(owner, name, value)
        yield tracker
    finally:
        for (owner, name), value in saved.items():
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
