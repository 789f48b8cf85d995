"""A launcher's file: an accelerate config YAML (`accelerate launch --config_file x.yaml`) or a DeepSpeed JSON, as
vlmprobe's dist settings (and the precision they impose).

Read from accelerate 1.16.0 (installed here): utils/dataclasses.py (DeepSpeedPlugin.set_mixed_precision: bf16 /
fp16 enabled in DeepSpeed; FullyShardedDataParallelPlugin.set_mixed_precision: FSDP2's MixedPrecisionPolicy with
param_dtype and reduce_dtype both the mixed-precision dtype) and utils/fsdp_utils.py (fsdp2_prepare_model upcasts
the trainable weights to float32 under mixed precision); the example followed is TRL's
examples/accelerate_configs/fsdp2.yaml (huggingface/trl@f2cd5771). A DeepSpeed JSON goes to vlmprobe as it reads
one (dist.deepspeed_config, vlmprobe/distributed/options.py read_deepspeed_config), with dist=zeroN of its stage.
Known limits: FSDP1 (fsdp_version 1, accelerate's default) and ZeRO stage 0 are refused; accelerate's other FSDP
keys (wrap policy, prefetch, state dict) are not read.
"""

from __future__ import annotations

from pathlib import Path

from vlmprobe.recipes.common import (Collector, FileRecipe, Rule, apply_rule, as_bool, as_count, checkpointing,
                                     deepspeed_entries, ignore_unknown, zero_settings)

__all__ = ["read_accelerate", "read_deepspeed"]

PRECISION = {"bf16": "bfloat16", "fp16": "float16", "no": None}
LAUNCHER_ONLY = {"compute_environment", "debug", "machine_rank", "main_training_function", "rdzv_backend",
                 "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "downcast_bf16",
                 "enable_cpu_affinity", "gpu_ids", "main_process_ip", "main_process_port", "dynamo_config"}
FSDP_IGNORED = {"fsdp_auto_wrap_policy", "fsdp_backward_prefetch", "fsdp_cpu_ram_efficient_loading",
                "fsdp_forward_prefetch", "fsdp_state_dict_type", "fsdp_sync_module_states", "fsdp_use_orig_params",
                "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params"}
# the keys mapped one to one: accelerate's deepspeed_config block, and a DeepSpeed JSON's (where not "auto")
ACCELERATE_DEEPSPEED_RULES = {"zero3_init_flag": Rule("dist.zero_init", as_bool),
                              "gradient_accumulation_steps": Rule("train.grad_accum_steps", as_count)}
DEEPSPEED_RULES = {"train_micro_batch_size_per_gpu": Rule("data.batch_size", as_count),
                   "gradient_accumulation_steps": Rule("train.grad_accum_steps", as_count)}


def section(c: Collector, key: str, value, kind: str, needed: str) -> list[tuple[str, str, object]]:
    """A nested block (fsdp_config, deepspeed_config) as (its key written `block.name`, name, value); none, the
    block ignored, where distributed_type is not the one that reads it."""
    if kind != needed:
        c.ignore(key, value, f"read only with distributed_type {needed} (this file: {kind})")
        return []
    return [(f"{key}.{name}", name, setting) for name, setting in value.items()]


