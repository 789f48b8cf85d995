"""One line for each bad value of a config, where the values enter, before anything is built: the command's own
keys (config.yaml), and each point's train, measure and step sections. Where a point cannot run here for want of
a package or a kernel, it is not refused but skipped, and its row says why (`*_skip`).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from vlmprobe import backends, quantization
from vlmprobe.dataset import SAMPLERS
from vlmprobe.errors import ConfigError, require_flags
from vlmprobe.gpu import alloc_conf, device_profile
from vlmprobe.gpu.device_profile import UNBOUNDED
from vlmprobe.knobs import validate_knobs
from vlmprobe.results.answer import OUTPUTS
from vlmprobe.point.build import step_settings
from vlmprobe.point.dataset_steps import plan as plan_dataset
from vlmprobe.sizes import parse_bytes

__all__ = ["DATASET_FAMILIES", "DTYPE_NAMES", "RECORD_HISTORY", "STEPS", "allocator_skip", "check_measure",
           "check_source", "check_step", "check_top_level", "check_train", "kernel_skip", "resolve_backend"]

DTYPE_NAMES = ("float32", "bfloat16", "float16")
RECORD_HISTORY = ("off", "alloc", "all")
STEPS = ("sft", "grpo", "dpo")
# the families whose dataset batches are built (ModelSpec.dataset_batch), by their transformers model class
DATASET_FAMILIES = {"Qwen2VLForConditionalGeneration": "Qwen2-VL", "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL",
                    "Qwen3VLForConditionalGeneration": "Qwen3-VL", "Glm4vForConditionalGeneration": "GLM-4.1V",
                    "InternVLForConditionalGeneration": "InternVL", "LlavaForConditionalGeneration": "LLaVA 1.5"}


def check_top_level(base: dict) -> None:
    """The keys of config.yaml itself (the groups are checked per point)."""
    for key in ("dry_run", "fail_on_oom"):
        if not isinstance(base[key], bool):
            raise ConfigError(f"{key}={base[key]!r} is not allowed: use true or false")
    if base["output"] not in OUTPUTS:
        raise ConfigError(f"output={base['output']!r} is not allowed: use {' or '.join(OUTPUTS)}")
    parse_bytes(base["memory_budget"], "memory_budget")
    name = base["sweep"]["name"]
    if not isinstance(name, str) or not name.strip() or "/" in name or name in (".", ".."):
        raise ConfigError(f"sweep.name={name!r} is not allowed: give a name (it names the results folder)")
    limit = base["sweep"].get("max_points")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ConfigError(f"sweep.max_points={limit!r} is not allowed: it must be a positive integer")
    for key in ("results_dir", "resume"):
        value = base[key]
        if key == "resume" and value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{key}={value!r} is not allowed: give a directory path")
    results = Path(base["results_dir"])
    existing = next(p for p in (results, *results.parents) if p.exists() or p == Path("."))
    if not existing.is_dir():
        raise ConfigError(f"results_dir={base['results_dir']} is not allowed: {existing} is a file, not a directory; "
                          f"give a directory (it is made if missing)")
    if base["resume"] and not Path(base["resume"]).is_dir():
        raise ConfigError(f"resume={base['resume']} is not allowed: it is not a directory; give the results dir "
                          f"of an earlier run (results/<sweep>/<timestamp>)")


@functools.lru_cache(maxsize=None)
def resolve_backend(name: str) -> str:
    """measure.backend as the points run it (auto: cuda where a GPU is usable, else estimate)."""
    return backends.resolve(name)[0]


def check_train(train: dict, backend: str, dist: str) -> None:
    """The knobs, QLoRA's settings and the dtypes."""
    validate_knobs(train, dist)
    quantization.validate(train, backend, dist)
    if train["param_dtype"] not in DTYPE_NAMES:
        raise ConfigError(f"train.param_dtype={train['param_dtype']!r} is not allowed: use one of {', '.join(DTYPE_NAMES)}")
    if train["autocast_dtype"] not in (*DTYPE_NAMES[1:], None):
        raise ConfigError(f"train.autocast_dtype={train['autocast_dtype']!r} is not allowed: use bfloat16, float16 or null")


