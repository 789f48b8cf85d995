"""What every parser of a person's training file shares: the answer's shape (Mapped, Ignored, FileRecipe), the
collector that fills it key by key, the plain value readers, and the mappings several frameworks share (the HF
Trainer's `optim` names, LoRA's `all` / `all-linear`, a DeepSpeed config given by path, by dict or by a
framework's shipped name), and the handling their parsers share: a key mapped one to one (Rule: the setting and
the reader of the value, applied by apply_rule; the frameworks' tables name their own keys), the keys that allow
one value only, bitsandbytes' 4 / 8 bits, the LoRA target list and a row's length.

The rule: every key of the file is either mapped to vlmprobe settings (one entry per setting it decides) or
ignored with the reason; a value vlmprobe cannot express is one ConfigError line naming the key, the value and what
is allowed. Plain Python (no torch): the command line reads a file before anything heavy is imported.
Known limits: the HF Trainer's `adafactor` is transformers' Adafactor, mapped to torch's (both factor the second
moment, neither keeps a first one by default); a DeepSpeed JSON that is not on this machine is read only where it is
a framework's shipped one (its memory keys are written here), else refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vlmprobe.errors import ConfigError, whole

__all__ = ["ALL_LINEAR_LM", "apply_rule", "as_bool", "as_count", "as_number", "as_text", "attention", "autocast",
           "checkpoint_kwargs", "checkpointing", "Collector", "deepspeed_entries", "dtype_name", "DTYPES",
           "FileRecipe", "freeze_language_model", "freeze_vision_tower", "GRPO_RULES", "Ignored", "ignore_known",
           "ignore_unknown", "KINDS", "lora_targets", "LORA_RULES", "Mapped", "nf4_only", "only_false", "only_value",
           "optimizer_option", "precision_flag", "quantization_bits", "RECIPE_OF", "row_length", "Rule",
           "split_row", "TRAINER_RULES", "VISION_LINEAR", "zero_settings"]

KINDS = ("llamafactory", "ms_swift", "hf_trainer", "trl_sft", "trl_grpo", "trl_dpo", "accelerate", "deepspeed")
# the conf/recipe option whose defaults stand under a kind's keys: a launcher's or DeepSpeed's file says nothing of
# the trainer, so no framework's defaults stand under it
RECIPE_OF = {kind: kind for kind in KINDS} | {"accelerate": "none", "deepspeed": "none"}

# The language model's linear layers in transformers' LMs (Llama, Qwen2, Mistral, Gemma...): what LLaMA-Factory's
# `lora_target: all` (model_utils/misc.py find_all_linear_modules: every Linear but lm_head, the projector, and the
# vision tower where it is frozen) and ms-swift's / peft's `all-linear` (every Linear but the output layer) find there
ALL_LINEAR_LM = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The vision blocks' linear layers of the families vlmprobe ships (Qwen2-VL: attn.qkv, attn.proj, mlp.fc1/fc2;
# Qwen2.5-VL: mlp.gate/up/down_proj; Qwen3-VL: mlp.linear_fc1/fc2; SigLIP / CLIP: q/k/v_proj, out_proj, fc1/fc2):
# what `all` / `all-linear` adds where the vision tower is trained
VISION_LINEAR = ["qkv", "proj", "fc1", "fc2", "linear_fc1", "linear_fc2", "out_proj"]

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32", "float": "float32"}


@dataclass(frozen=True)
class Mapped:
    """One of their keys and what it became."""
    key: str  # their key as written (e.g. "lora_target", "--per_device_train_batch_size")
    value: object  # their value
    setting: str  # the vlmprobe override key ("train.lora_r", "data.batch_size", "optimizer" (a group), "model")
    becomes: object  # the vlmprobe value (plain python: str/int/float/bool/list/None)


@dataclass(frozen=True)
class Ignored:
    key: str
    value: object
    why: str  # e.g. "no memory effect (logging)", "not modelled: ...", "dataset choice: use data.* for lengths"


@dataclass(frozen=True)
class FileRecipe:
    kind: str  # one of KINDS
    recipe: str  # the conf/recipe option whose defaults stand under their keys ("none" for accelerate/deepspeed)
    mapped: list[Mapped] = field(default_factory=list)
    ignored: list[Ignored] = field(default_factory=list)

    def overrides(self) -> dict[str, object]:
        """setting -> becomes, in file order (the last wins)."""
        out: dict[str, object] = {}
        for entry in self.mapped:
            out.pop(entry.setting, None)  # a later key moves to its place in the order
            out[entry.setting] = entry.becomes
        return out


class Collector:
    """The entries of one file, in its order."""

    def __init__(self, kind: str, where: str):
        self.kind, self.where = kind, where  # `where`: the file, for messages
        self.mapped: list[Mapped] = []
        self.ignored: list[Ignored] = []

    def map(self, key: str, value, setting: str, becomes) -> None:
        self.mapped.append(Mapped(key, value, setting, becomes))

    def ignore(self, key: str, value, why: str) -> None:
        self.ignored.append(Ignored(key, value, why))

    def refuse(self, key: str, value, allowed: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key}={value!r} is not allowed: {allowed}")

    def result(self) -> FileRecipe:
        return FileRecipe(self.kind, RECIPE_OF[self.kind], list(self.mapped), list(self.ignored))


def as_bool(c: Collector, key: str, value) -> bool:
    """true/false as YAML, JSON or a command line writes it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if whole(value) and value in (0, 1):
        return bool(value)
    raise c.refuse(key, value, "use true or false")


def as_count(c: Collector, key: str, value, low: int = 1) -> int:
    """A whole number >= low (a command line's "8" included)."""
    try:
        number = int(value) if isinstance(value, str) and value.strip().lstrip("-").isdigit() else value
    except ValueError:
        number = value
    if not whole(number) or number < low:
        raise c.refuse(key, value, f"it must be an integer >= {low}")
    return number


def as_number(c: Collector, key: str, value) -> float | int:
    """A number (int or float; "1e-4" and "2e8" from a command line or a JSON included)."""
    if isinstance(value, bool):
        raise c.refuse(key, value, "it must be a number")
    if isinstance(value, (int, float)):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise c.refuse(key, value, "it must be a number") from None
    return int(number) if number.is_integer() else number


# transformers 5.25 training_args.py OptimizerNames -> conf/optimizer options (the ones whose memory vlmprobe models)
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_hf": "adamw", "adamw_torch_fused": "adamw_fused",
              "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "adafactor": "adafactor"}


def optimizer_option(c: Collector, key: str, value) -> str:
    name = str(value).strip().lower()
    if name not in OPTIMIZERS:
        raise c.refuse(key, value, f"vlmprobe models the optimizers {', '.join(OPTIMIZERS)} (conf/optimizer/); "
                                   f"pick the nearest with optimizer=OPTION")
    return OPTIMIZERS[name]


# A DeepSpeed config's zero_optimization keys that vlmprobe's dist options carry (conf/dist/zero3.yaml)
ZERO_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients", "overlap_comm",
             "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold")


def zero_settings(c: Collector, key: str, value, zero: dict) -> list[tuple[str, object]]:
    """(setting, value) pairs of a DeepSpeed zero_optimization dict that is not on this machine as a file: the
    stage, offload and the numeric bucket / flag keys ("auto" ones keep DeepSpeed's defaults: HF fills them from the
    hidden size, which vlmprobe's dist options do not)."""
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise c.refuse(key, value, f"zero_optimization.stage={stage!r}: vlmprobe models ZeRO stages 1, 2 and 3 "
                                   f"(dist=zero1|zero2|zero3); stage 0 is DeepSpeed's plain data parallelism: use "
                                   f"dist=ddp")
    pairs: list[tuple[str, object]] = [("dist", f"zero{stage}")]
    for part in ("offload_optimizer", "offload_param"):
        device = (zero.get(part) or {}).get("device", "none") or "none"
        if device not in ("none", "cpu"):
            raise c.refuse(key, value, f"zero_optimization.{part}.device={device!r}: vlmprobe models offloading "
                                       f"to the host (cpu) or none")
        if device == "cpu":
            pairs.append((f"dist.{part}", "cpu"))
    for name in ZERO_KEYS:
        if name in zero and zero[name] != "auto":
            number = zero[name]
            pairs.append((f"dist.{name}", number if isinstance(number, bool) else int(number)))
    return pairs


