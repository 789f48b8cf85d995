"""Offload to the CPU where the device is the CPU too: which buffers DeepSpeed or FSDP2 keep in host memory.

On the cpu and estimate backends host and device memory are one pool of CPU tensors; a CUDA run tells them apart
by the device each buffer is made on, so each engine that offloads has a context here that tells the tracker
(vlmprobe.estimate.tracker.PLACEMENT) each buffer's side: `host_placement()` reads the device DeepSpeed names
(the accelerator's device, or the host as "cpu"); `fsdp2_offload_placement()` (FSDP2's CPUOffloadPolicy) tells
FSDP2's moves by where they are made, as on a CPU mesh its host has its device's name. A move across sides
copies, as on CUDA; the tracker places the rest. Host figures are the bytes of live host buffers, pinned ones
rounded up to a power of two as torch's CachingHostAllocator rounds them. DeepSpeedCPUAdam's in-place update is
not modelled (torch's AdamW instead). docs/distributed.md lists the calls each context reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from unittest import mock

import torch

from vlmprobe.estimate.tracker import PLACEMENT, LiveBytesTracker

__all__ = ["fsdp2_offload_placement", "host_placement", "made_on", "placed"]

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


# the side DeepSpeed's factories make buffers on whatever device they name, inside `made_on` (None: by the name)
_MADE_ON: contextvars.ContextVar[str | None] = contextvars.ContextVar("made on", default=None)


@contextlib.contextmanager
def made_on(side: str):
    """DeepSpeed's factories make what they make on `side` while on: where DeepSpeed names the device by a host
    tensor's `.device` (stage 1-2's flatten through the host pads the host copies with `torch.zeros(...,
    device=tensor.device)`: the host on CUDA, and on the CPU no different from the device's name)."""
    token = _MADE_ON.set(side)
    try:
        yield
    finally:
        _MADE_ON.reset(token)


def side_of_device(device) -> str:
    """'device' or 'host': where a buffer made with this `device` argument lives on CUDA."""
    if _MADE_ON.get() is not None:
        return _MADE_ON.get()
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


_TO, _CPU = torch.Tensor.to, torch.Tensor.cpu


def _side(tracker: LiveBytesTracker, tensor: torch.Tensor) -> str:
    return "host" if tracker.on_host(tensor) else "device"


def _copy_across(tracker: LiveBytesTracker, source: torch.Tensor, out: torch.Tensor, target: str) -> torch.Tensor:
    """`out` (what a move of `source` to `target` returned) as CUDA has it: a copy where the sides differ."""
    if _side(tracker, source) != target and out.untyped_storage() is source.untyped_storage():
        with placed(target):  # the CPU aliased what CUDA copies
            return out.clone()
    return out


def _to_side(tracker: LiveBytesTracker, tensor: torch.Tensor, target: str, args, kwargs) -> torch.Tensor:
    with placed(target):
        return _copy_across(tracker, tensor, _TO(tensor, *args, **kwargs), target)


