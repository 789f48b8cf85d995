"""DeepSpeed ZeRO-1/2/3: the real engine (deepspeed.initialize), driven by the measured step like any engine.

The process group exists before the engine (the fake group for the estimate, the launcher's real group for
cpu and cuda) and deepspeed.comm adopts it (dist_init_required=False). The config is the point's `dist` options
in DeepSpeed's keys, or the user's own JSON (dist.deepspeed_config) with the "auto" values HF Trainer fills in,
filled in from the point as it would (transformers integrations/deepspeed.py).
Six things a real job does not meet are answered where they are met, and nothing else of DeepSpeed is touched:
on fake tensors `module.to(device)` and `.item()`, on a fake group stage 3's module-list check and the
shared-memory all-reduce op, on a CPU device fp16 support and free memory (each in docs/distributed.md).
Offload to the CPU runs on every backend; where the device is the CPU too, the buffers DeepSpeed makes on the
host are counted apart (vlmprobe.distributed.host_memory). DeepSpeed's optimizer is then AdamW with `torch_adam`.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as torch_dist

from vlmprobe.distributed.base import Engine, storage_bytes
from vlmprobe.distributed.host_memory import host_placement, made_on, placed
from vlmprobe.distributed.options import read_deepspeed_config
from vlmprobe.distributed.process_group import fake_group_active
from vlmprobe.errors import ConfigError
from vlmprobe.gpu import device_profile
from vlmprobe.optimizers import make_optimizer

__all__ = ["answer_locally_on_fake_groups", "check_point", "cuda_free_bytes", "deepspeed_config", "DeepSpeedEngine",
           "fill_auto"]

PRECISION = {"bfloat16": "bf16", "float16": "fp16"}
OPTIMIZER_AUTO = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # TrainingArguments defaults
ZERO_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients", "overlap_comm",
             "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold")


def fill_auto(node, values: dict, path: str = ""):
    """`node` with every "auto" replaced by values[dotted path] (HF Trainer's rule for that key)."""
    if isinstance(node, dict):
        return {k: fill_auto(v, values, f"{path}{k}.") for k, v in node.items()}
    if node == "auto":
        key = path.rstrip(".")
        if key not in values:
            raise ValueError(f"{key}: \"auto\" has no value vlmprobe can fill in; give a number")
        return values[key]
    return node


def deepspeed_config(point: dict, hidden_size: int) -> dict:
    """The DeepSpeed config of a point: the user's JSON with "auto" filled in, or the dist options."""
    dist, train, data = point["dist"], point["train"], point["data"]
    micro, accum = data["batch_size"], train["grad_accum_steps"]
    precision = PRECISION.get(train["param_dtype"])
    auto = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * dist["world_size"],
        "bf16.enabled": precision == "bf16", "fp16.enabled": precision == "fp16",
        "gradient_clipping": 1.0,  # HF Trainer's max_grad_norm default
        # transformers' trainer_config_finalize: bucket sizes from the model's hidden size
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
    }
    if dist["deepspeed_config"] is not None:
        config = read_deepspeed_config(dist["deepspeed_config"])
        optimizer = config.get("optimizer")
        config = fill_auto({k: v for k, v in config.items() if k not in ("scheduler", "optimizer")}, auto)
        if optimizer:  # HF Trainer's defaults for its "auto"s; these values decide no memory
            params = optimizer.get("params", {})
            config["optimizer"] = {**optimizer, "params": {
                k: (OPTIMIZER_AUTO.get(k, v) if v == "auto" else v) for k, v in params.items()}}
    else:
        zero = {"stage": dist["stage"], **{k: dist[k] for k in ZERO_KEYS if k in dist}}
        for key in ("offload_optimizer", "offload_param"):
            if dist[key] != "none":
                zero[key] = {"device": dist[key]}
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                  "zero_optimization": zero}
        if precision:
            config[precision] = {"enabled": True}
    if offloads(config) and "optimizer" not in config:
        # ZeRO-Offload refuses a client optimizer (engine.py:_configure_optimizer); torch's AdamW on the host
        # partitions allocates on the host what DeepSpeedCPUAdam would, and needs no compiled op
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}
    config.setdefault("steps_per_print", 2**31 - 1)  # DeepSpeed's progress lines are not ours to print
    return config


