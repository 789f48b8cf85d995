"""Training knobs that change a built model: activation checkpointing, frozen towers, LoRA adapters.

Applied to the model the worker measures and to the meta-device model the planner counts parameters on,
so `trainable_params` in a row is what the optimizer really got.

Unsloth's checkpointing (unsloth_zoo 2026.10.9). `train.grad_ckpt.offload` is use_gradient_checkpointing="unsloth"
on one GPU: UnslothCheckpointFunction (gradient_checkpointing.py), a reentrant checkpoint that copies a layer's first
input (if it needs a gradient and stores in over 2 MiB; float32 stored as bfloat16) to a pinned host slot in forward
and back into a device staging buffer for the recomputation; after the first pass the last layer keeps its input.
Its buffers are modelled in its order, the host ones counted apart (LiveBytesTracker.track_host); its state, per
process there, is per model and session here (a CUDA point is a process). `train.grad_ckpt.vision=unsloth`
checkpoints what Unsloth makes checkpointable and transformers does not: Mllama's vision encoder layers
(temporary_patches/misc.py, patch_MllamaVisionEncoderLayer; a keyword input that needs a gradient goes by position,
patch_GradientCheckpointingLayer_keyword_inputs). Not modelled: pageable fallback, the copy stream, prefetching,
the DDP path (refused) and plain checkpointing under max_seq_length 512.
"""

from __future__ import annotations

import contextlib
import functools
import heapq

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import (_get_autocast_kwargs, _get_device_module, _infer_device_type, checkpoint,
                                    get_device_states, set_device_states)

from vlmprobe.errors import ConfigError, require_counts, require_flags
from vlmprobe.estimate.fake_patches import fake_modules_move_by_data
from vlmprobe.estimate.tracker import PLACEMENT, LiveBytesTracker
from vlmprobe.models.base import is_transformers_model

__all__ = ["adapters_disabled", "add_lora", "apply_knobs", "checkpoint_layers", "OffloadedCheckpoint",
           "UnslothOffload", "UNSLOTH_LAYERS", "UNSLOTH_MINIMUM_BYTES", "validate_knobs"]

# unsloth_zoo 2026.10.9, gradient_checkpointing.py
UNSLOTH_MINIMUM_BYTES = 2 * 1024 * 1024  # MINIMUM_SIZE: an input of at most this many stored bytes stays on the device
UNSLOTH_STAGING_NUMEL = 2 * 256 * 2048  # INITIAL_GPU_BUFFER_SIZE: elements of each device staging buffer at first
UNSLOTH_HOST_SLOTS = 200  # INITIAL_CPU_BUFFER_COUNT: host slots made when the checkpoint is patched in
UNSLOTH_HOST_SLOT_NUMEL = 128 * 1024  # INITIAL_CPU_BUFFER_SIZE: elements of each
UNSLOTH_DOUBLE_BUFFER_FREE = 512 * 1024 * 1024  # DOUBLE_BUFFER_HEADROOM: free bytes that keep the second buffer
# the layer classes Unsloth makes checkpointable where transformers does not (temporary_patches/misc.py)
UNSLOTH_LAYERS = ("MllamaVisionEncoderLayer",)


