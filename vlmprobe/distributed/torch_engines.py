"""torch's own engines: DistributedDataParallel (dist=ddp) and FSDP2's fully_shard (dist=fsdp2)."""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.distributed.base import Engine
from vlmprobe.distributed.host_memory import fsdp2_offload_placement
from vlmprobe.distributed.process_group import fake_group_active, mesh
from vlmprobe.estimate.fake_patches import host_index_tensors_real

__all__ = ["DDPEngine", "FSDP2Engine", "tower_blocks"]


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
        return fsdp2_offload_placement()

    def local(self, tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor
