"""What a validated point is, in the row's words: its parameter counts and optimizer label, read from the model
built on the meta device (no memory, milliseconds even for 7B), and its input columns.
"""

from __future__ import annotations

import functools
import json
import re

import torch
from hydra.utils import instantiate

from vlmprobe import quantization
from vlmprobe.config.grid import Point
from vlmprobe.errors import ConfigError, refused
from vlmprobe.gpu import device_profile
from vlmprobe.knobs import apply_knobs
from vlmprobe.models.base import DataShape, count_params
from vlmprobe.optimizers import make_optimizer
from vlmprobe.point.build import DTYPES, build_spec
from vlmprobe.results.table import axis_column

__all__ = ["describe_model", "point_inputs", "settings"]


def settings(group: str, values: dict) -> str:
    """`group.key=value, ...` for the keys of a config node that are set (for a line quoting a library)."""
    shown = [f"{group}.{k}={v!r}" for k, v in values.items() if not k.startswith("_") and v is not None]
    return ", ".join(shown) or group


@functools.lru_cache(maxsize=None)
def describe_model(model_json: str, train_json: str, optimizer_json: str) -> tuple[dict, str | None, dict]:
    """Parameter counts (knobs applied) and optimizer label from the model built on the meta device; a
    reason to skip when the optimizer's package is not installed; the trainable parameters' names by dtype."""
    train, optimizer, model_cfg = json.loads(train_json), json.loads(optimizer_json), json.loads(model_json)
    flash = model_cfg.get("attn_implementation") == "flash_attention_2"
    if flash:
        model_cfg["attn_implementation"] = "sdpa"  # same parameters; transformers refuses flash without its package
    spec = build_spec(model_cfg)
    try:
        model = spec.build(torch.device("meta"), DTYPES[train["param_dtype"]], init=False)
    except ConfigError:
        raise
    except Exception as exc:  # a hyperparameter the model's constructor (ours or transformers') refuses
        raise refused(f"model={spec.name} with its settings", f"{type(spec).__name__}'s constructor", exc) from None
    if flash and not getattr(model, "_supports_flash_attn", False):  # what transformers checks before anything else
        raise ConfigError(f"model.attn_implementation=flash_attention_2 is not allowed with model={spec.name}: "
                          f"transformers' {type(model).__name__} has no flash attention path; use sdpa or eager")
    skip = quantization.skip_reason(model, train)
    if not skip:
        quantization.freeze_quantized(model, train)  # before the adapters, as the worker quantizes before them
    try:
        apply_knobs(spec, model, train)
    except ConfigError:
        raise
    except Exception as exc:
        if not train["lora_r"]:
            raise  # freezing and checkpointing take no values a library could refuse: our own failure
        lora = {k: train[k] for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                                      "lora_target_parameters") if k != "lora_target_parameters" or train[k]}
        raise refused(settings("train", lora), "peft (LoraConfig, inject_adapter_in_model)", exc) from None
    params, trainable = count_params(model)  # quantization is not applied here: `params` counts the model's weights
    described = {"params": params, "trainable_params": trainable, "optimizer": optimizer["_target_"].rsplit(".", 1)[-1]}
    dtypes = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            dtypes.setdefault(str(param.dtype).removeprefix("torch."), []).append(name)
    if skip:
        return described, skip, dtypes
    try:
        partial = instantiate(optimizer, _convert_="all")
    except Exception as exc:  # Hydra wraps the ImportError of a missing optional package
        chain, cause = [], exc
        while cause is not None:
            chain.append(str(cause))
            cause = cause.__cause__ or cause.__context__
        missing = re.search(r"No module named '[^']+'", " ".join(chain))
        if missing:
            return (described, f"{optimizer['_target_']} cannot be imported here ({missing.group(0)}); install its "
                    f"package", dtypes)
        cause = exc.__cause__ or exc
        raise refused(settings("optimizer", optimizer), f"hydra.utils.instantiate({optimizer['_target_']})", cause) from None
    try:
        _, described["optimizer"] = make_optimizer(partial, [p for p in model.parameters() if p.requires_grad])
    except Exception as exc:  # torch's own checks of the values (lr, betas, eps, unknown keywords)
        raise refused(settings("optimizer", optimizer), optimizer["_target_"], exc) from None
    return described, None, dtypes


def point_inputs(cfg: dict, point: Point, spec, data: DataShape, shapes: dict, described: dict, step,
                 profile: device_profile.DeviceProfile | None) -> dict:
    """The row's input columns of a validated point: what it is (model, parameter counts, batch, tokens, knobs,
    engine, card, step), then a column for every swept key not among them. `shapes`: the image and video sizes
    and token counts the family computed."""
    train, measure = cfg["train"], cfg["measure"]
    image_size, image_tokens, video_tokens = shapes["image_size"], shapes["image_tokens"], shapes["video_tokens"]
    steps = measure["steps"] if data.source is None else data.steps  # a dataset's: data.steps (null: one epoch)
    if data.source is not None:  # each sample's own images, not the synthetic batch's
        image_size = image_tokens = None
    inputs = {
        "sweep": cfg["sweep"]["name"],
        "point_id": point.id,
        "case": point.case or None,
        "model": spec.name,
        # a nanoVLM checkout whose own modules run (model.source), so its rows never pass for vlmprobe's modules'
        "model_source": None if spec.source is None else str(spec.source),
        **described,
        "dtype": train["param_dtype"],
        "autocast_dtype": train["autocast_dtype"],
        "batch_size": data.batch_size,
        "grad_accum_steps": train["grad_accum_steps"],
        "effective_batch_size": data.batch_size * train["grad_accum_steps"],
        "lm_max_length": data.lm_max_length,
        "image_size": image_size if data.images_per_sample else None,
        "images_per_sample": data.images_per_sample if data.source is None else None,
        "max_pixels": data.max_pixels,
        "image_tokens": image_tokens,
        "data_source": data.source if not isinstance(data.source, dict) else json.dumps(data.source),
        **({"videos_per_sample": data.videos_per_sample, "video_frames": data.video_frames,
            "video_size": spec.video_size(data), "video_max_pixels": data.video_max_pixels,
            "video_tokens": video_tokens} if data.videos_per_sample else {}),
        "grad_ckpt_lm": train["grad_ckpt"]["lm"],
        "grad_ckpt_vision": train["grad_ckpt"]["vision"],
        "freeze_vision": train["freeze_vision"],
        "freeze_lm": train["freeze_lm"],
        "lora_r": train["lora_r"],
        "quantization": train["quantization"],
        "dist": cfg["dist"]["name"],
        "world_size": cfg["dist"]["world_size"],
        "device": profile.key if profile else None,
        "step": cfg["step"]["name"],
        **({"num_generations": step.num_generations, "max_completion_length": step.max_completion_length,
            "beta": step.beta, "use_vllm": step.use_vllm} if cfg["step"]["name"] == "grpo" else {}),
        **({"completion_length": step.completion_length} if cfg["step"]["name"] == "dpo" else {}),
        **({"reference": step.reference,
            "logits_path": step.logits + ("" if step.logits != "chunked" or step.compact else "(all positions)")}
           if step else {}),
        "attn_implementation": cfg["model"].get("attn_implementation"),
        "alloc_conf": measure.get("alloc_conf"),
        "hold_outputs": measure["hold_outputs"],
        "steps": steps,
    }
    for key, value in point.values.items():  # every swept key has a column (case keys too)
        if axis_column(key) not in inputs:
            inputs[axis_column(key)] = value if not isinstance(value, (dict, list)) else json.dumps(value)
    return inputs