# Frameworks' shipped DeepSpeed configs by the name a file gives (their zero_optimization blocks, read from):
# ms-swift 4.6.0.dev0 (modelscope/ms-swift@3602360a, swift/config/*.json; `--deepspeed zero2` in sft_args.py
# _init_deepspeed) and LLaMA-Factory (hiyouga/LLaMA-Factory@00052690, examples/deepspeed/*.json)
_SWIFT_12 = {"allgather_bucket_size": 200000000, "overlap_comm": False, "reduce_bucket_size": 200000000,
             "contiguous_gradients": True}
_SWIFT_3 = {"overlap_comm": False, "contiguous_gradients": True, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1000000000}
_CPU = {"device": "cpu"}
SHIPPED_DEEPSPEED = {
    "ms_swift": {"zero0": {"stage": 0}, "zero1": {"stage": 1, **_SWIFT_12}, "zero2": {"stage": 2, **_SWIFT_12},
                 "zero2_offload": {"stage": 2, **_SWIFT_12, "offload_optimizer": _CPU},
                 "zero3": {"stage": 3, **_SWIFT_3},
                 "zero3_offload": {"stage": 3, **_SWIFT_3, "offload_optimizer": _CPU, "offload_param": _CPU}},
    "llamafactory": {"ds_z0_config.json": {"stage": 0},
                     "ds_z2_config.json": {"stage": 2, "allgather_bucket_size": 500000000, "overlap_comm": False,
                                           "reduce_bucket_size": 500000000, "contiguous_gradients": True},
                     "ds_z2_offload_config.json": {"stage": 2, "allgather_bucket_size": 500000000,
                                                   "overlap_comm": False, "reduce_bucket_size": 500000000,
                                                   "contiguous_gradients": True, "offload_optimizer": _CPU},
                     "ds_z3_config.json": {"stage": 3, **_SWIFT_3},
                     "ds_z3_offload_config.json": {"stage": 3, **_SWIFT_3, "offload_optimizer": _CPU,
                                                   "offload_param": _CPU}},
}