def zero_stage(config: dict) -> int:
    """The ZeRO stage DeepSpeed runs (the user's JSON may name another than dist=)."""
    return config["zero_optimization"].get("stage", 0)


def builds_under_zero_init(config: dict, dist: dict) -> bool:
    """Whether the model is built under deepspeed.zero.Init: at stage 3 (the user's JSON may name it under
    any dist=zero*) unless dist.zero_init is false, as HF does whenever its DeepSpeed config is stage 3."""
    return zero_stage(config) == 3 and dist.get("zero_init", True)


def check_point(point: dict, hidden_size: int, trainable: dict[str, list[str]]) -> None:
    """One line, before anything is built, for a DeepSpeed config vlmprobe cannot complete (a user's "auto"
    with no rule to fill it) and for LoRA adapters that a real ZeRO-3 run cannot train beside other weights.
    `trainable`: dtype name -> names of trainable parameters, from the model built on the meta device with the
    knobs applied. peft keeps the adapters of a bf16/fp16 model in float32 (autocast_adapter_dtype); stage 3
    flattens the trainable parameters' pieces into one device buffer of one dtype unless it offloads them
    (stage3.py: _create_fp16_partitions_with_defragmentation; zero/utils.py:defragment asserts one dtype), and
    initialize casts the parameters to the config's bf16/fp16 only for a model built whole (engine.py:
    _cast_module_mixed_precision), not for one built under zero.Init, as HF builds at stage 3. So adapters
    beside weights that train in bf16 stop a real run in initialize, on a bare AssertionError."""
    train, dist = point["train"], point["dist"]
    try:
        config = deepspeed_config(point, hidden_size)
    except ValueError as exc:  # fill_auto's
        raise ConfigError(f"dist.deepspeed_config={dist['deepspeed_config']} is not allowed: {exc}") from None
    if (not train["lora_r"] or len(trainable) < 2 or not builds_under_zero_init(config, dist)
            or offloads(config, ("offload_param",))):
        return
    others = sorted({".".join(name.split(".")[:-1][:2]) + ".*"  # the owning modules, two levels deep
                     for dtype, names in trainable.items() if dtype != "float32" for name in names})
    raise ConfigError(
        f"train.lora_r={train['lora_r']} is not allowed with dist={dist['name']} built under deepspeed.zero.Init "
        f"while other weights train in {train['param_dtype']} ({', '.join(others[:3])}"
        f"{', ...' if len(others) > 3 else ''}): peft keeps the adapters in float32 and ZeRO-3 trains one dtype "
        f"(DeepSpeed's initialize stops on an AssertionError in zero/utils.py:defragment); freeze those weights "
        f"(train.freeze_vision=true freezes the vision tower), offload the parameters (dist.offload_param=cpu) "
        f"or set dist.zero_init=false (DeepSpeed then casts every parameter, the adapters too, to "
        f"{train['param_dtype']})")


def cuda_free_bytes(point: dict, allocator, device_index=None) -> int:
    """What NVML reports free on the point's card (DeepSpeed's CUDA accelerator: available_memory), as the
    allocator model stands: the model's capacity (the card's bytes it was given: measure.device_memory, else the
    device profile's total) less the profile's CUDA context where known, less the bytes the model holds. A point
    with no card has room for anything: sys.maxsize."""
    import sys

    if allocator.capacity is None:
        return sys.maxsize
    profile = device_profile.from_config(point.get("device"))
    context = profile.cuda_context_bytes if profile is not None and profile.cuda_context_bytes else 0
    return max(allocator.capacity - context - allocator.reserved, 0)


def offloads(config: dict, what=("offload_optimizer", "offload_param")) -> bool:
    """Whether a DeepSpeed config offloads any of `what` (the optimizer, the parameters) to the CPU or NVMe."""
    zero = config.get("zero_optimization") or {}
    return any((zero.get(k) or {}).get("device", "none") not in ("none", None) for k in what)