def _tensor_cpu(self, *args, **kwargs):
    """`.cpu()`: a copy to the host, wherever it is called."""
    with placed("host"):
        return _copy_across(current_tracker(), self, _CPU(self, *args, **kwargs), "host")


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `tensor`, as `tensor.pin_memory()` makes it on CUDA. torch's CachingHostAllocator
    gives a pinned block of the size rounded up to a power of two (ATen/core/CachingHostAllocator.h, allocate:
    at the default pinned_max_round_threshold), so the copy lies in a buffer of that size. It is detached from
    that buffer: a view's `_base` would keep the block alive after its tensor is pointed elsewhere, which CUDA's
    pinned copy (no view) does not. DeepSpeed does that to every parameter's pinned partition under
    offload_param (stage3.py:_move_to_flat_buffer, `src.data = dest.data` into the flat host buffer): on CUDA
    the partition's block is freed there (and kept in torch's pinned-block cache)."""
    block = 1 << max(tensor.nbytes - 1, 0).bit_length()
    # the host named: under deepspeed.zero.Init (offload_param's pinned partitions) torch.empty is its wrapper,
    # which gives a call that names no device the accelerator's
    with placed("host"):
        buffer = torch.empty(block // tensor.element_size(), dtype=tensor.dtype, device="cpu")
        return buffer[:tensor.numel()].view(tensor.shape).detach().copy_(tensor)


@contextlib.contextmanager
def _patched(patches: dict):
    """Each (owner, name) set to its value while on (mock puts back what was there, or nothing)."""
    with contextlib.ExitStack() as stack:
        for (owner, name), value in patches.items():
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


@contextlib.contextmanager
def host_placement():
    """While on: the tracker counts the host buffers DeepSpeed makes apart, placed as the module doc says."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters

    tracker = current_tracker()
    tracker.track_host()

    def tensor_to(self, *args, **kwargs):
        device = _to_target(args, kwargs)
        if device is None:
            return _TO(self, *args, **kwargs)
        target = _side(tracker, device) if isinstance(device, torch.Tensor) else side_of_device(device)
        return _to_side(tracker, self, target, args, kwargs)

    def factory(make):
        def placed_factory(*args, **kwargs):
            with placed(side_of_device(kwargs.get("device"))):
                return make(*args, **kwargs)

        return placed_factory

    accelerator = get_accelerator()
    factories = {name: factory(getattr(torch, name)) for name in FACTORIES}
    # DeepSpeed's accelerator pins a copy of its argument (abstract_accelerator.py: tensor.pin_memory(), or a
    # fresh pinned buffer of its shape with make_copy=False)
    patches = {(torch.Tensor, "to"): tensor_to, (torch.Tensor, "cpu"): _tensor_cpu,
               **{(torch, name): made for name, made in factories.items()},
               **{(partition_parameters, f"_orig_torch_{name}"): made for name, made in factories.items()},
               (accelerator, "current_device_name"): lambda: AcceleratorDevice("cpu"),
               (accelerator, "device_name"): lambda device_index=None: AcceleratorDevice("cpu"),
               (accelerator, "pin_memory"): lambda tensor, *args, **kwargs: pinned_copy(tensor),
               (accelerator, "on_accelerator"): lambda t: not tracker.on_host(t)}
    with _patched(patches):
        yield tracker


# the side FSDP2's `.to(<a device>)` moves to inside its offload code (see the module doc); None elsewhere
_FSDP2_MOVE: contextvars.ContextVar[str | None] = contextvars.ContextVar("fsdp2 offload move", default=None)


def _moving(target: str, fn):
    """`fn` with FSDP2's `.to(<a device>)` calls inside it copying to `target`."""
    def moved(*args, **kwargs):
        token = _FSDP2_MOVE.set(target)
        try:
            return fn(*args, **kwargs)
        finally:
            _FSDP2_MOVE.reset(token)

    return moved


def _non_blocking(args, kwargs) -> bool:
    # Tensor.to's non_blocking: a keyword, or the first bool given by position (a device or dtype never is one)
    return bool(kwargs.get("non_blocking", next((a for a in args if isinstance(a, bool)), False)))


@contextlib.contextmanager
def fsdp2_offload_placement():
    """While on: the tracker counts the host buffers of FSDP2's CPUOffloadPolicy apart (see the module doc)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    tracker = current_tracker()
    tracker.track_host()
    pinned = weakref.WeakSet()  # storages of pinned copies

    def tensor_to(self, *args, **kwargs):
        target = _FSDP2_MOVE.get()
        if target is None or _to_target(args, kwargs) is None:
            return _TO(self, *args, **kwargs)
        if target == "host" and _side(tracker, self) == "device" and _non_blocking(args, kwargs):
            return pin_memory(self)  # a device-to-host copy that does not block lands in pinned memory
        return _to_side(tracker, self, target, args, kwargs)

    def pin_memory(self, *args, **kwargs):
        out = pinned_copy(self)
        pinned.add(out.untyped_storage())
        return out

    gather = _fsdp_param.FSDPParam.all_gather_inputs
    patches = {(torch.Tensor, "to"): tensor_to, (torch.Tensor, "cpu"): _tensor_cpu,
               (torch.Tensor, "pin_memory"): pin_memory,
               (torch.Tensor, "is_pinned"): lambda self, *args, **kwargs: self.untyped_storage() in pinned,
               (_fsdp_param.FSDPParam, "all_gather_inputs"): property(_moving("device", gather.fget)),
               (_fsdp_param_group, "foreach_reduce"): _moving("host", _fsdp_param_group.foreach_reduce)}
    with _patched(patches):
        yield tracker
