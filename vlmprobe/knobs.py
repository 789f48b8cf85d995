"""Training knobs that change a built model: activation checkpointing, frozen towers, LoRA adapters.

Applied to the model the worker measures and to the meta-device model the planner counts parameters on,
so `trainable_params` in a row is what the optimizer really got.
"""

from __future__ import annotations

import contextlib

from torch import nn

from vlmprobe.errors import ConfigError, require_counts, require_flags
from vlmprobe.estimate.fake_patches import fake_modules_move_by_data
from vlmprobe.models.base import is_transformers_model

__all__ = ["adapters_disabled", "add_lora", "apply_knobs", "checkpoint_layers", "validate_knobs"]


def apply_knobs(spec, model: nn.Module, train: dict) -> None:
    if not (any(train["grad_ckpt"].values()) or train["freeze_vision"] or train["freeze_lm"] or train["lora_r"]):
        return  # full fine-tune as built
    towers = spec.towers(model)
    reentrant = train["grad_ckpt_reentrant"] and any(train["grad_ckpt"].values())
    if reentrant and not is_transformers_model(model):
        raise ConfigError(f"train.grad_ckpt_reentrant=true is not allowed for {spec.name}: reentrant checkpointing "
                          f"is offered for transformers models, whose enable_input_require_grads lets gradients "
                          f"into the checkpointed layers; use false")
    for tower in ("lm", "vision"):
        if train["grad_ckpt"][tower] and not [checkpoint_layers(m, reentrant) for m in towers[tower] if has_layers(m)]:
            raise ConfigError(f"train.grad_ckpt.{tower}=true is not allowed for {spec.name}: its {tower} tower has "
                              f"no layers that transformers checkpoints")
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


def validate_knobs(train: dict) -> None:
    """One line per bad knob value, before anything is built."""
    require_flags("train", train, ("freeze_vision", "freeze_lm", "grad_ckpt_reentrant"))
    require_flags("train.grad_ckpt", train["grad_ckpt"], ("lm", "vision"))
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
