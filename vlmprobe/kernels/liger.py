"""train.liger_kernel: Liger-Kernel's kernels as ms-swift, LLaMA-Factory and TRL apply them (`use_liger_kernel`).

The rule, read from liger_kernel 0.8.5 (transformers/monkey_patch.py, transformers/model/qwen2_vl.py, qwen2_5_vl.py,
qwen3_vl.py) and transformers 5.25 (integrations/liger.py): the Trainer calls `_apply_liger_kernel_to_instance(model)`,
which runs `apply_liger_kernel_to_<model_type>(model=model)` with its defaults: fused linear cross-entropy (the
top model's forward replaced: in training with labels the loss and the gradients of the hidden states and of
lm_head's weight are computed chunk by chunk in forward, the logits never whole), RMSNorm, SwiGLU, RoPE and the
vision tower's LayerNorm where the family's function patches them (FAMILIES). Liger's kernels are Triton, GPU only:
`apply` patches the built model's instance the same way with the stand-ins of vlmprobe.kernels.liger_ops, which
allocate and save what Liger's kernels do, on every backend.

Limits: the families of FAMILIES only, step=sft, not ZeRO-3 (refused in one line by `validate`); the RoPE patches of
Qwen2-VL and Qwen2.5-VL replace `apply_multimodal_rotary_pos_emb`, which transformers 5.17-5.25 no longer call, so
they change nothing and none is modelled; the forward returns no rope_deltas (Liger's reads `outputs.rope_deltas`,
which transformers 5.20+ removed) and no cache. What each stand-in computes, and its card assumptions:
vlmprobe.kernels.liger_ops; the whole story: docs/kernels.md.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.kernels.liger_ops import (CAPABILITY, MULTIPROCESSORS, LayerNormFunction, RMSNormFunction,
                                        SiLUMulFunction, causal_lm_loss, rope_text, rope_vision)

__all__ = ["FAMILIES", "MODEL_TYPES", "VERSION", "Family", "apply", "family_of", "notes", "patch_layer_norm",
           "patch_module_functions", "patch_rms_norm", "patch_swiglu", "validate"]

VERSION = "0.8.5"  # the liger-kernel release read


def _bind(module: nn.Module, name: str, function: Callable) -> None:
    """monkey_patch.py _bind_method_to_module: `function` as this instance's method."""
    module.__dict__[name] = types.MethodType(function, module)


def _rms_norm_forward(self, hidden_states):  # transformers/rms_norm.py LigerRMSNorm.forward
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode,
                                 self.in_place, self.row_mode)


def _layer_norm_forward(self, hidden_states):  # LigerLayerNorm.forward -> functional.layer_norm -> Triton impl
    bias = self.bias if self.bias is not None else torch.zeros_like(self.weight)
    return LayerNormFunction.apply(hidden_states, self.weight, bias, self.variance_epsilon)


def _swiglu_forward(self, x):  # transformers/swiglu.py LigerSwiGLUMLP.forward
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x), 1.0, 1.0))


def patch_rms_norm(module: nn.Module, offset: float = 0.0, eps: float = 1e-6, casting_mode: str = "llama",
                   in_place: bool = True, row_mode=None) -> None:
    """monkey_patch.py _patch_rms_norm_module (a module not wrapped by peft's ModulesToSaveWrapper)."""
    module.offset, module.casting_mode, module.in_place, module.row_mode = offset, casting_mode, in_place, row_mode
    module.variance_epsilon = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or eps
    _bind(module, "forward", _rms_norm_forward)
    _bind(module, "_get_name", lambda self: "LigerRMSNorm")


def patch_layer_norm(module: nn.Module, eps: float = 1e-6) -> None:
    """monkey_patch.py _patch_layer_norm_module."""
    module.variance_epsilon = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or eps
    module.hidden_size = getattr(module, "hidden_size", None) or getattr(module, "normalized_shape", None)
    _bind(module, "forward", _layer_norm_forward)
    _bind(module, "_get_name", lambda self: "LigerLayerNorm")


