"""A point's parts, built from its config: the model spec, the model with its knobs, the step's settings and
GRPO's or DPO's frozen reference model. The planner builds the same parts on the meta device to count them."""

from __future__ import annotations

import gc
import json

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from vlmprobe import quantization
from vlmprobe.errors import ConfigError
from vlmprobe.kernels import liger
from vlmprobe.knobs import apply_knobs
from vlmprobe.models.base import DataShape
from vlmprobe.steps.dpo import DPOSettings
from vlmprobe.steps.grpo import GRPOSettings

__all__ = ["DTYPES", "build_spec", "built", "model_key", "parameter_shapes", "reference_model", "step_settings"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_spec(model_cfg: dict):
    """The family's ModelSpec from `model` (its `_target_` and hyperparameters); a family's own refusal stays
    its one line."""
    try:
        return instantiate(model_cfg, _convert_="all")
    except InstantiationException as exc:
        if isinstance(exc.__cause__, ConfigError):  # the family's own one line (e.g. a model.config that is missing)
            raise exc.__cause__ from None
        raise


def built(spec, engine, train: dict, backend_name: str, meter, mark) -> tuple[torch.nn.Module, int]:
    """The point's model, knobs applied, in training mode, and the build's peak allocated bytes (the model's
    construction and its weights' fill; QLoRA's base loaded and quantized weight by weight), read before
    `mark()`."""
    dtype = DTYPES[train["param_dtype"]]
    if train.get("quantization"):  # single device only (quantization.validate)
        model = quantization.load(spec, engine.device, dtype, train, backend_name)
    else:
        model = engine.build(spec, dtype)
    # What the build left to reference cycles is freed before training: between a model's load and its first
    # step a real run allocates Python objects by the million, so a full collection has run (the case met: a tied
    # LM head's first weight under zero.Init, held by DeepSpeed's per-parameter closures). The estimate and
    # cpu sessions run with the collector off from a full collection on (vlmprobe.backends.estimate), so
    # everything made since is in the youngest generation: collecting that one is collecting the build's
    # garbage. On cuda the collector runs as usual.
    gc.collect(0)
    build_peak = meter.peaks()["allocated"]
    mark()  # a kept model's build is replayed to here for this peak (vlmprobe.estimate.replay.built_models)
    liger.apply(spec, model, train)  # Liger-Kernel's patches (train.liger_kernel), before the knobs
    apply_knobs(spec, model, train)
    model.train()
    return model, build_peak


def model_key(point: dict) -> str | None:
    """What decides the model a point builds, knobs applied: its model and train config, for a backend that keeps
    built models for later points (vlmprobe.estimate.replay.built_models). None where it is not kept: an engine
    other than the single device's wraps or shards it (dist), GRPO and DPO build a reference model beside it."""
    if point["dist"]["name"] != "none" or point["step"]["name"] != "sft":
        return None
    return json.dumps([point["model"], point["train"]], sort_keys=True)


def step_settings(point: dict, data: DataShape, spec):
    """The step's validated settings: GRPOSettings, DPOSettings, or None for sft."""
    if point["step"]["name"] == "grpo":
        return GRPOSettings.from_point(point, data, spec)
    if point["step"]["name"] == "dpo":
        return DPOSettings.from_point(point, data, spec)
    return None


def reference_model(spec, point: dict, engine, settings):
    """The frozen reference model of GRPO (beta > 0) and DPO: a copy of the policy in its weight dtype (TRL
    loads it with the policy's model_init_kwargs), no gradients, eval mode, prepared as TRL prepares it beside
    the engine; None where there is none or the policy is its own reference (LoRA: both trainers disable the
    adapters)."""
    if settings is None or not settings.reference or point["train"]["lora_r"]:
        return None
    model = engine.build(spec, DTYPES[point["train"]["param_dtype"]])
    return engine.prepare_reference(spec, model.requires_grad_(False).eval())


def parameter_shapes(config: dict) -> list[tuple[int, ...]]:
    """Shapes of the model's parameters (knobs applied), from the model built on the meta device."""
    spec = build_spec(config["model"])
    model = spec.build(torch.device("meta"), DTYPES[config["train"]["param_dtype"]], init=False)
    apply_knobs(spec, model, config["train"])
    return [tuple(p.shape) for p in model.parameters()]