def read_accelerate(config: dict, where: str, base: Path | None) -> FileRecipe:
    c = Collector("accelerate", where)
    # an unquoted NO is YAML 1.1's false (PyYAML reads it so): accelerate's own writer quotes nothing, so it means "NO"
    kind = "NO" if config.get("distributed_type") is False else str(config.get("distributed_type", "NO")).upper()
    fsdp = config.get("fsdp_config") if isinstance(config.get("fsdp_config"), dict) else {}
    ds = config.get("deepspeed_config") if isinstance(config.get("deepspeed_config"), dict) else {}
    for key, value in config.items():
        if key == "distributed_type":
            if kind == "NO":
                c.map(key, value, "dist", "none")
            elif kind == "MULTI_GPU":
                c.map(key, value, "dist", "ddp")
            elif kind == "FSDP":
                version = fsdp.get("fsdp_version", 1)
                if str(version) != "2":
                    raise c.refuse("fsdp_config.fsdp_version", version, "vlmprobe models FSDP2 (fully_shard): "
                                   "set fsdp_version: 2 (accelerate's default is 1)")
                c.map(key, value, "dist", "fsdp2")
            elif kind == "DEEPSPEED":
                if "deepspeed_config_file" not in ds:
                    stage = as_count(c, "deepspeed_config.zero_stage", ds.get("zero_stage", 2), low=0)
                    c.map(key, value, "dist", zero_settings(c, key, value, {"stage": stage})[0][1])
            else:
                raise c.refuse(key, value, "vlmprobe models NO, MULTI_GPU, FSDP and DEEPSPEED")
        elif key == "num_processes":
            if kind == "NO":
                c.ignore(key, value, "distributed_type NO: one process")
            else:
                c.map(key, value, "dist.world_size", as_count(c, key, value))
        elif key == "num_machines":
            machines, world = as_count(c, key, value), as_count(c, "num_processes", config.get("num_processes", 1))
            if kind == "NO" or machines == 1:
                c.ignore(key, value, "one machine: dist.ranks_per_node stays as configured")
            elif world % machines:
                raise c.refuse(key, value, f"num_processes={world} is not a multiple of it")
            else:
                c.map(key, value, "dist.ranks_per_node", world // machines)
        elif key == "mixed_precision":
            name = str(value).lower()
            if name not in PRECISION:
                raise c.refuse(key, value, "vlmprobe models bf16, fp16 and no")
            dtype = PRECISION[name]
            if kind == "DEEPSPEED":  # DeepSpeed's bf16 / fp16: the weights in that dtype, fp32 masters in its optimizer
                c.map(key, value, "train.param_dtype", dtype or "float32")
            else:
                c.map(key, value, "train.autocast_dtype", dtype)
                if kind == "FSDP" and dtype:  # MixedPrecisionPolicy(param_dtype, reduce_dtype); fp32 masters
                    c.map(key, value, "train.param_dtype", "float32")
                    c.map(key, value, "dist.mp_param_dtype", dtype)
                    c.map(key, value, "dist.mp_reduce_dtype", dtype)
        elif key == "fsdp_config":
            for sub, name, setting in section(c, key, value, kind, "FSDP"):
                if name == "fsdp_version":
                    c.ignore(sub, setting, "read with distributed_type (2: FSDP2)")
                elif name == "fsdp_offload_params":
                    c.map(sub, setting, "dist.offload_param", "cpu" if as_bool(c, sub, setting) else "none")
                elif name == "fsdp_reshard_after_forward":
                    flag = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}.get(str(setting).upper(), setting)
                    c.map(sub, setting, "dist.reshard_after_forward", as_bool(c, sub, flag))
                elif name == "fsdp_activation_checkpointing":
                    checkpointing(c, sub, setting)
                elif name in FSDP_IGNORED:
                    c.ignore(sub, setting, "not modelled: vlmprobe wraps each transformer block, then the root")
                else:
                    ignore_unknown(c, sub, setting)
        elif key == "deepspeed_config":
            for sub, name, setting in section(c, key, value, kind, "DEEPSPEED"):
                if name in ACCELERATE_DEEPSPEED_RULES:
                    apply_rule(c, ACCELERATE_DEEPSPEED_RULES[name], sub, setting)
                elif name == "deepspeed_config_file":
                    deepspeed_entries(c, sub, setting, base)
                elif name == "zero_stage":
                    c.ignore(sub, setting, "read with distributed_type (dist=zeroN)")
                elif name in ("offload_optimizer_device", "offload_param_device"):
                    device = str(setting).lower()
                    if device not in ("none", "cpu"):
                        raise c.refuse(sub, setting, "vlmprobe models offloading to the host (cpu) or none")
                    c.map(sub, setting, f"dist.{name.removesuffix('_device')}", device)
                else:
                    c.ignore(sub, setting, "no memory effect (saving, launching or clipping)")
        elif key in LAUNCHER_ONLY:
            c.ignore(key, value, "no memory effect (the launcher's machine and process settings)")
        else:
            ignore_unknown(c, key, value)
    return c.result()


def read_deepspeed(config: dict, where: str, path: Path) -> FileRecipe:
    """The file itself is the DeepSpeed config: dist=zeroN and dist.deepspeed_config=its path; batch sizes,
    accumulation and precision given as numbers (not "auto", which the trainer fills in) are read too."""
    c = Collector("deepspeed", where)
    deepspeed_entries(c, "(file)", str(path), None)
    for key, value in config.items():
        if key in DEEPSPEED_RULES and value != "auto":
            apply_rule(c, DEEPSPEED_RULES[key], key, value)
        elif key in ("bf16", "fp16") and isinstance(value, dict) and value.get("enabled") not in ("auto", None):
            if as_bool(c, f"{key}.enabled", value["enabled"]):
                c.map(key, value, "train.param_dtype", "bfloat16" if key == "bf16" else "float16")
            else:
                c.ignore(key, value, "disabled")
        elif value == "auto" or (isinstance(value, dict) and value.get("enabled") == "auto"):
            c.ignore(key, value, "auto: the trainer fills it in from the run")
        elif key == "zero_optimization":
            c.ignore(key, value, "read by DeepSpeed from dist.deepspeed_config (its stage: dist)")
        else:
            c.ignore(key, value, "read by DeepSpeed from dist.deepspeed_config as given")
    return c.result()
