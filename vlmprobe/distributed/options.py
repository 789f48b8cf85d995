"""Validate a point's `dist` config before any heavy work: one ConfigError line per bad value; and how a point's
ranks run (`ranks_mode`, dist.ranks).

dist.ranks: the estimate always simulates one rank per group of identical ranks on a fake process group. On cpu
and cuda, `launch` runs the N ranks as a torchrun job (one GPU each on cuda), `simulate` runs the ranks the
estimate would pick, one after another, on this one device with a fake group (real kernels, allocator and engine;
collectives move no data), and `auto` launches on cpu (as before the option) and on cuda where the job has a GPU
per rank, and simulates where it has not. Known limit of `simulate`: a rank's row has no communication library's
buffers (NCCL's) and no communication time.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from omegaconf import OmegaConf

from vlmprobe.errors import ConfigError
from vlmprobe.paths import CONF

__all__ = ["DEEPSPEED_ENGINES", "RANK_MODES", "deepspeed_notice", "ranks_mode", "read_deepspeed_config",
           "skip_reason", "unchecked_keys", "validate"]

TORCH_ENGINES = ("none", "ddp", "fsdp2")
DEEPSPEED_ENGINES = ("zero1", "zero2", "zero3")
OFFLOAD_DEVICES = ("none", "cpu")
MP_DTYPES = (None, "float32", "bfloat16", "float16")
RANK_MODES = ("auto", "launch", "simulate")  # dist.ranks (module docstring)
# Top-level keys of a user's DeepSpeed JSON whose memory a run here follows (DeepSpeed reads them on the fake
# process groups as on GPUs: batch sizes, ZeRO, precision, the optimizer; the scheduler holds no device memory),
# or that hold none (logging, monitoring, progress). Any other key still reaches DeepSpeed, but what it does to
# memory is not checked here: deepspeed_notice lists it.
CHECKED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "zero_optimization", "bf16", "fp16", "optimizer", "scheduler",
                "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
                "prescale_gradients", "gradient_predivide_factor"}
NO_MEMORY_KEYS = {"steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "comms_config",
                  "comms_logger", "monitor_config", "tensorboard", "wandb", "csv_monitor", "flops_profiler",
                  "checkpoint"}


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def validate(dist: dict, backend: str, find, visible_gpus) -> None:
    """`visible_gpus()` is asked only for backend cuda (it counts devices)."""
    check_engine_name(dist)
    name, world = dist["name"], dist["world_size"]
    if not _positive_int(world):
        raise ConfigError(f"dist.world_size={world!r} is not allowed: it must be an integer >= 1")
    if name == "none" and world != 1:
        raise ConfigError(f"dist.world_size={world} is not allowed with dist=none: use dist=ddp, fsdp2, zero1, "
                          f"zero2 or zero3 for more than one rank")
    per_node = dist["ranks_per_node"]
    if not _positive_int(per_node):
        raise ConfigError(f"dist.ranks_per_node={per_node!r} is not allowed: it must be an integer >= 1")
    if world > per_node and world % per_node:
        raise ConfigError(f"dist.world_size={world} is not allowed with dist.ranks_per_node={per_node}: it must be "
                          f"a multiple of ranks_per_node (whole nodes) or at most one node")
    if name == "none":
        return
    mode = dist.get("ranks", "auto")
    if mode not in RANK_MODES:
        raise ConfigError(f"dist.ranks={mode!r} is not allowed: use auto, launch (N processes) or simulate (each "
                          f"distinct rank on one device)")
    if mode == "launch" and backend == "estimate":
        raise ConfigError("dist.ranks=launch is not allowed with backend estimate: the estimate simulates the ranks; "
                          "use auto or simulate, or backend cpu or cuda to launch them")
    if find:
        raise ConfigError(f"dist={name} is not allowed with +find=max_batch: the max-batch search runs one GPU "
                          f"(dist=none) only")
    for key in ("offload_optimizer", "offload_param"):
        if dist[key] not in OFFLOAD_DEVICES:
            raise ConfigError(f"dist.{key}={dist[key]!r} is not allowed: use one of {', '.join(OFFLOAD_DEVICES)}")
    if name == "ddp" and (dist["offload_optimizer"] != "none" or dist["offload_param"] != "none"):
        raise ConfigError("dist.offload_* is not allowed with dist=ddp: DDP keeps everything on the GPU; use "
                          "fsdp2 (offload_param=cpu) or zero1-3 for offload")
    if name == "ddp":
        cap = dist["bucket_cap_mb"]
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
            raise ConfigError(f"dist.bucket_cap_mb={cap!r} is not allowed: it must be a number of MiB > 0")
        if not isinstance(dist["gradient_as_bucket_view"], bool):
            raise ConfigError(f"dist.gradient_as_bucket_view={dist['gradient_as_bucket_view']!r} is not allowed: "
                              f"use true or false")
    if name == "fsdp2":
        if dist["offload_optimizer"] != "none":
            raise ConfigError(f"dist.offload_optimizer={dist['offload_optimizer']} is not allowed with dist=fsdp2: "
                              f"FSDP2 offloads params, grads and optimizer state together (dist.offload_param=cpu)")
        for key in ("mp_param_dtype", "mp_reduce_dtype"):
            if dist[key] not in MP_DTYPES:
                raise ConfigError(f"dist.{key}={dist[key]!r} is not allowed: use null, float32, bfloat16 or float16")
        if dist["reshard_after_forward"] not in (None, True, False):
            raise ConfigError(f"dist.reshard_after_forward={dist['reshard_after_forward']!r} is not allowed: use "
                              f"null (FSDP2's default), true or false")
    if name in DEEPSPEED_ENGINES:
        if dist["offload_param"] != "none" and dist["stage"] != 3:
            raise ConfigError(f"dist.offload_param={dist['offload_param']} is not allowed with dist={name}: "
                              f"DeepSpeed offloads parameters at ZeRO stage 3 only")
        if not isinstance(dist.get("zero_init", True), bool):
            raise ConfigError(f"dist.zero_init={dist['zero_init']!r} is not allowed: use true (build under "
                              f"deepspeed.zero.Init, as HF does at ZeRO-3) or false")
        if dist["deepspeed_config"] is not None:
            read_deepspeed_config(dist["deepspeed_config"])
    if backend == "cuda" and mode == "launch" and world > (gpus := visible_gpus()):
        raise ConfigError(f"dist.world_size={world} is not allowed with backend cuda and dist.ranks=launch: it needs "
                          f"{world} GPUs and {gpus} are visible here (use dist.ranks=simulate to measure its ranks "
                          f"one at a time on one GPU, or backend estimate)")


def ranks_mode(dist: dict, backend: str, visible_gpus) -> str:
    """How a validated distributed point's ranks run: "simulate" or "launch" (dist.ranks, auto decided: module
    docstring). `visible_gpus()` is asked only for auto on cuda."""
    mode = dist.get("ranks", "auto")
    if backend == "estimate":
        return "simulate"
    if mode != "auto":
        return mode
    return "simulate" if backend == "cuda" and dist["world_size"] > visible_gpus() else "launch"


def check_engine_name(dist: dict) -> None:
    """dist.name is set by choosing a `dist` option, whose file also gives the engine's keys: a name set on its
    own names an engine without them."""
    name, engines = dist.get("name"), (*TORCH_ENGINES, *DEEPSPEED_ENGINES)
    if name not in engines:
        raise ConfigError(f"dist.name={name!r} is not allowed: choose the engine with dist=OPTION, one of "
                          f"{', '.join(engines)}")
    missing = set(OmegaConf.load(CONF / "dist" / f"{name}.yaml")) - set(dist)
    if missing:
        raise ConfigError(f"dist.name={name} is not allowed: the other dist keys are another engine's (no "
                          f"{', '.join(sorted(missing))}); choose the engine with dist={name}")


def read_deepspeed_config(path) -> dict:
    """A user's DeepSpeed JSON, checked: the file exists, is JSON, and names a ZeRO stage within 0-3."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"dist.deepspeed_config={path} is not allowed: no such file")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"dist.deepspeed_config={path} is not allowed: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"dist.deepspeed_config={path} is not allowed: it must hold a JSON object")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"dist.deepspeed_config={path} is not allowed: zero_optimization.stage={stage!r}, "
                          f"DeepSpeed's ZeRO stages are 0-3")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in ("none", "cpu", None):
            raise ConfigError(f"dist.deepspeed_config={path} is not allowed: zero_optimization.{key}.device="
                              f"{device!r}: vlmprobe models offloading to the host (cpu) or none, not {device} "
                              f"(ZeRO-Infinity's NVMe swapping needs DeepSpeed's async I/O op and a disk); use cpu")
    return config


def unchecked_keys(config: dict) -> list[str]:
    """Top-level keys of a user's DeepSpeed JSON that reach DeepSpeed but whose memory vlmprobe has not checked."""
    return sorted(set(config) - CHECKED_KEYS - NO_MEMORY_KEYS)


def deepspeed_notice(path) -> str | None:
    """One line for the terminal naming the keys of the JSON at `path` that unchecked_keys lists; None if none."""
    keys = unchecked_keys(read_deepspeed_config(path))
    if not keys:
        return None
    named = f"{', '.join(keys)} reach DeepSpeed as given, but what they do" if len(keys) > 1 else \
        f"{keys[0]} reaches DeepSpeed as given, but what it does"
    return f"vlmprobe: dist.deepspeed_config={path}: {named} to memory is not checked (the rows may not show it)"


def skip_reason(dist: dict, backend: str) -> str | None:
    """Why a point's engine cannot run on `backend` here; its row is `skipped` with this reason."""
    name = dist["name"]
    if name.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        return f"dist={name} needs DeepSpeed, not installed here: pip install -e \".[deepspeed]\""
    return None
