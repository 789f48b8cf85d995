"""Engines: who owns the model + optimizer wiring of one rank. The measured step (vlmprobe.steps)
drives an engine and never asks which one it is:

    engine = make(point["dist"], device)
    model = engine.build(spec, dtype)   # knobs applied after
    engine.prepare(spec, model, optimizer_partial)   # wrap / shard the model, make the optimizer
    engine.zero_grad(); loss = spec.loss(engine.model, batch); engine.backward(loss); engine.step()
    engine.params_bytes(), engine.grads_bytes(), engine.state_tensors()   # for the row

The GRPO step (vlmprobe.steps.grpo) asks two more things, each as TRL's GRPOTrainer does it beside that
engine: `with engine.generating() as model: model.generate(...)` (trl models/utils.py
unwrap_model_for_generation) and `engine.prepare_reference(spec, reference)` for its frozen reference model
(GRPOTrainer.__init__: prepare_deepspeed, prepare_fsdp, or accelerator.prepare_model in evaluation mode).

`none` is the single-GPU path exactly as it was; `ddp` and `fsdp2` are torch's own wrappers. A DeepSpeed
engine plugs in as one more subclass: `prepare` calls deepspeed.initialize(model=..., optimizer=...) and
keeps the returned engine; `backward` / `step` call engine.backward(loss) / engine.step(); `zero_grad`
is DeepSpeed's; the byte figures read its partitioned flat buffers. `NAMES` maps `dist.name` to the class.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from vlmprobe.distributed.process_group import fake_group_active
from vlmprobe.steps.common import make_optimizer, state_tensors
from vlmprobe.steps.logprob import unwrapped


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


class DDPEngine(Engine):
    """torch DistributedDataParallel: the whole model per rank, plus the gradient buckets DDP allocates
    when it wraps the model (one flat buffer per bucket of bucket_cap_mb, copies of the grads), and again
    in the first forward after the first backward, when it rebuilds them in the order the grads came.

    On a fake group (the estimate) three places of DDP's C++ need data a fake group or fake tensors do not
    have: the check that every rank holds the same parameter shapes (answered locally: every simulated rank
    builds the same model); the rebuild's broadcast of the new bucket assignment, which runs with its integer
    index tensors real (vlmprobe.estimate.fake_patches.host_index_tensors_real); and each bucket's all-reduce,
    whose result the reducer takes from the collective's future, which a fake group completes empty
    (all_reduce_on_fake_group answers it)."""

    repeats_steps = False

    def wrap(self, spec, model):
        from torch.nn.parallel import DistributedDataParallel

        options = {"bucket_cap_mb": self.dist["bucket_cap_mb"],
                   "gradient_as_bucket_view": self.dist["gradient_as_bucket_view"]}
        if not fake_group_active():
            return DistributedDataParallel(model, **options)
        from unittest import mock

        with mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes"):
            ddp = DistributedDataParallel(model, **options)
        ddp.register_comm_hook(None, all_reduce_on_fake_group)
        ddp.reducer = RebuildWithRealIndices(ddp.reducer)
        return ddp


def all_reduce_on_fake_group(state, bucket):  # unannotated: DDP refuses any return annotation but its own
    """A bucket's all-reduce as DDP makes it without a hook, on a fake group: divided by the world size and
    all-reduced in place, the future holding the bucket itself. Its allocations are the default path's: the
    hook takes the grads copied into the bucket (copy_, where the default divides while copying, mul_out),
    and divides in place."""
    import torch.distributed as dist

    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    dist.all_reduce(tensor)
    future = torch.futures.Future()
    future.set_result(tensor)
    return future


class RebuildWithRealIndices:
    """DDP's C++ reducer as DDP's Python sees it, its bucket rebuild run with real host index tensors."""

    def __init__(self, reducer):
        self._reducer = reducer

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        from vlmprobe.estimate.fake_patches import host_index_tensors_real

        with host_index_tensors_real():
            return self._reducer._rebuild_buckets()


def tower_blocks(spec, model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of each tower, in tower order: the first ModuleList named `blocks`, `layers` or
    `layer` inside each tower module (`.blocks` for nanoVLM and Qwen's vision towers, `.layers` for
    transformers' language models, `.encoder.layers` for CLIP and SigLIP towers, `.encoder.layer` for
    InternViT)."""
    found = []
    for modules in spec.towers(model).values():
        for module in modules:
            for name, child in module.named_modules():
                if name.rsplit(".", 1)[-1] in ("blocks", "layers", "layer") and isinstance(child, nn.ModuleList):
                    found.extend(child)
                    break
    return found


class FSDP2Engine(Engine):
    """torch FSDP2: fully_shard on every tower block, then on the root, over a 1-D mesh of all ranks. The
    model is built on the meta device, sharded there and materialised shard by shard (to_empty), as FSDP2
    training code does, so no rank ever holds the whole model."""

    repeats_steps = False

    build_device_is_meta = True

    def wrap(self, spec, model):
        from torch.distributed.fsdp import register_fsdp_forward_method

        model = self.shard(model, tower_blocks(spec, model))
        # the HF Trainer's own fix for generate under FSDP2 (trainer.py, "got mixed torch.Tensor and DTensor"):
        # generate runs the root's hooks as forward does, so the root's parameters are gathered for it
        if hasattr(model, "generate"):
            register_fsdp_forward_method(model, "generate")
        return model

    def prepare_reference(self, spec, model):
        """TRL's prepare_fsdp (FSDP2): fully_shard on the reference's root alone, so its forward gathers the
        whole model at once; the plugin's options (mixed precision, offload, reshard_after_forward) as the
        policy's. Built on the meta device like the policy and materialised shard by shard."""
        return self.shard(model, []).eval()

    def shard(self, model, blocks: list[nn.Module]):
        """fully_shard on each of `blocks`, then on the root, and the sharded model materialised."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from vlmprobe.distributed.process_group import mesh

        dist = self.dist
        dtypes = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        options = {"mesh": mesh(), "mp_policy": MixedPrecisionPolicy(param_dtype=dtypes[dist["mp_param_dtype"]],
                                                                    reduce_dtype=dtypes[dist["mp_reduce_dtype"]])}
        if dist["offload_param"] == "cpu":
            options["offload_policy"] = CPUOffloadPolicy()
        if dist["reshard_after_forward"] is not None:
            options["reshard_after_forward"] = dist["reshard_after_forward"]
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(model, **{k: v for k, v in options.items() if k != "reshard_after_forward" or not blocks})
        model.to_empty(device=self.device)
        with torch.no_grad():  # weights do not change memory; filled so that a real run computes numbers
            for p in model.parameters():
                self.local(p).normal_(0.0, 0.02)
            for b in model.buffers():  # to_empty left them uninitialised (e.g. rotary frequencies)
                b.zero_()
        return model

    def host_placement(self):
        if self.dist["offload_param"] != "cpu":
            return None
        from vlmprobe.distributed.host_memory import fsdp2_offload_placement

        return fsdp2_offload_placement()

    def local(self, tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor


NAMES = {"none": Engine, "ddp": DDPEngine, "fsdp2": FSDP2Engine}


def make(point: dict, device: torch.device) -> Engine:
    """The engine of a point's `dist.name` (DeepSpeed's imported only for its points: an optional extra)."""
    name = point["dist"]["name"]
    if name.startswith("zero"):
        from vlmprobe.distributed.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(point, device)
    return NAMES[name](point, device)

