"""Compose and validate every point of a sweep before anything runs, and describe each point's inputs.

Each point is the command line's config plus the point's overrides, composed by Hydra (so group axes such
as `model` work like any override). Validation turns every bad value into one ConfigError line; the
parameter counts come from the model built on the meta device (no memory, milliseconds even for 7B).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass

from omegaconf import OmegaConf

from vlmprobe import quantization
from vlmprobe.estimate import alloc_conf, device_profile
from vlmprobe.distributed import options as dist_options
from vlmprobe.errors import ConfigError, first_line, refused, require_flags
from vlmprobe.grid import Point, expand, flatten_axes, flatten_cases
from vlmprobe.results import axis_column
from vlmprobe.sizes import parse_bytes

DTYPE_NAMES = ("float32", "bfloat16", "float16")
RECORD_HISTORY = ("off", "alloc", "all")


@dataclass
class PlannedPoint:
    point: Point
    config: dict  # the composed config of this point, resolved, plain data
    inputs: dict  # the row's input columns
    skip: str | None = None  # why this point cannot run here (an optional package missing); its row says `skipped`


def check_axis_keys(base: dict, keys: list[str], overrides: list[str]) -> None:
    """Every swept key names a config key or a config group, and is not also set on the command line."""
    set_keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    for key in keys:
        node = base
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(
                    f"sweep axis {key!r} is not allowed: it is not a key of the config (e.g. data.batch_size, "
                    f"data.lm_max_length, data.image_size, train.param_dtype, model)"
                )
            node = node[part]
        if key in set_keys:
            raise ConfigError(f"{key} is both swept and set on the command line: set the axis instead, "
                              f"e.g. sweep.axes.{key}=[value]")


def grid_points(overrides: list[str], base: dict) -> list[Point]:
    """The points of the base config's sweep, its swept keys checked."""
    axes, cases = base["sweep"]["axes"] or {}, base["sweep"].get("cases")
    # a case that picks a group's option ({dist: zero3}) may set that option's own keys, which the base's option
    # may lack: Hydra checks those when the point is composed, and refuses an unknown one there
    keys = {*flatten_axes(axes), *(k for case in flatten_cases(cases) for k in case
                                   if k.split(".")[0] == k or k.split(".")[0] not in case)}
    check_axis_keys(base, sorted(keys), overrides)
    return expand(axes, cases)


class Composer:
    """The composed config of each point, resolved, as plain data; `compose(overrides) -> DictConfig` is Hydra's.

    Hydra composes a config in two stages: the defaults list, which only the group choices decide (`model=...`),
    then the value overrides (`data.batch_size=4`) applied in order to the merged config (ConfigLoaderImpl.
    _load_configuration_impl). The first stage is most of the time (~0.45 s a point), so it runs once per distinct
    set of a point's group choices, and each point's value overrides are applied by Hydra's own
    `_apply_overrides_to_config` to a copy: the same two stages, the same config (tests/test_plan_compose.py).
    A point Hydra refuses is composed whole, so that its error is named as before."""

    def __init__(self, compose, overrides: list[str]):
        self.compose, self.overrides = compose, overrides
        self._composed: dict[tuple[str, ...], object] = {}  # the point's group choices -> their composed DictConfig

    def __call__(self, point: Point) -> dict:
        from vlmprobe.overrides import check_group_choices, compose_checked

        check_group_choices(point.overrides)
        try:
            cfg = self._compose_fast(point.overrides)
        except Exception:  # Hydra refuses something: compose whole for the one line that names the override
            cfg = compose_checked(self.compose, self.overrides + point.overrides)
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except Exception as exc:  # an interpolation that does not resolve
            raise ConfigError(f"point {point.id} is not allowed: its config does not resolve ({first_line(exc)})") from None
        cfg.pop("hydra", None)
        return cfg

    def _compose_fast(self, point_overrides: list[str]):
        import copy

        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        repository = GlobalHydra.instance().config_loader().repository
        parsed = OverridesParser.create().parse_overrides(point_overrides)
        # Hydra's own split (defaults_list.Overrides): a dict value, or a key that is no group, is a value override
        is_value = [isinstance(o.value(), dict) or not repository.group_exists(o.key_or_group) for o in parsed]
        groups = tuple(line for line, value in zip(point_overrides, is_value) if not value)
        if groups not in self._composed:
            self._composed[groups] = self.compose(self.overrides + list(groups))
        cfg = copy.deepcopy(self._composed[groups])
        ConfigLoaderImpl._apply_overrides_to_config([o for o, value in zip(parsed, is_value) if value], cfg)
        return cfg