def check_measure(cfg: dict) -> tuple[device_profile.DeviceProfile | None, alloc_conf.AllocatorSettings]:
    """The measure section and the target card; (the card's profile or None, the allocator settings). Sizes are
    turned into bytes in place (measure.device_memory)."""
    measure = cfg["measure"]
    steps = measure["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise ConfigError(f"measure.steps={steps!r} is not allowed: it must be a positive integer")
    if measure["device_memory"] == UNBOUNDED:  # no capacity: the whole peak of a point that would not fit
        if measure["backend"] not in ("estimate", "cpu"):
            raise ConfigError(f"measure.device_memory=unbounded is not allowed with backend {measure['backend']}: a "
                              f"real card has its capacity; use measure.backend=estimate")
    else:
        measure["device_memory"] = parse_bytes(measure["device_memory"], "measure.device_memory")
    # the target card: a capacity above it, or bfloat16 on a card without it, is refused before any model is built
    profile = device_profile.from_config(cfg["device"])
    device_profile.check(measure["device_memory"], cfg["train"], cfg["dist"], cfg["model"].get("attn_implementation"),
                         profile)
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
    return profile, allocator


def check_step(cfg: dict, data, spec):
    """The step's settings (vlmprobe.point.build.step_settings: None for sft); one ConfigError line for a bad value."""
    name = cfg["step"]["name"]
    if name not in STEPS:
        raise ConfigError(f"step.name={name!r} is not allowed: use one of {', '.join(STEPS)} (step=sft | step=grpo | "
                          f"step=dpo)")
    if data.packing and name != "sft":  # the rollout's and the pairs' batches are built unpacked
        raise ConfigError(f"data.packing=true is not allowed with step={name}: packed batches are modelled for "
                          f"step=sft; use data.packing=false")
    return step_settings(cfg, data, spec)


def check_source(cfg: dict, data, spec) -> None:
    """data.source (vlmprobe.point.dataset_steps): what runs it now (a family of DATASET_FAMILIES, sft; packed
    where the family packs: ModelSpec.validate), the settings it makes unused, the sampler, and the dataset itself (read here: a missing image or
    an empty dataset is one line before anything is built)."""
    if data.source is None:
        return
    supported = (f"{' / '.join(DATASET_FAMILIES.values())} (qwen2_vl_*, qwen2_5_vl_*, qwen3_vl_8b, qwen3_vl_tiny, "
                 f"glm4_1v_9b, glm4v_tiny, internvl3_2b, internvl_tiny, llava_1_5_7b, llava_tiny, hf), step=sft")
    family = getattr(spec, "model_class", None)
    if family not in DATASET_FAMILIES or not callable(getattr(spec, "dataset_batch", None)):
        raise ConfigError(f"model={cfg['model'].get('name', '?')} is not allowed with data.source: a dataset's "
                          f"batches run for {supported} for now")
    if cfg["step"]["name"] != "sft":
        raise ConfigError(f"step={cfg['step']['name']} is not allowed with data.source: a dataset's batches run "
                          f"for step=sft for now ({supported})")
    if data.image_size is not None:
        raise ConfigError(f"data.image_size={data.image_size} is not allowed with data.source: each image keeps its "
                          f"own size from the dataset; use null")
    if data.videos_per_sample:
        raise ConfigError(f"data.videos_per_sample={data.videos_per_sample} is not allowed with data.source: the "
                          f"dataset says each sample's images; use 0")
    if data.sampler not in SAMPLERS:
        raise ConfigError(f"data.sampler={data.sampler!r} is not allowed: use one of {', '.join(SAMPLERS)}")
    samples, _ = plan_dataset(cfg, spec, data)  # read and planned as the point will: a sample that cannot fit refused
    with_videos = next((s for s in samples if s.videos), None)
    if with_videos is not None:
        raise ConfigError(f"data.source={data.source} is not allowed: sample {with_videos.index} holds videos, whose "
                          f"batches are not run yet; give images only")


def kernel_skip(cfg: dict) -> str | None:
    """Why a point's attention kernel cannot run here: flash_attention_2 needs the flash-attn package and a
    CUDA GPU (there is no CPU kernel to estimate it with)."""
    if cfg["model"].get("attn_implementation") != "flash_attention_2":
        return None
    if cfg["measure"]["backend"] == "estimate":
        return None  # vlmprobe.estimate.cuda_rules.flash_attn_standin stands in for the package and its kernels
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