def apply_knobs(spec, model: nn.Module, train: dict) -> None:
    ckpt = train["grad_ckpt"]
    checkpointing = bool(ckpt["lm"] or ckpt["vision"])
    if not (checkpointing or train["freeze_vision"] or train["freeze_lm"] or train["lora_r"]):
        return  # full fine-tune as built
    towers = spec.towers(model)
    reentrant = train["grad_ckpt_reentrant"] and checkpointing
    if ckpt["offload"] and not is_transformers_model(model):
        raise ConfigError(f"train.grad_ckpt.offload=true is not allowed for {spec.name}: Unsloth's offloaded "
                          f"checkpointing is modelled for transformers models, whose layers call the checkpoint "
                          f"function it replaces; use false")
    if reentrant and not is_transformers_model(model):
        raise ConfigError(f"train.grad_ckpt_reentrant=true is not allowed for {spec.name}: reentrant checkpointing "
                          f"is offered for transformers models, whose enable_input_require_grads lets gradients "
                          f"into the checkpointed layers; use false")
    offload = UnslothOffload(getattr(torch, train["param_dtype"])) if ckpt["offload"] else None
    for tower in ("lm", "vision"):
        if ckpt[tower] == "unsloth":
            checkpoint_unsloth_layers(spec, towers[tower], reentrant, offload)
        elif ckpt[tower] and not [checkpoint_layers(m, reentrant) for m in towers[tower] if has_layers(m)]:
            raise ConfigError(f"train.grad_ckpt.{tower}=true is not allowed for {spec.name}: its {tower} tower has "
                              f"no layers that transformers checkpoints")
        if ckpt[tower] and offload is not None:
            for module in towers[tower]:
                for layer in module.modules():  # what transformers' gradient_checkpointing_enable gave its function
                    if hasattr(layer, "_gradient_checkpointing_func"):
                        layer._gradient_checkpointing_func = offload
    if reentrant:
        # A reentrant layer's forward runs under no_grad, so its output needs grad only if an input does: with
        # frozen embeddings nothing behind it would get a gradient. peft's prepare_model_for_kbit_training and the
        # HF Trainer (reentrant, with adapters) call this, which hooks every input embedding of the model (in
        # transformers 5 the vision tower's too), checkpointed tower or not.
        model.enable_input_require_grads()
    for tower in ("vision", "lm"):
        if train[f"freeze_{tower}"]:
            for module in towers[tower]:
                module.requires_grad_(False)
    if train["lora_r"]:
        add_lora({tower: towers[tower] for tower in train["lora_towers"]}, train)


def has_layers(module: nn.Module) -> bool:
    """Whether checkpoint_layers can act on it: a transformers model whose layers transformers checkpoints
    (GradientCheckpointingLayer: transformers 5.23's Mllama vision encoder has none, so its
    gradient_checkpointing_enable keeps every activation), or our own module with `.blocks` (a tower's other
    parts, such as an LM head, have no layers)."""
    if is_transformers_model(module):
        from transformers.modeling_layers import GradientCheckpointingLayer

        return any(isinstance(m, GradientCheckpointingLayer) for m in module.modules())
    return isinstance(getattr(module, "blocks", None), nn.ModuleList)


def checkpoint_layers(module: nn.Module, reentrant: bool = False) -> None:
    """Recompute each layer's activations in backward instead of saving them. Non-reentrant (the default) works
    with frozen inputs and is what current training code uses; reentrant runs the layer's forward under no_grad,
    so what an autograd function keeps outside save_for_backward (bitsandbytes' int8 matmul keeps its input on
    ctx) is not kept either. transformers models do it their way; our own modules (nanoVLM) have their layers in
    `.blocks`."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if is_transformers_model(module):
        kwargs = {"use_reentrant": reentrant}
        # transformers 5.23 renamed it (the old name warns); the GPU image's 5.17 may have only the old one
        if hasattr(module, "activation_checkpointing_enable"):
            module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        for block in module.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=reentrant)


def checkpoint_unsloth_layers(spec, modules: list[nn.Module], reentrant: bool, offload) -> None:
    """Checkpoint a tower as Unsloth does (train.grad_ckpt.vision=unsloth): the layers transformers checkpoints, and
    each layer of a class Unsloth makes a GradientCheckpointingLayer (UNSLOTH_LAYERS) run through the tower's
    checkpoint function, as such a layer's call does in training with gradients on."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for module in modules for m in module.modules() if type(m).__name__ in UNSLOTH_LAYERS
              and not isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ConfigError(f"train.grad_ckpt.vision=unsloth is not allowed for {spec.name}: Unsloth checkpoints no "
                          f"layer of its vision tower that transformers does not (unsloth_zoo 2026.10.9 adds "
                          f"checkpointing to {', '.join(UNSLOTH_LAYERS)} only); use true")
    for module in modules:
        if has_layers(module):
            checkpoint_layers(module, reentrant)
    function = offload or functools.partial(checkpoint, use_reentrant=reentrant)  # transformers' default function
    for layer in layers:
        layer.forward = checkpointed_forward(layer.forward, function)


