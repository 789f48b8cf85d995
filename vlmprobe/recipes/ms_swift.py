"""An ms-swift run as vlmprobe settings: its command line (`swift sft ...` / `swift rlhf --rlhf_type grpo ...`, as
text: a .sh file with backslash continuations and environment assignments before the command, split as a shell
would, never run) or its saved arguments (args.json in the output dir: the same names without dashes).

Read from ms-swift 4.6.0.dev0 (modelscope/ms-swift@3602360a): swift/arguments/{tuner_args,sft_args,rlhf_args}.py,
base_args/{base_args,model_args,quant_args,template_args}.py, swift/trainers/{arguments,mixin}.py, swift/config/*.json;
the example followed is examples/train/multimodal/ocr.sh (Qwen2.5-VL-7B LoRA).
The rules: tuner_type (ms-swift 3: train_type) lora (default; rank 8) or full; freeze_vit (default true) keeps LoRA
out of the vision tower and freezes it in a full run; `all-linear` is every Linear of the unfrozen parts but the
output layer; torch_dtype is the weights' dtype and sets bf16 / fp16 autocast with it; gradient checkpointing is on by
default, reentrant except under plain DDP (mixin.py _fix_gradient_checkpointing); `--deepspeed zero2` names ms-swift's
shipped JSON, whose memory keys are written here; NPROC_PER_NODE (x NNODES) is the number of ranks, DDP where
neither DeepSpeed nor FSDP is named; MAX_PIXELS and its kin are the Qwen-VL processors' pixel bounds.
Known limits: IMAGE_MAX_TOKEN_NUM (tokens, not pixels: the pixel cap depends on the model's patch) and
freeze_aligner are not modelled; a DPO row's max_length is split in half between prompt and answer; rlhf types
other than grpo and dpo are refused.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from vlmprobe.recipes.common import (GRPO_RULES, LORA_RULES, TRAINER_RULES, Collector, FileRecipe, Rule, apply_rule,
                                     as_bool, as_count, as_text, attention, checkpoint_kwargs, deepspeed_entries,
                                     dtype_name, freeze_language_model, freeze_vision_tower, ignore_known,
                                     ignore_unknown, lora_targets, nf4_only, only_value, precision_flag,
                                     quantization_bits, row_length)

__all__ = ["parse_command", "read_swift_args", "read_swift_command"]

# the Qwen-VL processors' pixel bounds, read from the environment
ENV_RULES = {"MAX_PIXELS": Rule("data.max_pixels", as_count), "MIN_PIXELS": Rule("data.min_pixels", as_count),
             "VIDEO_MAX_PIXELS": Rule("data.video_max_pixels", as_count),
             "VIDEO_MIN_PIXELS": Rule("data.video_min_pixels", as_count),
             "VIDEO_TOTAL_PIXELS": Rule("data.video_total_pixels", as_count)}
# the arguments mapped one to one (tuner_args.py, base_args/{model_args,quant_args}.py, swift/trainers/arguments.py;
# the HF Trainer's as it names them); GRPO's keys join them in a grpo run
RULES = {"model": Rule("model", as_text), "lora_rank": Rule("train.lora_r", as_count), **LORA_RULES,
         "max_pixels": Rule("data.max_pixels", as_count),
         "vit_gradient_checkpointing": Rule("train.grad_ckpt.vision", as_bool),
         "attn_impl": Rule("model.attn_implementation", attention),
         "quant_bits": Rule("train.quantization", quantization_bits),
         "bnb_4bit_use_double_quant": Rule("train.quantization_double_quant", as_bool),
         "bnb_4bit_compute_dtype": Rule("train.quantization_compute_dtype", dtype_name),
         "packing": Rule("data.packing", as_bool), "padding_free": Rule("data.packing", as_bool),
         "use_liger_kernel": Rule("train.liger_kernel", as_bool),
         "global_world_size": Rule("dist.world_size", as_count),
         "local_world_size": Rule("dist.ranks_per_node", as_count),
         **TRAINER_RULES}
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules")
SHELL_ENDS = {";", "&&", "||", "|", "&", ">", ">>", "2>&1"}
RLHF = {"grpo", "dpo"}


def parse_command(text: str, where: str) -> tuple[dict[str, str], str, list[tuple[str, object]]]:
    """(environment assignments before `swift`, the subcommand, [(--key, value)] in order). A flag's values run to
    the next flag: none is true, one is itself, several a list (--target_modules q_proj v_proj)."""
    c = Collector("ms_swift", where)
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise c.refuse("command", text.strip().splitlines()[0] if text.strip() else text,
                       f"it does not split as a shell command ({exc})") from None
    if "swift" not in tokens:
        raise c.refuse("command", " ".join(tokens[:6]), "no `swift sft` or `swift rlhf` command in it")
    at = tokens.index("swift")
    env = {}
    for token in tokens[:at]:
        name, sep, value = token.partition("=")
        if sep and name.isidentifier():
            env[name] = value
    if at + 1 >= len(tokens) or tokens[at + 1] not in ("sft", "pt", "rlhf"):
        raise c.refuse("swift", " ".join(tokens[at:at + 2]), "vlmprobe reads `swift sft`, `swift pt` and "
                                                              "`swift rlhf` commands")
    args: list[tuple[str, object]] = []
    for token in tokens[at + 2:]:
        if token in SHELL_ENDS:
            break
        if token.startswith("--"):
            args.append((token, []))
        elif args:
            args[-1][1].append(token)
    flat = [(key, True if not values else values[0] if len(values) == 1 else values) for key, values in args]
    return env, tokens[at + 1], flat


def read_swift_command(text: str, where: str, base: Path | None) -> FileRecipe:
    env, sub, args = parse_command(text, where)
    return read_swift(env, sub, args, where, base)


def read_swift_args(config: dict, where: str, base: Path | None) -> FileRecipe:
    """args.json: the arguments' dataclass as saved (BaseArguments.save_args); rlhf_type says an rlhf run."""
    sub = "rlhf" if config.get("rlhf_type") else "sft"
    return read_swift({}, sub, list(config.items()), where, base)


def read_swift(env: dict, sub: str, args: list[tuple[str, object]], where: str, base: Path | None) -> FileRecipe:
    c = Collector("ms_swift", where)
    given = {key.removeprefix("--"): value for key, value in args}
    method = str(given.get("tuner_type", given.get("train_type", "lora")))
    if method not in ("lora", "qlora", "full"):
        raise c.refuse("--tuner_type", method, "vlmprobe models lora (qlora: lora with --quant_bits) and full")
    lora = method != "full"
    freeze_vit = as_bool(c, "--freeze_vit", given.get("freeze_vit", True))
    rlhf = str(given.get("rlhf_type", "dpo")) if sub == "rlhf" else None
    if rlhf is not None and rlhf not in RLHF:
        raise c.refuse("--rlhf_type", rlhf, "vlmprobe models grpo and dpo (conf/step/)")
    processes = as_count(c, "NPROC_PER_NODE", env.get("NPROC_PER_NODE", 1))
    nodes = as_count(c, "NNODES", env.get("NNODES", 1))
    engine = given.get("deepspeed") or given.get("fsdp")

    for name, value in env.items():
        if name in ENV_RULES:
            apply_rule(c, ENV_RULES[name], name, value)
        elif name == "NPROC_PER_NODE":
            if processes * nodes > 1:
                if not engine:
                    c.map(name, value, "dist", "ddp")
                    if "gradient_checkpointing_kwargs" not in given:  # mixin.py: non-reentrant under plain DDP
                        c.map(name, value, "train.grad_ckpt_reentrant", False)
                c.map(name, value, "dist.world_size", processes * nodes)
            else:
                c.ignore(name, value, "one process")
        elif name == "NNODES":
            if nodes > 1:
                c.map(name, value, "dist.ranks_per_node", processes)
            else:
                c.ignore(name, value, "one node")
        elif name == "CUDA_VISIBLE_DEVICES":
            c.ignore(name, value, "which GPUs: the ranks come from NPROC_PER_NODE")
        elif name == "IMAGE_MAX_TOKEN_NUM":
            c.ignore(name, value, "not modelled: a cap in tokens; set data.max_pixels to it x (patch x merge)^2 "
                                  "(28^2 for Qwen2/2.5-VL, 32^2 for Qwen3-VL)")
        else:
            c.ignore(name, value, "an environment variable vlmprobe does not read: check it has no memory effect")

    if sub == "rlhf":
        key = next((k for k, _ in args if k.removeprefix("--") == "rlhf_type"), "swift rlhf")
        c.map(key, rlhf, "step", rlhf)
    rules = RULES | (GRPO_RULES if rlhf == "grpo" else {})
    for key, value in args:
        name = key.removeprefix("--")
        if name == "rlhf_type":
            continue  # recorded above
        if value is None and name not in ("deepspeed",):
            c.ignore(key, value, "not set (null): ms-swift's default")
        elif name in LORA_KEYS and not lora:
            c.ignore(key, value, f"read only with --tuner_type lora (this run: {method})")
        elif name in rules:
            apply_rule(c, rules[name], key, value)
        elif name in ("tuner_type", "train_type"):
            c.map(key, value, "train.lora_r", as_count(c, "--lora_rank", given.get("lora_rank", 8)) if lora else 0)
        elif name == "target_modules":  # all-linear: the unfrozen parts' linear layers (freeze_vit decides the ViT's)
            names = value if isinstance(value, list) else [value]
            lora_targets(c, key, value, [str(n) for n in names], every=names == ["all-linear"],
                         vision=not freeze_vit)
        elif name == "freeze_vit":
            freeze_vision_tower(c, key, value, freeze_vit, lora)
        elif name == "freeze_llm":
            freeze_language_model(c, key, value, lora, "with LoRA vlmprobe adapts the language model; use false")
        elif name == "freeze_aligner":
            c.ignore(key, value, "not modelled: vlmprobe freezes the projector with the vision tower where the "
                                 "family holds it there (Qwen-VL's merger) and trains it elsewhere")
        elif name == "torch_dtype":
            dtype = dtype_name(c, key, value)
            c.map(key, value, "train.param_dtype", dtype)
            if "bf16" not in given and "fp16" not in given:  # sft_args.py: bf16 / fp16 follow torch_dtype
                c.map(key, value, "train.autocast_dtype", dtype if dtype != "float32" else None)
        elif name in ("bf16", "fp16"):
            precision_flag(c, key, name, value, given)
        elif name == "max_length":  # sft: the row; grpo: the prompt (the template truncates it to max_length)
            row_length(c, key, value, rlhf == "dpo")
        elif name == "deepspeed":
            deepspeed_entries(c, key, value, base, "ms_swift")
        elif name == "fsdp":
            if value in ("fsdp2", ["fsdp2"]):
                c.map(key, value, "dist", "fsdp2")
            elif not value:
                c.ignore(key, value, "empty: no FSDP")
            else:
                raise c.refuse(key, value, "vlmprobe reads ms-swift's shipped fsdp2 preset")
        elif name == "gradient_checkpointing":
            on = as_bool(c, key, value)
            c.map(key, value, "train.grad_ckpt.lm", on)
            if given.get("vit_gradient_checkpointing") is None:  # arguments.py: the ViT follows unless told
                c.map(key, value, "train.grad_ckpt.vision", on)
        elif name == "gradient_checkpointing_kwargs":
            checkpoint_kwargs(c, key, value)
        elif name == "quant_method":
            only_value(c, key, value, "bnb", "vlmprobe models bitsandbytes (bnb) only", "bnb: --quant_bits decides")
        elif name == "bnb_4bit_quant_type":
            nf4_only(c, key, value)
        elif name in ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_len"):
            c.ignore(key, value, "vLLM's own memory: not modelled on this GPU (step.use_vllm)")
        elif not ignore_known(c, key, name, value):
            ignore_unknown(c, key, value)
    return c.result()