def patch_swiglu(module: nn.Module) -> None:
    """monkey_patch.py _patch_swiglu_module(module, LigerSwiGLUMLP)."""
    _bind(module, "forward", _swiglu_forward)
    _bind(module, "_get_name", lambda self: "LigerSwiGLUMLP")


def patch_module_functions(module: nn.Module, replacements: dict[str, Callable]) -> None:
    """Liger sets functions of the family's modeling module (`modeling_qwen3_vl.apply_rotary_pos_emb = ...`), which
    every model of the family then calls; here only this instance's calls see them: its forward runs with them in
    place and puts the originals back (also when activation checkpointing runs it again in backward)."""
    modeling = sys.modules[type(module).__module__]
    for name in replacements:
        getattr(modeling, name)  # the name the module's code calls: an AttributeError here says transformers moved it
    forward = module.forward

    def with_replacements(*args, **kwargs):
        originals = {name: getattr(modeling, name) for name in replacements}
        for name, function in replacements.items():
            setattr(modeling, name, function)
        try:
            return forward(*args, **kwargs)
        finally:
            for name, function in originals.items():
                setattr(modeling, name, function)

    module.forward = with_replacements


def _text_layers(text: nn.Module, swiglu: bool, qk_norm: bool = False, rope: Callable | None = None) -> None:
    """The language model's final norm, and per decoder layer its two norms, its MLP (swiglu), its attention's q and
    k norms (qk_norm) and the attention's RoPE function (rope)."""
    patch_rms_norm(text.norm)
    for layer in text.layers:
        if swiglu:
            patch_swiglu(layer.mlp)
        patch_rms_norm(layer.input_layernorm)
        patch_rms_norm(layer.post_attention_layernorm)
        attention = layer.self_attn
        if qk_norm:
            for name in ("q_norm", "k_norm"):
                if getattr(attention, name, None) is not None:
                    patch_rms_norm(getattr(attention, name))
        if rope is not None:
            patch_module_functions(attention, {"apply_rotary_pos_emb": rope})


def _qwen2_vl(model: nn.Module) -> None:
    """apply_liger_kernel_to_qwen2_vl: the vision blocks' LayerNorms, the LM's RMSNorms and SwiGLU MLPs."""
    for block in model.model.visual.blocks:
        patch_layer_norm(block.norm1)
        patch_layer_norm(block.norm2)
    _text_layers(model.model.language_model, swiglu=True)


def _qwen2_5_vl(model: nn.Module) -> None:
    """apply_liger_kernel_to_qwen2_5_vl: the vision blocks' RMSNorms, the LM's RMSNorms and SwiGLU MLPs."""
    for block in model.model.visual.blocks:
        patch_rms_norm(block.norm1)
        patch_rms_norm(block.norm2)
    _text_layers(model.model.language_model, swiglu=True)


def _qwen3_vl(model: nn.Module) -> None:
    """apply_liger_kernel_to_qwen3_vl (swiglu off by default): the LM's RMSNorms with the q and k norms, RoPE in
    the LM's and the vision tower's attention (modeling_qwen3_vl.apply_rotary_pos_emb and _vision)."""
    _text_layers(model.model.language_model, swiglu=False, qk_norm=True, rope=rope_text)
    for block in model.model.visual.blocks:
        patch_module_functions(block.attn, {"apply_rotary_pos_emb_vision": rope_vision})


@dataclass(frozen=True)
class Family:
    """A model_type Liger patches: the transformers class vlmprobe builds for it, what its apply function patches
    besides the forward, and whether its lce_forward slices the hidden states by logits_to_keep outside training."""

    model_class: str
    patch: Callable[[nn.Module], None]
    kernels: str  # what the patches are, for docs and refusals
    slices_logits: bool


FAMILIES = {
    "qwen2_vl": Family("Qwen2VLForConditionalGeneration", _qwen2_vl,
                       "FLCE, RMSNorm, SwiGLU, vision LayerNorm", slices_logits=False),
    "qwen2_5_vl": Family("Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl,
                         "FLCE, RMSNorm (LM and vision blocks), SwiGLU", slices_logits=False),
    "qwen3_vl": Family("Qwen3VLForConditionalGeneration", _qwen3_vl,
                       "FLCE, RMSNorm (with q/k norms), RoPE (LM and vision)", slices_logits=True),
}
MODEL_TYPES = {family.model_class: name for name, family in FAMILIES.items()}