def settings(group: str, values: dict) -> str:
    """`group.key=value, ...` for the keys of a config node that are set (for a line quoting a library)."""
    shown = [f"{group}.{k}={v!r}" for k, v in values.items() if not k.startswith("_") and v is not None]
    return ", ".join(shown) or group


@functools.lru_cache(maxsize=None)
def _describe_model(model_json: str, train_json: str, optimizer_json: str) -> tuple[dict, str | None, dict]:
    """Parameter counts (knobs applied) and optimizer label from the model built on the meta device; a
    reason to skip when the optimizer's package is not installed; the trainable parameters' names by dtype."""
    import torch
    from hydra.utils import instantiate

    from vlmprobe.knobs import apply_knobs
    from vlmprobe.models.base import count_params
    from vlmprobe.steps.common import make_optimizer
    from vlmprobe.worker import DTYPES, build_spec

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


@functools.lru_cache(maxsize=None)
def _resolve_backend(name: str) -> str:
    from vlmprobe import backends

    return backends.resolve(name)[0]


def validate_point(cfg: dict, point: Point) -> tuple[dict, str | None]:
    """Check one composed point; return its input columns and a reason to skip it, if any. Raises
    ConfigError (one line) for a value that is not allowed."""
    from vlmprobe.models.base import DataShape
    from vlmprobe.worker import build_spec

    from vlmprobe.knobs import validate_knobs

    train, measure = cfg["train"], cfg["measure"]
    measure["backend"] = _resolve_backend(measure["backend"])
    validate_knobs(train)
    quantization.validate(train, measure["backend"], cfg["dist"]["name"])
    if train["param_dtype"] not in DTYPE_NAMES:
        raise ConfigError(f"train.param_dtype={train['param_dtype']!r} is not allowed: use one of {', '.join(DTYPE_NAMES)}")
    if train["autocast_dtype"] not in (*DTYPE_NAMES[1:], None):
        raise ConfigError(f"train.autocast_dtype={train['autocast_dtype']!r} is not allowed: use bfloat16, float16 or null")
    steps = measure["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise ConfigError(f"measure.steps={steps!r} is not allowed: it must be a positive integer")
    measure["device_memory"] = parse_bytes(measure["device_memory"], "measure.device_memory")
    # the target card: a capacity above it, or bfloat16 on a card without it, is refused before any model is built
    profile = device_profile.from_config(cfg["device"])
    device_profile.check(measure["device_memory"], train, cfg["dist"], cfg["model"].get("attn_implementation"), profile)
    if measure["backend"] == "cuda" and measure["isolate"] is False:
        raise ConfigError("measure.isolate=false is not allowed with backend cuda: each CUDA point runs in a fresh "
                          "process, or one point's allocator state would leak into the next")
    if measure["isolate"] not in ("auto", True, False):
        raise ConfigError(f"measure.isolate={measure['isolate']!r} is not allowed: use auto, true or false")
    if measure["record_history"] not in RECORD_HISTORY:
        raise ConfigError(f"measure.record_history={measure['record_history']!r} is not allowed: use one of "
                          f"{', '.join(RECORD_HISTORY)}")
    timeout = measure["timeout_s"]
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0):
        raise ConfigError(f"measure.timeout_s={timeout!r} is not allowed: give seconds > 0, or null for no limit")
    if measure["alloc_conf"] is not None and not isinstance(measure["alloc_conf"], str):
        raise ConfigError(f"measure.alloc_conf={measure['alloc_conf']!r} is not allowed: give allocator settings "
                          f"text such as \"expandable_segments:True\", or null")
    allocator = alloc_conf.parse(measure["alloc_conf"])  # torch's parser rules: a key or value it refuses, one line
    require_flags("measure", measure, ("snapshot", "hold_outputs"))
    data = DataShape.from_config(cfg["data"])
    try:  # the data is valid by now: what fails here is the model's own settings (a side, a factor)
        spec = build_spec(cfg["model"])
        spec.validate(data)
        image_size, image_tokens = spec.image_size(data), spec.image_tokens(data)
        video_tokens = spec.video_tokens(data)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra's InstantiationException: the cause is the constructor's own refusal
        raise refused(f"model={cfg['model'].get('name', '?')} with its settings", str(cfg["model"].get("_target_")),
                      exc.__cause__ or exc) from None
    dist_options.validate(cfg["dist"], measure["backend"], cfg.get("find"), _visible_gpus)
    step = validate_step(cfg, data, spec)
    described, skip, trainable = _describe_model(*(json.dumps(cfg[k], sort_keys=True)
                                                   for k in ("model", "train", "optimizer")))
    if cfg["dist"]["name"] in dist_options.DEEPSPEED_ENGINES:
        from vlmprobe.distributed.deepspeed_engine import check_point

        check_point(cfg, spec.text["hidden_size"], trainable)
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
        "images_per_sample": data.images_per_sample,
        "max_pixels": data.max_pixels,
        "image_tokens": image_tokens,
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
    return inputs, (skip or kernel_skip(cfg) or allocator_skip(allocator, measure["backend"])
                    or dist_options.skip_reason(cfg["dist"], measure["backend"]))