def checkpointed_forward(forward, function):
    """`forward` (a module's bound forward) run through the checkpoint `function` in training with gradients on,
    as a GradientCheckpointingLayer's call under Unsloth's patch of it: keyword tensors that need a gradient are
    passed by position (a reentrant checkpoint sees only those, and gives no gradient to the rest)."""

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not (forward.__self__.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        return function(*by_position(functools.partial(forward, **kwargs), args))

    return checkpointed


def by_position(function, args: tuple) -> tuple:
    """(callable, *inputs) for a checkpoint `function(*args)` whose `function` is a partial binding keyword tensors
    that need a gradient: those become trailing inputs, put back in their keywords for the call
    (unsloth_zoo 2026.10.9, gradient_checkpointing.py: _KeywordArgumentCall)."""
    bound = getattr(function, "keywords", None) or {}
    keys = [key for key, value in bound.items() if isinstance(value, torch.Tensor) and value.requires_grad]
    if not isinstance(function, functools.partial) or not keys:
        return (function, *args)
    constants = {key: value for key, value in bound.items() if key not in keys}
    call, count = functools.partial(function.func, *function.args, **constants), len(args)

    def keyword_call(*inputs):
        return call(*inputs[:count], **dict(zip(keys, inputs[count:])))

    return (keyword_call, *args, *(bound[key] for key in keys))


def current_tracker() -> LiveBytesTracker | None:
    """The estimate's or cpu backend's tracker the step runs under, None on cuda (one process per point)."""
    found = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveBytesTracker)]
    return found[-1] if found else None


