"""train.quantization: QLoRA's frozen base in bitsandbytes 4-bit (nf4) or 8-bit (int8), LoRA adapters on top.

As transformers 5.23 quantizes under BitsAndBytesConfig (integrations/bitsandbytes.py replace_with_bnb_linear):
every module whose type is exactly nn.Linear becomes a frozen Linear4bit / Linear8bitLt, except the modules
`get_keys_to_not_convert` names (lm_head, tied weights, the module of the last parameter); so the vision tower's
and the projector's linear layers are quantized too. Knobs that change memory: the type, double quantization,
the compute dtype. TRL 1.x's trainers no longer call peft's prepare_model_for_kbit_training, so vlmprobe does not
either: the rest of the model stays in train.param_dtype. The base is loaded as from_pretrained loads it, each
weight quantized as it loads (vlmprobe.quantization.loading), never whole in 16-bit.
backend cuda / cpu: the real bitsandbytes modules (vlmprobe.quantization.bnb_real); estimate: stand-ins that
allocate what bitsandbytes' CUDA path allocates (vlmprobe.quantization.bnb_standin), and optimizer=adamw_8bit's
(vlmprobe.quantization.adamw8bit_standin).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import is_transformers_model
from vlmprobe.quantization import adamw8bit_standin, bnb_real, bnb_standin, loading

__all__ = ["freeze_quantized", "layers_to_quantize", "load", "notes", "optimizer_for", "optimizer_notes", "skip_reason",
           "validate"]

TYPES = ("nf4", "int8")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
INSTALL = 'pip install -e ".[quant]"'


def validate(train: dict, backend: str, dist: str) -> None:
    """One line per value QLoRA cannot take, before anything is built."""
    kind = train.get("quantization")
    if kind is None:
        return
    if kind not in TYPES:
        raise ConfigError(f"train.quantization={kind!r} is not allowed: use nf4, int8 or null (no quantization)")
    if not train["lora_r"]:
        raise ConfigError(f"train.quantization={kind} is not allowed with train.lora_r=0: QLoRA trains LoRA adapters "
                          f"on a frozen quantized base; set train.lora_r (e.g. train.lora_r=8)")
    if not isinstance(train["quantization_double_quant"], bool):
        raise ConfigError(f"train.quantization_double_quant={train['quantization_double_quant']!r} is not allowed: "
                          f"use true or false")
    if train["quantization_compute_dtype"] not in COMPUTE_DTYPES:
        raise ConfigError(f"train.quantization_compute_dtype={train['quantization_compute_dtype']!r} is not allowed: "
                          f"use one of {', '.join(COMPUTE_DTYPES)}")
    if dist != "none":
        raise ConfigError(f"train.quantization={kind} is not allowed with dist={dist}: quantized weights are not "
                          f"sharded or replicated here; use dist=none")
    if backend in ("cuda", "cpu") and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"train.quantization={kind} on backend {backend} needs bitsandbytes, not installed here: "
                          f"{INSTALL} (or use measure.backend=estimate)")


def skip_reason(model: nn.Module, train: dict) -> str | None:
    """Why this model's layers cannot be quantized as transformers quantizes them (the row says so)."""
    if train.get("quantization") and not is_transformers_model(model):
        return (f"train.quantization={train['quantization']}: {type(model).__name__} is not a transformers model, so "
                f"transformers' bitsandbytes integration (replace_with_bnb_linear) does not pick its layers")
    return None


def layers_to_quantize(model: nn.Module) -> list[str]:
    """Names of the layers transformers' bitsandbytes integration replaces (module docstring)."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and should_convert_module(name, skip)]


def freeze_quantized(model: nn.Module, train: dict) -> None:
    """What quantization leaves trainable, on a model not quantized (the planner's meta model): the layers it
    would replace are frozen, weight and bias (replace_with_bnb_linear: requires_grad_(False))."""
    if train.get("quantization"):
        for name in layers_to_quantize(model):
            model.get_submodule(name).requires_grad_(False)


def load(spec, device: torch.device, dtype: torch.dtype, train: dict, backend: str) -> nn.Module:
    """QLoRA's base as from_pretrained loads it under a BitsAndBytesConfig (vlmprobe.quantization.loading): the
    layers transformers picks quantized weight by weight as they load, real bitsandbytes on cuda and cpu,
    stand-ins on estimate; the rest in `dtype`."""
    if backend == "estimate":
        bnb_standin.notes()  # forget what an earlier point in this process left
    replace = bnb_standin.replace if backend == "estimate" else bnb_real.replace
    model = spec.build_empty(dtype)
    return loading.load(model, device, layers_to_quantize(model), lambda linear, maps: replace(linear, train, maps))


def notes(train: dict, backend: str) -> list[str]:
    """What a row should say about how its quantized matmuls were charged (estimate only)."""
    if not train.get("quantization") or backend != "estimate":
        return []
    return bnb_standin.notes()


def optimizer_for(optimizer: dict, backend: str) -> dict:
    """The optimizer config a point runs: on the estimate, bitsandbytes' 8-bit AdamW is its stand-in
    (vlmprobe.quantization.adamw8bit_standin: the same state, allocated as on CUDA; bitsandbytes is not needed)."""
    target = adamw8bit_standin.TARGETS.get(optimizer.get("_target_")) if backend == "estimate" else None
    return {**optimizer, "_target_": target} if target else optimizer


def optimizer_notes(optimizer: dict) -> list[str]:
    """What a row should say of an optimizer the estimate ran a stand-in of."""
    if optimizer.get("_target_") not in adamw8bit_standin.TARGETS.values():
        return []
    return ["bitsandbytes' AdamW8bit modelled by a stand-in (uint8 moments, a float32 maximum per 256 elements, float32 "
            "moments under 4096 elements, as bitsandbytes 0.50 allocates them)"]
