"""A person's own training file (`recipe.file=PATH`) as the vlmprobe settings it means: a LLaMA-Factory YAML, an
ms-swift command line (.sh) or its args.json, a TRL / HF Trainer config (YAML or JSON), an accelerate config YAML
or a DeepSpeed JSON. Each key of the file is mapped (Mapped: the setting and value it becomes) or ignored with the
reason (Ignored); `mapping_lines` is what the command line prints, and FileRecipe.overrides() what it applies over
the framework's defaults (conf/recipe/<FileRecipe.recipe>.yaml).

The rule: files are read as data only (YAML's safe loader, JSON, a shell line split by shlex), never run; a pickle
(the HF Trainer's training_args.bin) is refused, saying how to give it instead. Bad input is one ConfigError line
naming the file, the key, the value and what is allowed, before anything heavy: a file that does not exist, one
whose kind cannot be told, YAML or JSON that does not parse (with its line), a value vlmprobe cannot express.
Plain Python, no torch or transformers: the command line reads the file at its start. Each framework's module
cites the source (repository, commit, file) its rules were read from, and says what it does not model.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from vlmprobe.errors import ConfigError
from vlmprobe.recipes.common import KINDS, FileRecipe, Ignored, Mapped
from vlmprobe.recipes.launchers import read_accelerate, read_deepspeed
from vlmprobe.recipes.llamafactory import read_llamafactory
from vlmprobe.recipes.ms_swift import read_swift_args, read_swift_command
from vlmprobe.recipes.trainer import DPO_FIELDS, GRPO_FIELDS, MODEL_FIELDS, SFT_FIELDS, read_trainer

__all__ = ["detect_kind", "FileRecipe", "Ignored", "KINDS", "Mapped", "mapping_lines", "read_recipe_file"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle")
# keys only one framework's files have (read from each one's argument classes: see its module)
LLAMAFACTORY_KEYS = {"finetuning_type", "cutoff_len", "lora_target", "freeze_vision_tower", "image_max_pixels",
                     "pref_beta", "pref_loss", "quantization_bit", "flash_attn", "stage", "template",
                     "disable_gradient_checkpointing", "enable_liger_kernel", "freeze_multi_modal_projector"}
SWIFT_KEYS = {"tuner_type", "train_type", "freeze_vit", "freeze_aligner", "freeze_llm", "attn_impl", "tuner_backend",
              "quant_bits", "rlhf_type", "target_modules", "vit_gradient_checkpointing"}
ACCELERATE_KEYS = {"distributed_type", "compute_environment", "num_processes", "mixed_precision"}
DEEPSPEED_KEYS = {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"}
TRAINER_KEYS = {"per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "optim", "bf16",
                "learning_rate", "gradient_checkpointing", "num_train_epochs"}


def refuse(path, what: str) -> ConfigError:
    return ConfigError(f"recipe.file={path} is not allowed: {what}")


def detect_kind(config: dict) -> str | None:
    """The kind of a parsed YAML / JSON file by the keys only its framework writes; None where none fits."""
    keys = set(config)
    if keys & ACCELERATE_KEYS and "distributed_type" in keys:
        return "accelerate"
    if keys & DEEPSPEED_KEYS and not keys & {"per_device_train_batch_size", "output_dir", "optim", "model",
                                              "model_name_or_path"}:
        return "deepspeed"
    if keys & SWIFT_KEYS:
        return "ms_swift"
    if keys & LLAMAFACTORY_KEYS:
        return "llamafactory"
    if keys & GRPO_FIELDS:
        return "trl_grpo"
    if keys & DPO_FIELDS:
        return "trl_dpo"
    if keys & (SFT_FIELDS | MODEL_FIELDS):
        return "trl_sft"
    if keys & TRAINER_KEYS:
        return "hf_trainer"
    return None


def parse_data(path: Path, text: str) -> dict:
    """A YAML or JSON file's mapping (JSON is YAML, but JSON's own parser names its errors better)."""
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise refuse(path, f"it is not JSON: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f"line {mark.line + 1}: " if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise refuse(path, f"it is not YAML: {line}{problem}") from None
    if not isinstance(data, dict):
        raise refuse(path, f"it holds a {type(data).__name__}, not a mapping of keys to values")
    return data


def read_recipe_file(path: str | Path, kind: str | None = None) -> FileRecipe:
    """The settings a person's training file means. kind None: told from the file (its name and its keys)."""
    file = Path(path).expanduser()
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"recipe.kind={kind!r} is not allowed: use one of {', '.join(KINDS)} (or none: detect)")
    if not file.is_file():
        raise refuse(path, "no such file (give a LLaMA-Factory or TRL YAML, an ms-swift .sh or args.json, an "
                           "accelerate YAML or a DeepSpeed JSON)")
    raw = file.read_bytes()
    if file.suffix.lower() in PICKLE_SUFFIXES or raw[:1] == b"\x80":
        raise refuse(path, "it is a pickle (the HF Trainer's training_args.bin is torch.save of TrainingArguments), "
                           "which vlmprobe never loads: loading a pickle runs code. Give the run's YAML or JSON "
                           "config instead, or write one where you trust the file: python -c \"import torch; "
                           "print(torch.load('training_args.bin', weights_only=False).to_json_string())\" > "
                           "training_args.json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise refuse(path, "it is not text (give a YAML, JSON or .sh file)") from None
    where, base = f"recipe.file={path}", file.resolve().parent
    if kind == "ms_swift" or (kind is None and file.suffix.lower() not in (".json", ".yaml", ".yml")):
        if file.suffix.lower() != ".json":
            if kind is None and "swift" not in text.split():
                raise refuse(path, f"its kind cannot be told: not YAML or JSON by its name and no `swift` "
                                   f"command in it (vlmprobe reads {', '.join(KINDS)})")
            return read_swift_command(text, where, base)
    config = parse_data(file, text)
    found = kind or detect_kind(config)
    if found is None:
        raise refuse(path, f"its kind cannot be told from its keys ({', '.join(list(config)[:5])}...): give "
                           f"recipe.kind, one of {', '.join(KINDS)}")
    if found == "llamafactory":
        return read_llamafactory(config, where, base)
    if found == "ms_swift":
        return read_swift_args(config, where, base)
    if found == "accelerate":
        return read_accelerate(config, where, base)
    if found == "deepspeed":
        return read_deepspeed(config, where, file.resolve())
    return read_trainer(config, found, where, base)


def shown(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else \
        ("[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value))


def mapping_lines(recipe: FileRecipe) -> list[str]:
    """What stderr prints: one line per mapped setting ("their_key: value -> setting=value"), then the ignored
    keys, one line per reason ("ignored: key, key (why)")."""
    lines = [f"{m.key}: {shown(m.value)} -> {m.setting}={shown(m.becomes)}" for m in recipe.mapped]
    reasons: dict[str, list[str]] = {}
    for item in recipe.ignored:
        reasons.setdefault(item.why, []).append(item.key)
    return lines + [f"ignored: {', '.join(keys)} ({why})" for why, keys in reasons.items()]
