"""The engine base: who owns the model and optimizer of one rank, the single-GPU path (dist=none).

The measured step (vlmprobe.steps) drives an engine through the few methods of steps.common.Engine and never
asks which one it is; the worker builds the model through it (on the meta device where the engine shards it),
prepares it (wrap or shard, make the optimizer) and reads the row's byte figures from it. The subclasses are
torch's wrappers (torch_engines.py) and DeepSpeed's engine (deepspeed_engine.py); engines.py picks one.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from vlmprobe.models.base import unwrapped
from vlmprobe.optimizers import make_optimizer, state_tensors

__all__ = ["Engine", "storage_bytes"]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views into one flat buffer count it once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages.setdefault(id(storage), storage)  # the dict keeps each storage alive, so ids stay distinct
    return sum(s.nbytes() for s in storages.values())


class Engine:
    """The single-GPU engine (dist=none): the model as built, loss.backward(), optimizer.step()."""

    build_device_is_meta = False  # build on the meta device and let prepare() materialise the (sharded) model
    # whether every step after the first asks the allocator for what the first did (forward and backward): true
    # of a plain model; not of DDP (it rebuilds its buckets in the second step) nor of the sharding engines
    # (resized and prefetched buffers), which set it False. The estimate replays such steps (step_replay).
    repeats_steps = True

    def __init__(self, point: dict, device: torch.device):
        self.point, self.dist, self.device = point, point["dist"], device
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def build_device(self) -> torch.device:
        return torch.device("meta") if self.build_device_is_meta else self.device

    def build(self, spec, dtype: torch.dtype) -> nn.Module:
        """The model with random weights, built where this engine builds it (on the meta device, for prepare()
        to materialise, where build_device_is_meta)."""
        return spec.build(self.build_device, dtype, init=not self.build_device_is_meta)

    @property
    def module(self) -> nn.Module:
        """The model as built, inside whatever wraps it (generate and the LoRA adapters live there)."""
        return unwrapped(self.model)

    @contextlib.contextmanager
    def generating(self):
        """The model generate runs on, its parameters as TRL's unwrap_model_for_generation leaves them."""
        yield self.module

    def prepare_reference(self, spec, model: nn.Module) -> nn.Module:
        """GRPO's frozen reference model beside this engine's policy: here (and under DDP, zero1, zero2)
        accelerate only places it on the device, a whole copy per rank."""
        return model

    def prepare(self, spec, model: nn.Module, optimizer_partial) -> None:
        self.model = self.wrap(spec, model)
        self.optimizer, _ = make_optimizer(optimizer_partial, [p for p in self.model.parameters() if p.requires_grad])

    def wrap(self, spec, model: nn.Module) -> nn.Module:
        return model

    host_tracker = None  # the tracker that tells host buffers apart, while host_memory() is on

    @contextlib.contextmanager
    def host_memory(self):
        """Entered before prepare() until the point's figures are read: where this engine offloads to the CPU
        and the device is the CPU too, what tells the host buffers apart (vlmprobe.distributed.host_memory).
        On CUDA a tensor's device tells them apart already."""
        placement = self.host_placement() if self.device.type == "cpu" else None
        if placement is None:
            yield
            return
        with placement as self.host_tracker:
            yield

    def host_placement(self) -> contextlib.AbstractContextManager | None:
        """This engine's context of vlmprobe.distributed.host_memory, where the point offloads; else None."""
        return None

    def on_device(self, tensors) -> list[torch.Tensor]:
        """The tensors that are device buffers (offloaded ones live on the host: not device memory)."""
        if self.host_tracker is None:
            return [t for t in tensors if t.device.type == self.device.type]
        return [t for t in tensors if not self.host_tracker.on_host(t)]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of `tensor` this rank holds."""
        return tensor

    def params_bytes(self) -> int:
        return storage_bytes(self.on_device(self.local(p) for p in self.model.parameters()))

    def grads_bytes(self) -> int:
        # grads may be views of one buffer (DDP's gradient_as_bucket_view, FSDP2's reduce-scatter output, which
        # it keeps per block): each buffer counted once
        return storage_bytes(self.on_device(self.local(p.grad) for p in self.model.parameters() if p.grad is not None))

    def state_tensors(self) -> list[torch.Tensor]:
        """Optimizer state tensors this rank holds on the device (not AdamW's scalar step counters)."""
        return self.on_device(self.local(t) for t in state_tensors(self.optimizer))