def _lce_forward(self, input_ids=None, labels=None, logits_to_keep=0, skip_logits=None, **kwargs):
    """transformers/model/<family>.py lce_forward: the model's own backbone, then in training with labels the fused
    loss over every position's hidden state (LigerForCausalLMLoss), else the head's logits and the model's loss."""
    from transformers.modeling_outputs import CausalLMOutputWithPast  # transformers is loaded: the model is one

    family = FAMILIES[self.config.model_type]
    kwargs.pop("rope_deltas", None)  # a parameter of Liger's forward that it passes to nothing
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden_states = outputs[0]
    if family.slices_logits:
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = hidden_states[:, kept, :]
    if skip_logits is None:
        skip_logits = self.training and (labels is not None or shift_labels is not None)
    text = self.config.get_text_config()
    loss = logits = None
    if skip_logits:
        loss = causal_lm_loss(hidden_states, self.lm_head.weight, labels, text.hidden_size,
                              num_items_in_batch=kwargs.get("num_items_in_batch"), shift_labels=shift_labels)
    else:
        logits = self.lm_head(hidden_states)
        if labels is not None or shift_labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, shift_labels=shift_labels,
                                      vocab_size=text.vocab_size)
    return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions)


def family_of(spec) -> str | None:
    """The model_type of Liger's apply function for the model `spec` builds, or None where Liger (as modelled here)
    patches none."""
    return MODEL_TYPES.get(getattr(spec, "model_class", None))


def validate(train: dict, spec, step: str, dist: str) -> None:
    """One line for a train.liger_kernel this point cannot take, before anything is built."""
    value = train.get("liger_kernel", False)
    if not isinstance(value, bool):
        raise ConfigError(f"train.liger_kernel={value!r} is not allowed: use true or false")
    if not value:
        return
    if family_of(spec) is None:
        what = getattr(spec, "model_class", None) or type(spec).__name__
        raise ConfigError(f"train.liger_kernel=true is not allowed with model={spec.name} ({what}): vlmprobe models "
                          f"Liger-Kernel {VERSION}'s patches for model types {', '.join(FAMILIES)} only; use false")
    if step != "sft":
        raise ConfigError(f"train.liger_kernel=true is not allowed with step={step}: only the supervised step is "
                          f"modelled (TRL's GRPO and DPO losses read the logits, or Liger's own losses); use step=sft "
                          f"or false")
    if dist == "zero3":
        raise ConfigError("train.liger_kernel=true is not allowed with dist=zero3: Liger's fused cross-entropy reads "
                          "lm_head.weight outside lm_head's forward, where ZeRO-3 has not gathered it (not modelled); "
                          "use another dist or false")


def apply(spec, model: nn.Module, train: dict) -> None:
    """Patch the built model as `_apply_liger_kernel_to_instance(model)` patches it (module docstring); nothing
    without train.liger_kernel. No parameter changes."""
    if not train.get("liger_kernel"):
        return
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None or type(model).__name__ != family.model_class:
        raise ConfigError(f"train.liger_kernel=true is not allowed with model={spec.name} ({type(model).__name__}): "
                          f"vlmprobe models Liger-Kernel {VERSION}'s patches for model types {', '.join(FAMILIES)} "
                          f"only; use false")
    family.patch(model)
    _bind(model, "forward", _lce_forward)


def notes(train: dict) -> list[str]:
    """What a row should say of a point run with the stand-ins."""
    if not train.get("liger_kernel"):
        return []
    return [f"Liger-Kernel {VERSION} modelled (train.liger_kernel): stand-ins allocating what its Triton kernels "
            f"allocate, patched as _apply_liger_kernel_to_instance patches the model; off CUDA as on an "
            f"sm{CAPABILITY}0 card with {MULTIPROCESSORS} SMs (the norms' partial gradients, the fused loss's "
            f"weight-gradient path)"]
