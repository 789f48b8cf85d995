"""Every point of a sweep, composed and validated before anything runs.

Each point is the command line's config plus the point's overrides, composed by Hydra (so group axes such
as `model` work like any override). Validation turns every bad value into one ConfigError line
(vlmprobe.config.checks); the row's inputs come from the model built on the meta device (vlmprobe.config.describe).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from vlmprobe import quantization
from vlmprobe.backends import cuda
from vlmprobe.config import checks
from vlmprobe.config.describe import describe_model, point_inputs
from vlmprobe.config.grid import Point, expand, flatten_axes, flatten_cases
from vlmprobe.config.overrides import check_group_choices, compose_checked, composing, resolved
from vlmprobe.distributed import options as dist_options
from vlmprobe.distributed.deepspeed_engine import check_point
from vlmprobe.errors import ConfigError, refused
from vlmprobe.kernels import liger
from vlmprobe.models.base import DataShape
from vlmprobe.point.build import build_spec

__all__ = ["MAX_LAYERS", "Composer", "PlannedPoint", "grid_points", "plan", "plan_overrides", "plan_point", "validate_point"]


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
        check_group_choices(point.overrides)
        try:
            cfg = self._compose_fast(point.overrides)
        except Exception:  # Hydra refuses something: compose whole for the one line that names the override
            cfg = compose_checked(self.compose, self.overrides + point.overrides)
        return resolved(cfg, point.id)

    def _compose_fast(self, point_overrides: list[str]):
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


def validate_point(cfg: dict, point: Point) -> tuple[dict, str | None]:
    """Check one composed point; return its input columns and a reason to skip it, if any. Raises
    ConfigError (one line) for a value that is not allowed."""
    train, measure = cfg["train"], cfg["measure"]
    measure["backend"] = checks.resolve_backend(measure["backend"])
    checks.check_train(train, measure["backend"], cfg["dist"]["name"])
    profile, allocator = checks.check_measure(cfg)
    data = DataShape.from_config(cfg["data"])
    spec, shapes = model_shapes(cfg["model"], data)
    liger.validate(train, spec, cfg["step"]["name"], cfg["dist"]["name"])  # needs the family: after the spec
    dist_options.validate(cfg["dist"], measure["backend"], cfg.get("find"), cuda.device_count)
    step = checks.check_step(cfg, data, spec)
    checks.check_source(cfg, data, spec)  # data.source: its dataset read, before anything runs
    cfg["optimizer"] = quantization.optimizer_for(cfg["optimizer"], measure["backend"])
    described, skip, trainable = describe_model(*(json.dumps(cfg[k], sort_keys=True)
                                                  for k in ("model", "train", "optimizer")))
    if cfg["dist"]["name"] in dist_options.DEEPSPEED_ENGINES:
        check_point(cfg, spec.text["hidden_size"], trainable)
    inputs = point_inputs(cfg, point, spec, data, shapes, described, step, profile)
    return inputs, (skip or checks.kernel_skip(cfg) or checks.allocator_skip(allocator, measure["backend"])
                    or dist_options.skip_reason(cfg["dist"], measure["backend"]))


MAX_LAYERS = 256  # layers a tower may have: the deepest published VLM towers have 100 or fewer
LAYER_KEYS = ("num_hidden_layers", "depth", "num_layers")


def check_depth(spec, model: dict) -> None:
    """One line for a tower deeper than MAX_LAYERS, before any module is built: planning builds every layer on
    the meta device and the estimate runs each, so 10^6 layers would take hours and gigabytes, not an answer."""
    for tower in ("text", "vision"):
        hyper = getattr(spec, tower, None)
        for key in LAYER_KEYS if isinstance(hyper, dict) else ():
            value = hyper.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LAYERS:
                where = (f"model.{tower}.{key}={value}" if "config" not in model else
                         f"model.config={model['config']} (its {tower} {key}={value})")
                raise ConfigError(f"{where} is not allowed: vlmprobe builds at most {MAX_LAYERS} layers a tower (the "
                                  f"deepest published VLM towers have 100 or fewer); give at most {MAX_LAYERS}")


def model_shapes(model: dict, data: DataShape) -> tuple[object, dict]:
    """The family's spec, and the image and video sizes and tokens it gives `data`. The data is valid by now:
    what fails here is the model's own settings (a side, a factor)."""
    try:
        spec = build_spec(model)
        check_depth(spec, model)
        spec.validate(data)
        shapes = {"image_size": spec.image_size(data), "image_tokens": spec.image_tokens(data),
                  "video_tokens": spec.video_tokens(data)}
    except ConfigError:
        raise
    except Exception as exc:  # Hydra's InstantiationException: the cause is the constructor's own refusal
        raise refused(f"model={model.get('name', '?')} with its settings", str(model.get("_target_")),
                      exc.__cause__ or exc) from None
    return spec, shapes


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
    with composing() as compose:
        return plan(compose, overrides, OmegaConf.to_container(compose(overrides), resolve=True))