def read_deepspeed_json(c: Collector, key: str, value, path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise c.refuse(key, value, f"{path} is not JSON (line {exc.lineno}: {exc.msg}); give a DeepSpeed JSON "
                                   f"config") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise c.refuse(key, value, f"{path} cannot be read ({exc}); give a DeepSpeed JSON config") from None
    if not isinstance(config, dict):
        raise c.refuse(key, value, f"{path} holds no JSON object; give a DeepSpeed JSON config")
    return config


def deepspeed_entries(c: Collector, key: str, value, base: Path | None, framework: str | None = None) -> None:
    """A trainer's `deepspeed` value: a JSON file here (dist=zeroN, dist.deepspeed_config=its path, as vlmprobe
    reads a user's JSON: vlmprobe/distributed/options.py read_deepspeed_config), a dict written inline (its stage,
    offload and bucket keys), or a framework's shipped name (SHIPPED_DEEPSPEED)."""
    if value is None:
        c.ignore(key, value, "not set (null): no DeepSpeed")
        return
    if isinstance(value, dict):
        for setting, becomes in zero_settings(c, key, value, value.get("zero_optimization") or {}):
            c.map(key, value, setting, becomes)
        return
    text = str(value)
    candidates = [Path(text).expanduser()]
    if base is not None and not Path(text).is_absolute():
        candidates.insert(0, base / text)
    found = next((p for p in candidates if p.is_file()), None)
    if found is not None:
        zero = read_deepspeed_json(c, key, value, found).get("zero_optimization") or {}
        stage = zero_settings(c, key, value, {"stage": zero.get("stage", 0)})[0][1]
        c.map(key, value, "dist", stage)
        c.map(key, value, "dist.deepspeed_config", str(found.resolve()))
        return
    shipped = SHIPPED_DEEPSPEED.get(framework or "", {})
    name = text if framework == "ms_swift" else Path(text).name
    if name in shipped:
        for setting, becomes in zero_settings(c, key, value, shipped[name]):
            c.map(key, value, setting, becomes)
        return
    where = f" (looked beside the file, in {base}, and in the working directory)" if base is not None else ""
    names = f"; or one of {framework}'s shipped names: {', '.join(shipped)}" if shipped else ""
    raise c.refuse(key, value, f"no such DeepSpeed JSON file{where}: give its path{names}")


# Keys of the HF TrainingArguments (transformers 5.25 training_args.py) and of the frameworks' own arguments that hold
# no device memory: where the run writes, what it logs, when it evaluates and saves, the learning-rate schedule
NO_MEMORY = {
    "output_dir", "overwrite_output_dir", "logging_dir", "logging_steps", "logging_strategy", "logging_first_step",
    "save_steps", "save_strategy", "save_total_limit", "save_only_model", "save_safetensors", "plot_loss",
    "report_to", "run_name", "push_to_hub", "hub_model_id", "hub_token", "seed", "data_seed", "ddp_timeout",
    "resume_from_checkpoint", "do_train", "do_eval", "do_predict", "eval_strategy", "evaluation_strategy",
    "eval_steps", "per_device_eval_batch_size", "val_size", "split_dataset_ratio", "learning_rate", "lr",
    "num_train_epochs", "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "trust_remote_code",
    "disable_tqdm", "log_level", "log_completions", "num_completions_to_print", "logging_nan_inf_filter",
    "include_num_input_tokens_seen", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "ddp_find_unused_parameters", "remove_unused_columns", "label_names", "model_revision", "use_swanlab",
    "save_on_each_node", "tf32", "deepspeed_multinode_launcher", "add_version", "create_checkpoint_symlink",
    "system", "temperature", "top_p", "top_k", "repetition_penalty", "reward_funcs", "reward_weights",
    "sleep_level", "eval_on_start", "trackio_space_id", "project", "pref_beta", "simpo_gamma", "dpo_label_smoothing",
    "pref_ftx", "loss_type", "scale_rewards", "epsilon", "epsilon_high", "num_iterations", "rpo_alpha",
    "label_smoothing", "compute_accuracy", "disable_shuffling", "ignore_pad_token_for_loss", "use_rslora",
}
# what the data is: vlmprobe's batch is set by data.* (lengths, images, videos), not by a dataset's name
DATASET = {
    "dataset", "dataset_name", "dataset_dir", "eval_dataset", "val_dataset", "template", "max_samples",
    "overwrite_cache", "preprocessing_num_workers", "dataloader_num_workers", "dataset_num_proc",
    "load_from_cache_file", "media_dir", "dataset_text_field", "dataset_kwargs", "streaming", "tokenized_path",
    "mix_strategy", "interleave_probs", "dataset_config", "dataset_train_split", "dataset_test_split",
    "train_on_prompt", "mask_history", "completion_only_loss", "assistant_only_loss", "truncation_mode",
    "video_fps", "video_maxlen", "chat_template_path", "enable_thinking", "shuffle_dataset", "columns",
}


def ignore_known(c: Collector, key: str, name: str, value) -> bool:
    """Ignore a key of NO_MEMORY or DATASET (by its bare `name`) with its reason; False for any other key."""
    if name in NO_MEMORY:
        c.ignore(key, value, "no memory effect (logging, saving, evaluation, schedule or loss coefficients)")
    elif name in DATASET:
        c.ignore(key, value, "dataset choice: use data.* for lengths, images and videos")
    else:
        return False
    return True


def ignore_unknown(c: Collector, key: str, value) -> None:
    c.ignore(key, value, "not a key vlmprobe knows: check it has no memory effect")


def attention(c: Collector, key: str, value) -> str:
    """transformers' attn_implementation names vlmprobe models (conf/model/*.yaml attn_implementation)."""
    names = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash_attention_2",
             "flash_attn": "flash_attention_2", "fa2": "flash_attention_2"}
    name = str(value).strip().lower()
    if name not in names:
        raise c.refuse(key, value, "vlmprobe models the attention kernels sdpa, eager and flash_attention_2")
    return names[name]


def dtype_name(c: Collector, key: str, value) -> str:
    name = str(value).strip().lower().removeprefix("torch.")
    if name not in DTYPES:
        raise c.refuse(key, value, "give the weights' dtype: bfloat16, float16 or float32 (auto takes the "
                                   "checkpoint's, which vlmprobe cannot read here)")
    return DTYPES[name]


def checkpoint_kwargs(c: Collector, key: str, value) -> None:
    """gradient_checkpointing_kwargs / activation_checkpointing_kwargs (a dict, or JSON text): use_reentrant is
    train.grad_ckpt_reentrant; transformers 5.25's every_n_layers (other than 1) and offload are not modelled."""
    kwargs = value
    if isinstance(value, str):
        try:
            kwargs = json.loads(value)
        except json.JSONDecodeError:
            kwargs = None
    if value is None:
        c.ignore(key, value, "not set (null): the library's default")
        return
    if not isinstance(kwargs, dict):
        raise c.refuse(key, value, "give a dict such as {\"use_reentrant\": false}")
    if kwargs.get("every_n_layers", 1) != 1:
        raise c.refuse(key, value, "every_n_layers other than 1 is not modelled: vlmprobe checkpoints every layer")
    if kwargs.get("offload"):
        raise c.refuse(key, value, "offload (saved activations in host memory) is not modelled; drop it")
    if "use_reentrant" in kwargs:
        c.map(key, value, "train.grad_ckpt_reentrant", as_bool(c, f"{key}.use_reentrant", kwargs["use_reentrant"]))
    else:
        c.ignore(key, value, "no use_reentrant: the library's default stands")


def checkpointing(c: Collector, key: str, value, vision: bool = True) -> None:
    """HF's gradient_checkpointing / activation_checkpointing: gradient_checkpointing_enable on the whole model,
    which checkpoints the LM's layers and the vision tower's."""
    on = as_bool(c, key, value)
    c.map(key, value, "train.grad_ckpt.lm", on)
    if vision:
        c.map(key, value, "train.grad_ckpt.vision", on)


def autocast(c: Collector, key: str, value, dtype: str, other) -> None:
    """The Trainer's bf16 / fp16 flag: autocast in that dtype; false (with the other flag not true): none."""
    if as_bool(c, key, value):
        c.map(key, value, "train.autocast_dtype", dtype)
    elif other is not None and as_bool(c, key, other):
        c.ignore(key, value, "false: the other mixed-precision flag decides")
    else:
        c.map(key, value, "train.autocast_dtype", None)


def as_text(c: Collector, key: str, value) -> str:
    """A name as given (a model id, vLLM's mode)."""
    return str(value)


def quantization_bits(c: Collector, key: str, value) -> str:
    """bitsandbytes' bits (LLaMA-Factory's quantization_bit, ms-swift's quant_bits): 4 loads nf4, 8 LLM.int8."""
    if value not in (4, 8, "4", "8"):
        raise c.refuse(key, value, "vlmprobe models bitsandbytes 4 (nf4) and 8 (int8)")
    return "nf4" if int(value) == 4 else "int8"


@dataclass(frozen=True)
class Rule:
    """A key mapped one to one: the setting it decides and the reader that checks and converts its value (it raises
    the ConfigError where the value cannot be read). A framework's table maps its key names to rules."""
    setting: str
    read: Callable[[Collector, str, object], object]


def apply_rule(c: Collector, rule: Rule, key: str, value) -> None:
    c.map(key, value, rule.setting, rule.read(c, key, value))


# HF TrainingArguments keys (transformers 5.25 training_args.py) that LLaMA-Factory, ms-swift and TRL pass on as named
TRAINER_RULES = {"per_device_train_batch_size": Rule("data.batch_size", as_count),
                 "gradient_accumulation_steps": Rule("train.grad_accum_steps", as_count),
                 "optim": Rule("optimizer", optimizer_option)}
# peft's LoRA scale and dropout, named so in all three (the rank is lora_rank or lora_r, with each one's default)
LORA_RULES = {"lora_alpha": Rule("train.lora_alpha", as_number), "lora_dropout": Rule("train.lora_dropout", as_number)}
# GRPO's generation keys: TRL's GRPOConfig names, which ms-swift's rlhf arguments take as they are (conf/step/grpo.yaml)
GRPO_RULES = {"num_generations": Rule("step.num_generations", as_count),
              "max_completion_length": Rule("step.max_completion_length", as_count),
              "beta": Rule("step.beta", as_number), "use_vllm": Rule("step.use_vllm", as_bool),
              "vllm_mode": Rule("step.vllm_mode", as_text)}


def only_value(c: Collector, key: str, value, allowed, refusal: str, note: str) -> None:
    """A key vlmprobe models at one value only: ignored with `note` there, refused with `refusal` elsewhere."""
    if value != allowed:
        raise c.refuse(key, value, refusal)
    c.ignore(key, value, note)


def only_false(c: Collector, key: str, value, refusal: str, note: str = "false: nothing to model") -> None:
    """A flag whose true vlmprobe does not model: false is ignored with `note`, true refused with `refusal`."""
    if as_bool(c, key, value):
        raise c.refuse(key, value, refusal)
    c.ignore(key, value, note)


def nf4_only(c: Collector, key: str, value) -> None:
    """bitsandbytes' 4-bit type: nf4 is what train.quantization=nf4 is; fp4 is not modelled."""
    only_value(c, key, value, "nf4", "vlmprobe models nf4 4-bit quantization only",
               "nf4: what train.quantization=nf4 is")


def lora_targets(c: Collector, key: str, value, names: list[str], every: bool, vision: bool) -> None:
    """train.lora_target_modules: their names as the framework splits them, or where they are its word for every
    linear layer (`every`: LLaMA-Factory's `all`, peft's `all-linear`) the language model's, and the vision tower's
    where adapters go there (`vision`)."""
    c.map(key, value, "train.lora_target_modules",
          ALL_LINEAR_LM + (VISION_LINEAR if vision else []) if every else names)


def freeze_vision_tower(c: Collector, key: str, value, frozen: bool, lora: bool) -> None:
    """A freeze-the-vision-tower flag: train.freeze_vision, and under LoRA the towers given adapters (a frozen
    tower gets none: LLaMA-Factory's patch_target_modules, ms-swift's freeze_vit)."""
    c.map(key, value, "train.freeze_vision", frozen)
    if lora:
        c.map(key, value, "train.lora_towers", ["lm"] if frozen else ["lm", "vision"])


def freeze_language_model(c: Collector, key: str, value, lora: bool, refusal: str) -> None:
    """A freeze-the-language-model flag: train.freeze_lm; true under LoRA (which adapts the LM) is refused."""
    if lora and as_bool(c, key, value):
        raise c.refuse(key, value, refusal)
    c.map(key, value, "train.freeze_lm", as_bool(c, key, value))


def split_row(total: int, prompt: int | None, completion: int | None) -> tuple[int, int]:
    """A DPO row of `total` tokens as (prompt, completion): the given one stands, the other takes the rest."""
    if prompt is not None:
        return prompt, max(total - prompt, 1)
    if completion is not None:
        return max(total - completion, 1), completion
    return total // 2, total - total // 2


def row_length(c: Collector, key: str, value, dpo: bool) -> None:
    """A row's token cap (LLaMA-Factory's cutoff_len, ms-swift's max_length): data.lm_max_length, or under DPO a
    prompt and an answer sharing it, split in half (the data's lengths decide the real split)."""
    length = as_count(c, key, value)
    if dpo:
        prompt, completion = split_row(length, None, None)
        c.map(key, value, "data.lm_max_length", prompt)
        c.map(key, value, "step.completion_length", completion)
    else:
        c.map(key, value, "data.lm_max_length", length)


def precision_flag(c: Collector, key: str, name: str, value, given: dict) -> str:
    """The Trainer's bf16 / fp16 flag `name` as autocast, `given` the file's other keys; the flag's dtype."""
    dtype, other = ("bfloat16", "fp16") if name == "bf16" else ("float16", "bf16")
    autocast(c, key, value, dtype, given.get(other))
    return dtype