STEPS = ("sft", "grpo", "dpo")


def validate_step(cfg: dict, data, spec):
    """The step's settings (vlmprobe.worker.step_settings: None for sft); one ConfigError line for a bad value."""
    from vlmprobe.worker import step_settings

    name = cfg["step"]["name"]
    if name not in STEPS:
        raise ConfigError(f"step.name={name!r} is not allowed: use one of {', '.join(STEPS)} (step=sft | step=grpo | "
                          f"step=dpo)")
    return step_settings(cfg, data, spec)


def _visible_gpus() -> int:
    from vlmprobe.backends.cuda import device_count

    return device_count()


def kernel_skip(cfg: dict) -> str | None:
    """Why a point's attention kernel cannot run here: flash_attention_2 needs the flash-attn package and a
    CUDA GPU (there is no CPU kernel to estimate it with)."""
    if cfg["model"].get("attn_implementation") != "flash_attention_2":
        return None
    if cfg["measure"]["backend"] == "estimate":
        return None  # vlmprobe.estimate.flash_attn_standin stands in for the package and its kernels
    if cfg["measure"]["backend"] != "cuda":
        return f"flash_attention_2 has no CPU kernel to run on backend {cfg['measure']['backend']}; use sdpa or a GPU"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attention_2 needs the flash-attn package (pip install flash-attn), not installed here"
    return None


def allocator_skip(allocator: alloc_conf.AllocatorSettings, backend: str) -> str | None:
    """Why a point's allocator cannot be modelled: the estimate and cpu backends model the native caching
    allocator; cudaMallocAsync reserves through the driver's pool, by rules of its own."""
    if allocator.backend == "native" or backend == "cuda":
        return None
    return f"backend:cudaMallocAsync is not modelled (the {backend} backend models the native caching allocator)"


def plan_point(composer: Composer, point: Point) -> PlannedPoint:
    cfg = composer(point)
    return PlannedPoint(point, cfg, *validate_point(cfg, point))


def plan(compose, overrides: list[str], base: dict) -> list[PlannedPoint]:
    """Every point of the sweep, composed and validated, before anything runs."""
    composer = Composer(compose, overrides)
    return [plan_point(composer, point) for point in grid_points(overrides, base)]


def plan_overrides(overrides: list[str]) -> list[PlannedPoint]:
    """The planned points of a command line's overrides, composed from conf/ (for scripts that run points
    without the command around them)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from vlmprobe.overrides import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = lambda extra: compose(config_name="config", overrides=list(extra))  # noqa: E731
        return plan(config, overrides, OmegaConf.to_container(config(overrides), resolve=True))