def stored_view(buffer: torch.Tensor, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """The first `nbytes` of `buffer` read as a `dtype` tensor of `shape` (Unsloth's _view_bytes_as)."""
    if buffer.dtype == dtype:
        return buffer[:nbytes // dtype.itemsize].view(shape)
    return buffer.view(torch.uint8)[:nbytes].view(dtype).view(shape)


class UnslothOffload:
    """The checkpoint function of train.grad_ckpt.offload (module doc), with the state unsloth_zoo keeps in module
    globals: its buffers and which layer comes last. Called as transformers calls a layer's
    `_gradient_checkpointing_func`: (a callable, its positional inputs). `dtype`: the dtype the model is loaded in,
    Unsloth's buffer dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.session = None
        self.host: list[torch.Tensor] | None = None  # CPU_BUFFERS: made at the first call of a session

    def reset(self, session) -> None:
        """A fresh process's state (initialize_unsloth_gradient_checkpointing), for `session` (a tracker, or None)."""
        self.session = session
        self.first_pass, self.backward_pass, self.double_buffer = True, True, False
        self.last_index = self.current_index = 0  # LAST_GC_INDEX, CURRENT_GC_INDEX
        self.staging: list[torch.Tensor | None] | None = None  # GPU_BUFFERS, GPU_BUFFERS_B: made at the first offload
        self.free_slots: list[int] = []  # host slots handed back, lowest first
        self.next_slot = self.next_buffer = 0
        self.host = [self.host_buffer(UNSLOTH_HOST_SLOT_NUMEL) for _ in range(UNSLOTH_HOST_SLOTS)]

    def __call__(self, function, *args, use_reentrant=None, preserve_rng_state=True, **ignored):
        session = current_tracker()
        if self.host is None or session is not self.session:
            if session is not None:
                session.track_host()  # before the host slots are made, so that they count apart
            self.reset(session)
        return OffloadedCheckpoint.apply(self, preserve_rng_state, *by_position(function, args))

    def host_buffer(self, numel: int) -> torch.Tensor:
        """A pinned host buffer (_new_host_buffer). On the estimate and cpu backends a host storage of the tracker,
        of the size torch's CachingHostAllocator gives (rounded up to a power of two)."""
        if self.session is None:
            if torch.cuda.is_available():
                return torch.empty(numel, dtype=self.dtype, device="cpu", pin_memory=True)
            return torch.empty(numel, dtype=self.dtype, device="cpu")  # a CPU run outside the backends
        nbytes = 1 << max(numel * self.dtype.itemsize - 1, 0).bit_length()
        token = PLACEMENT.set("host")
        try:
            return torch.empty(nbytes // self.dtype.itemsize, dtype=self.dtype, device="cpu")[:numel]
        finally:
            PLACEMENT.reset(token)

    def offload(self, x: torch.Tensor, store: torch.dtype, nbytes: int) -> tuple:
        """Copy `x` to a host slot as UnslothCheckpointFunction.forward does, with its buffers' allocations in its
        order; what backward needs to bring it back."""
        numel = -(-nbytes // self.dtype.itemsize)
        if self.staging is None:  # _ensure_device_buffers
            self.staging = [torch.empty(UNSLOTH_STAGING_NUMEL, dtype=self.dtype, device=x.device) for _ in range(2)]
        if self.backward_pass:  # a new graph
            self.backward_pass = False
            if not self.first_pass and not self.double_buffer and self.staging[1] is not None:
                free = device_free_bytes(x.device, self.session)
                if free is None or free > UNSLOTH_DOUBLE_BUFFER_FREE:
                    self.double_buffer = True
                else:
                    self.staging[1] = None  # _free_gpu_buffers_b
        slot = heapq.heappop(self.free_slots) if self.free_slots else self.next_slot  # _CpuSlotLease
        self.next_slot = max(self.next_slot, slot + 1)
        while slot >= len(self.host):
            self.host.append(self.host_buffer(numel))
        if numel > self.host[slot].numel():  # _grow_host_buffer: a new pinned block, then the old one let go
            self.host[slot] = self.host_buffer(numel)
        for index in (0, 1) if self.double_buffer else (0,):  # resize_: a new block, then the old one freed
            if numel > self.staging[index].numel():
                self.staging[index] = torch.empty(numel, dtype=self.dtype, device=x.device)
        # a non_blocking copy to pinned memory converts on the device first (aten's copy_kernel_cuda)
        source = x if x.dtype == store else x.to(store)
        stored_view(self.host[slot], nbytes, store, x.shape).copy_(source)
        del source
        buffer, self.next_buffer = self.next_buffer, self.next_buffer ^ 1
        return slot, buffer, store, nbytes, x.shape, x.dtype

    def bring_back(self, offloaded: tuple) -> torch.Tensor:
        """The offloaded input on the device again, in its staging buffer (UnslothCheckpointFunction.backward), its
        host slot handed back."""
        slot, buffer, store, nbytes, shape, dtype = offloaded
        staging = self.staging[1] if self.double_buffer and buffer == 1 else self.staging[0]
        view = stored_view(staging, nbytes, store, shape)
        view.copy_(stored_view(self.host[slot], nbytes, store, shape))
        heapq.heappush(self.free_slots, slot)
        return view


def device_free_bytes(device: torch.device, session) -> int | None:
    """What torch.cuda.mem_get_info reads as free; on the estimate and cpu backends what the allocator model can
    still reserve, None where it has no capacity."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    allocator = None if session is None else session.allocator
    if allocator is None or allocator.capacity is None:
        return None
    return allocator.capacity - allocator.reserved


class OffloadedCheckpoint(torch.autograd.Function):
    """Reentrant checkpointing that keeps a layer's first input on the host (UnslothCheckpointFunction of
    unsloth_zoo 2026.10.9): torch's CheckpointFunction but for that input (UnslothOffload.offload)."""

    @staticmethod
    def forward(ctx, state, preserve_rng_state, function, *args):
        ctx.state, ctx.function, ctx.preserve_rng_state = state, function, preserve_rng_state
        ctx.device_type = _infer_device_type(*args)
        ctx.device_autocast_kwargs, ctx.cpu_autocast_kwargs = _get_autocast_kwargs(ctx.device_type)
        if preserve_rng_state:
            ctx.fwd_cpu_state = torch.get_rng_state()
            ctx.had_device_in_fwd = getattr(_get_device_module(ctx.device_type), "_initialized", False)
            if ctx.had_device_in_fwd:
                ctx.fwd_devices, ctx.fwd_device_states = get_device_states(*args)
        ctx.inputs = [None if torch.is_tensor(arg) else arg for arg in args]
        ctx.tensor_indices = [i for i, arg in enumerate(args) if torch.is_tensor(arg)]
        tensors = [arg for arg in args if torch.is_tensor(arg)]
        ctx.requires_gradient = any(t.requires_grad for t in tensors)
        ctx.offloaded = None
        first = args[0] if args else None
        if torch.is_tensor(first) and first.requires_grad:
            if state.first_pass:  # the first pass counts the layers, so that later ones keep the last one's input
                state.last_index += 1
            state.current_index += 1
            store = torch.bfloat16 if first.dtype == torch.float32 else first.dtype  # UNSLOTH_OFFLOAD_FP32=bf16
            nbytes = first.numel() * store.itemsize
            if nbytes > UNSLOTH_MINIMUM_BYTES and (state.current_index != state.last_index or state.first_pass):
                ctx.offloaded = state.offload(first, store, nbytes)
                tensors[0] = None
        if ctx.requires_gradient:
            ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        if not ctx.requires_gradient:
            return (None,) * (3 + len(ctx.inputs))
        state, inputs = ctx.state, list(ctx.inputs)
        for index, tensor in zip(ctx.tensor_indices, ctx.saved_tensors):
            inputs[index] = tensor
        staged = None if ctx.offloaded is None else state.bring_back(ctx.offloaded)
        state.backward_pass, state.first_pass, state.current_index = True, False, 0
        devices = ctx.fwd_devices if ctx.preserve_rng_state and ctx.had_device_in_fwd else []
        with torch.random.fork_rng(devices=devices, enabled=ctx.preserve_rng_state, device_type=ctx.device_type):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.fwd_cpu_state)
                if ctx.had_device_in_fwd:
                    set_device_states(ctx.fwd_devices, ctx.fwd_device_states, device_type=ctx.device_type)
            detached = [inp.detach().requires_grad_(inp.requires_grad) if torch.is_tensor(inp) else inp
                        for inp in inputs]
            if staged is not None:
                dtype = ctx.offloaded[5]
                detached[0] = (staged.detach() if staged.dtype == dtype else staged.to(dtype)).requires_grad_(True)
            device_autocast = (torch.amp.autocast(device_type=ctx.device_type, **ctx.device_autocast_kwargs)
                               if torch.amp.is_autocast_available(ctx.device_type) else contextlib.nullcontext())
            with torch.enable_grad(), device_autocast, torch.amp.autocast("cpu", **ctx.cpu_autocast_kwargs):
                outputs = ctx.function(*detached)
        outputs = (outputs,) if torch.is_tensor(outputs) else outputs
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if torch.is_tensor(out) and out.requires_grad]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return (None, None, None, *(inp.grad if torch.is_tensor(inp) else None for inp in detached))


TOWER_NAMES = {"lm": "the language model", "vision": "the vision tower"}


def add_lora(towers: dict[str, list[nn.Module]], train: dict) -> None:
    """Inject peft LoRA adapters into each tower's modules in place and leave only the adapters trainable there.
    As get_peft_model does, adapters of a bf16/fp16 model are kept in float32 (autocast_adapter_dtype)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype, check_target_module_exists

    from vlmprobe.quantization.lora_layers import STANDIN_LORA  # imports peft: only where a point has LoRA

    parameters = list(train["lora_target_parameters"])
    config = LoraConfig(r=train["lora_r"], lora_alpha=train["lora_alpha"], lora_dropout=train["lora_dropout"],
                        target_modules=list(train["lora_target_modules"]), target_parameters=parameters or None)
    config._register_custom_module(STANDIN_LORA)  # the estimate's bitsandbytes stand-ins get peft's bnb forward
    modules = [module for listed in towers.values() for module in listed]
    names = {module: [name for name, _ in module.named_parameters()] for module in modules}
    missing = [p for p in parameters if not any(n.endswith(p) for listed in names.values() for n in listed)]
    if missing:
        where = " or ".join(TOWER_NAMES[tower] for tower in towers)
        raise ConfigError(f"train.lora_target_parameters={parameters} is not allowed: no parameter of {where} ends "
                          f"with {missing[0]}")
    # names matched by peft's own rule (a module's whole name, or its end after a dot), so that a path such as
    # LLaMA-Factory's lora_target 45.mlp.down_proj adapts that one module
    for tower, listed in towers.items():
        injected = 0
        for module in listed:
            linear = any(isinstance(m, nn.Linear) and check_target_module_exists(config, name)
                         for name, m in module.named_modules())
            if linear or any(name.endswith(tuple(parameters)) for name in names[module]):
                with fake_modules_move_by_data():
                    inject_adapter_in_model(config, module)
                cast_adapter_dtype(module, "default", autocast_adapter_dtype=True)
            for name, param in module.named_parameters():
                param.requires_grad_("lora_" in name)
                injected += "lora_" in name
        if not injected:
            raise ConfigError(f"train.lora_target_modules={list(train['lora_target_modules'])} is not allowed: no "
                              f"linear layer of {TOWER_NAMES[tower]} is named so (a name matches a layer's path "
                              f"within {TOWER_NAMES[tower]} or its end after a dot, as in peft: q_proj, "
                              f"45.mlp.down_proj)")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The model without its LoRA adapters (peft's disable_adapter, what TRL's GRPO reference is with a PEFT
    policy); a no-op for a model without adapters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def validate_knobs(train: dict, dist: str = "none") -> None:
    """One line per bad knob value, before anything is built (`dist`: the engine's name)."""
    require_flags("train", train, ("freeze_vision", "freeze_lm", "grad_ckpt_reentrant"))
    ckpt = train["grad_ckpt"]
    require_flags("train.grad_ckpt", ckpt, ("lm", "offload"))
    if not (isinstance(ckpt["vision"], bool) or ckpt["vision"] == "unsloth"):
        raise ConfigError(f"train.grad_ckpt.vision={ckpt['vision']!r} is not allowed: use true, false or unsloth (the "
                          f"layers Unsloth checkpoints where transformers does not: Mllama's vision encoder)")
    if ckpt["offload"] and not (ckpt["lm"] or ckpt["vision"]):
        raise ConfigError("train.grad_ckpt.offload=true is not allowed without checkpointing: it keeps the "
                          "checkpointed layers' inputs on the host; set train.grad_ckpt.lm or train.grad_ckpt.vision")
    if ckpt["offload"] and not train["grad_ckpt_reentrant"]:
        raise ConfigError("train.grad_ckpt.offload=true is not allowed with train.grad_ckpt_reentrant=false: "
                          "Unsloth's offloaded checkpoint is reentrant (its checkpoint forces use_reentrant=True); "
                          "set train.grad_ckpt_reentrant=true")
    if ckpt["offload"] and dist == "ddp":
        raise ConfigError("train.grad_ckpt.offload=true is not allowed with dist=ddp: under DDP Unsloth checkpoints "
                          "without reentrance and offloads through saved-tensor hooks (unsloth/models/vision.py, "
                          "post_patch_model), which is not modelled; use dist none, fsdp2 or a zero stage")
    require_counts("train", train, ("lora_r",), low=0)
    require_counts("train", train, ("grad_accum_steps",))
    towers = train["lora_towers"]
    if (not isinstance(towers, (list, tuple)) or not towers or len(set(map(str, towers))) != len(towers)
            or not set(map(str, towers)) <= set(TOWER_NAMES)):
        raise ConfigError(f"train.lora_towers={towers!r} is not allowed: give a list of distinct towers from lm and "
                          f"vision, e.g. [lm] or [lm, vision]")
    if train["lora_r"] and "vision" in towers and train["freeze_vision"]:
        raise ConfigError("train.freeze_vision=true is not allowed with train.lora_towers containing vision: the "
                          "adapters there would get no gradients; drop one of the two")
    for key in ("lora_target_modules", "lora_target_parameters"):
        names = train[key]
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"train.{key}={names!r} is not allowed: give a list of names, e.g. [q_proj, v_proj]")
    dropout = train["lora_dropout"]
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"train.lora_dropout={train['lora_dropout']!r} is not allowed: it must be in [0, 1)")