@functools.cache
def answer_locally_on_fake_groups() -> None:
    """Changes 3 and 5 of the module doc, installed once per process, before DeepSpeed first meets the group;
    they act only while the group is fake."""
    import importlib

    import deepspeed.runtime.zero.utils as zero_utils

    comm_torch = importlib.import_module("deepspeed.comm.torch")  # the attribute deepspeed.comm.torch is torch

    broadcast, compare = zero_utils.get_lst_from_rank0, zero_utils.assert_lst_len_same_as_other_ranks
    zero_utils.get_lst_from_rank0 = lambda lst: list(lst) if fake_group_active() else broadcast(lst)
    zero_utils.assert_lst_len_same_as_other_ranks = lambda lst: None if fake_group_active() else compare(lst)
    build_shm_op = comm_torch.build_shm_op
    comm_torch.build_shm_op = lambda: None if fake_group_active() else build_shm_op()


class DeepSpeedEngine(Engine):
    """zero1 / zero2 / zero3: deepspeed.initialize partitions the model. At stage 3 with dist.zero_init (HF's
    way) the model is built partitioned, under deepspeed.zero.Init; otherwise it is built on the device as a
    whole."""

    repeats_steps = False

    def build(self, spec, dtype):
        """Under zero.Init as transformers builds a model when a ZeRO-3 config is active
        (modeling_utils.py:get_init_context, is_deepspeed_zero3_enabled(): no_init_weights,
        prevent_arange_dtype_change, zero.Init with the run's config): each module's parameters are cut into
        this rank's pieces as its __init__ ends, so the rank never holds the whole model (the pieces go to
        the host with offload_param). The weights are then filled module by module as from_pretrained loads
        them under ZeRO-3 (integrations/deepspeed.py:_load_state_dict_into_zero3_model): a module's own
        parameters gathered whole, written on rank 0, cut again; the largest module gathered is the build's
        transient. The build is on the device: what it makes with no device named is device memory (the
        host placement's default is the host, DeepSpeed's own buffers)."""
        self.config = deepspeed_config(self.point, spec.text["hidden_size"])
        answer_locally_on_fake_groups()
        with placed("device"):
            if not self.zero_init:
                return super().build(spec, dtype)
            import deepspeed
            import transformers.modeling_utils  # noqa: F401  imported under zero.Init's torch.Tensor.__new__, it fails
            from transformers.integrations.deepspeed import prevent_arange_dtype_change

            # deepspeed.comm adopts the job's group first, as HF's TrainingArguments do (deepspeed.init_distributed in
            # _setup_devices) before from_pretrained: zero.Init reads its config's world size from it, and with
            # none (1) a user's JSON whose batch sizes are "auto" (filled in for the whole job) fails its check
            deepspeed.init_distributed(dist_init_required=False)
            with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=self.config):
                model = spec.build(self.device, dtype, init=False)
            rank = torch_dist.get_rank()
            with torch.no_grad():
                for module in model.modules():
                    params = list(module.parameters(recurse=False))
                    if params:
                        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                            if rank == 0:  # weights do not change memory; filled so a real run computes numbers
                                for p in params:
                                    p.normal_(0.0, 0.02)
            return model

    @property
    def zero_init(self) -> bool:
        return builds_under_zero_init(self.config, self.dist)

    def prepare(self, spec, model, optimizer_partial) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        params = [p for p in model.parameters() if p.requires_grad]
        client = None if "optimizer" in self.config else make_optimizer(optimizer_partial, params)[0]
        self.fake = any(isinstance(p, FakeTensor) for p in params)
        self.model, self.optimizer, _, _ = self.initialize(
            model, self.config, optimizer=client, model_parameters=params if client is None else None)
        self.accum, self.micro = self.config.get("gradient_accumulation_steps", 1), 0

    def initialize(self, model, config: dict, **kwargs):
        import deepspeed

        if self.fake:
            model.to = lambda *args, **kwargs: model  # change 1 of the module doc
        accelerator = deepspeed.get_accelerator()
        answered = ("is_fp16_supported", "empty_cache", "available_memory")
        if self.device.type == "cpu":
            accelerator.is_fp16_supported = lambda: True  # change 4 of the module doc
            if self.host_tracker is not None:  # change 6 (the host placement is on wherever stages 1-2 run)
                allocator = self.host_tracker.allocator
                accelerator.empty_cache = allocator.empty_cache
                accelerator.available_memory = functools.partial(cuda_free_bytes, self.point, allocator)
        try:
            with self._flattened_on_the_host_side():
                return deepspeed.initialize(model=model, config=config, dist_init_required=False, **kwargs)
        finally:
            if self.fake:
                del model.to
            for name in answered:
                accelerator.__dict__.pop(name, None)

    @contextlib.contextmanager
    def _flattened_on_the_host_side(self):
        """Change 6's flatten through the host made on the host (see the module doc); nothing where the host is not
        told apart."""
        if self.host_tracker is None:
            yield
            return
        from unittest import mock

        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        original = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned

        def flatten_dense_tensors_aligned(optimizer, tensor_list, alignment, use_cpu_data=False, param_padding=None):
            with made_on("host") if use_cpu_data else contextlib.nullcontext():
                return original(optimizer, tensor_list, alignment, use_cpu_data=use_cpu_data,
                                param_padding=param_padding)

        with mock.patch.object(DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", flatten_dense_tensors_aligned):
            yield

    @property
    def stage(self) -> int:
        return zero_stage(self.config)

    @contextlib.contextmanager
    def generating(self):
        """ZeRO-3 with step.ds3_gather_for_generation (TRL's default): every parameter gathered whole for the
        whole of generate, the engine's hooks off meanwhile (DeepSpeed's own unwrap_model_for_generation,
        which TRL's follows); without it, generate runs through the hooks, gathering layer by layer."""
        if self.stage == 3 and self.point["step"].get("ds3_gather_for_generation", True):
            from deepspeed.runtime.zero import unwrap_model_for_generation

            with unwrap_model_for_generation(self.model):
                yield self.module
        else:
            yield self.module

    def prepare_reference(self, spec, model):
        """TRL's prepare_deepspeed: at ZeRO-3 the reference is a DeepSpeed inference engine of its own,
        partitioned like the policy (its config without optimizer and optimizer offload);
        at stages 1-2 DeepSpeed is disabled for it (stage 0): a whole copy per rank, as built."""
        if self.stage != 3:
            return model
        config = copy.deepcopy(self.config)
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        config["zero_optimization"].pop("offload_optimizer", None)
        # TRL also sets the bucket sizes from the hidden size, but under dotted top-level keys
        # ("zero_optimization.reduce_bucket_size"), which DeepSpeed's config never reads: the policy's stay
        engine, *_ = self.initialize(model, config)
        return engine.eval()

    def host_placement(self):
        config = deepspeed_config(self.point, hidden_size=1)  # the hidden size sets bucket sizes only
        # stages 1-2 may move a parameter group to the host to flatten it (change 6 of the module doc)
        if not offloads(config) and zero_stage(config) not in (1, 2):
            return None
        return host_placement()

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def backward(self, loss) -> None:
        self.model.backward(loss)
        self.micro += 1
        if self.micro < self.accum:
            self.model.step()  # DeepSpeed counts micro steps in step(): off the boundary it updates nothing

    def step(self) -> None:
        skipped = self.model.skipped_steps
        self.model.step()
        self.micro = 0
        if self.fake and self.model.skipped_steps != skipped:
            raise RuntimeError("DeepSpeed skipped the optimizer step on fake tensors: an overflow flag was read as set")

    def params_bytes(self) -> int:
        # stage 3: this rank's partition (ds_tensor) and the persistent params; stages 1-2: the flat copy
        return storage_bytes(self.on_device(getattr(p, "ds_tensor", p) for p in self.model.module.parameters()))

    def grads_bytes(self) -> int:
        optimizer = self.optimizer
        buffers = [getattr(optimizer, name, None) for name in ("grad_partitions_flat_buffer", "grads_in_partition")]
        averaged = getattr(optimizer, "averaged_gradients", None) or {}
        tensors = [b for b in buffers if isinstance(b, torch.Tensor)]
        tensors += [g for grads in averaged.values() for g in (grads or []) if isinstance(g, torch.Tensor)]
        return storage_bytes(self.on_device(tensors))

    def state_tensors(self) -> list[torch.Tensor]:
        """The inner (torch) optimizer's state over this rank's fp32 partition that is on the device (none
        when the optimizer is offloaded)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return self.on_device(t for state in inner.state.values() for t in state.values()
                              if isinstance(t, torch.Tensor) and t.dim() > 0)
