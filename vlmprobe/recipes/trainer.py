"""A TRL config (`trl sft|grpo|dpo --config x.yaml`: SFTConfig / GRPOConfig / DPOConfig fields with TRL's
ModelConfig) or a plain HF TrainingArguments file (YAML, or the JSON of TrainingArguments.to_json_string) as
vlmprobe settings.

Read from TRL 1.10.0.dev0 (huggingface/trl@f2cd5771): trl/trainer/{sft,grpo,dpo,model_config}_config.py,
trl/trainer/utils.py get_peft_config; examples/cli_configs/example_config.yaml and examples/scripts/{sft,grpo}_vlm.py
are the examples followed; and from transformers 5.25 training_args.py / trainer.py (installed here).
The rules: ModelConfig.dtype (older TRL: torch_dtype) is the weights' dtype and bf16 / fp16 the Trainer's autocast;
use_peft makes peft LoRA adapters (lora_r 16, lora_alpha 32, lora_dropout 0.05 by default) and freezes everything
else, the vision tower included, unless `all-linear` adapts it too (peft tuners_utils.py
_maybe_include_all_linear_layers: every Linear but the output layer); gradient_checkpointing (transformers 5.25:
activation_checkpointing) checkpoints the whole model, non-reentrant unless its kwargs say use_reentrant; GRPO's
per_device_train_batch_size counts completions, as vlmprobe's data.batch_size does (conf/step/grpo.yaml).
Known limits: a DPO max_length with neither prompt nor completion length is split in half between them; TRL's
activation_offloading, and FSDP1, are refused; lora_target_modules naming layers a vision tower also has
(SigLIP's q_proj) adapt that tower too in peft, which train.lora_towers=[lm, vision] says.
"""

from __future__ import annotations

from pathlib import Path

from vlmprobe.recipes.common import (GRPO_RULES, LORA_RULES, TRAINER_RULES, Collector, FileRecipe, Rule, apply_rule,
                                     as_bool, as_count, as_text, attention, checkpoint_kwargs, checkpointing,
                                     deepspeed_entries, dtype_name, ignore_known, ignore_unknown, lora_targets,
                                     nf4_only, only_false, precision_flag, split_row)

__all__ = ["GRPO_FIELDS", "DPO_FIELDS", "MODEL_FIELDS", "SFT_FIELDS", "read_trainer"]

# Fields that tell one config class from another (trl/trainer/*_config.py)
GRPO_FIELDS = {"num_generations", "max_completion_length", "ds3_gather_for_generation", "use_vllm", "vllm_mode",
               "generation_batch_size", "steps_per_generation", "num_iterations", "epsilon_high", "scale_rewards"}
DPO_FIELDS = {"precompute_ref_log_probs", "rpo_alpha", "ref_model_sync_steps", "f_divergence_type", "beta",
              "max_prompt_length", "use_weighting", "discopop_tau"}
SFT_FIELDS = {"max_seq_length", "max_length", "packing", "packing_strategy", "padding_free", "dataset_text_field",
              "completion_only_loss", "assistant_only_loss", "activation_offloading", "eos_token"}
MODEL_FIELDS = {"model_name_or_path", "use_peft", "lora_r", "lora_target_modules", "load_in_4bit", "load_in_8bit",
                "dtype", "torch_dtype", "attn_implementation"}
PEFT_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
             "lora_modules_to_save")
# the keys mapped one to one (ModelConfig's, and the TrainingArguments'), then each config class's own
RULES = {"model_name_or_path": Rule("model", as_text),
         "attn_implementation": Rule("model.attn_implementation", attention),
         "lora_r": Rule("train.lora_r", as_count), **LORA_RULES,
         "use_bnb_nested_quant": Rule("train.quantization_double_quant", as_bool),
         "use_liger_kernel": Rule("train.liger_kernel", as_bool), **TRAINER_RULES}
PROMPT_RULE = Rule("data.lm_max_length", as_count)
KIND_RULES = {"trl_grpo": {**GRPO_RULES, "max_prompt_length": PROMPT_RULE,
                           "ds3_gather_for_generation": Rule("step.ds3_gather_for_generation", as_bool)},
              "trl_dpo": {"max_prompt_length": PROMPT_RULE,
                          "max_completion_length": Rule("step.completion_length", as_count)}}


def read_trainer(config: dict, kind: str, where: str, base: Path | None) -> FileRecipe:
    c = Collector(kind, where)
    peft = as_bool(c, "use_peft", config.get("use_peft", False))
    targets = config.get("lora_target_modules")
    all_linear = targets == "all-linear" or targets == ["all-linear"]
    rules = RULES | KIND_RULES.get(kind, {})

    for key, value in config.items():
        if key in PEFT_KEYS and not peft:
            c.ignore(key, value, "read only with use_peft: true")
        elif key == "attn_implementation" and value is None:
            c.ignore(key, value, "not set (null): the model's default")
        elif key in rules:
            apply_rule(c, rules[key], key, value)
        elif key in ("dtype", "torch_dtype"):
            c.map(key, value, "train.param_dtype", dtype_name(c, key, value))
            if as_bool(c, "load_in_4bit", config.get("load_in_4bit", False)):  # get_quantization_config: compute dtype
                c.map(key, value, "train.quantization_compute_dtype", dtype_name(c, key, value))
        elif key == "model_init_kwargs":
            given = value if isinstance(value, dict) else {}
            name = next((k for k in ("dtype", "torch_dtype") if k in given), None)
            if name:
                c.map(key, value, "train.param_dtype", dtype_name(c, f"{key}.{name}", given[name]))
            else:
                c.ignore(key, value, "no dtype in it: nothing vlmprobe reads")
        elif key == "use_peft":
            if peft:
                c.map(key, value, "train.lora_r", as_count(c, "lora_r", config.get("lora_r", 16)))
                if "lora_alpha" not in config:
                    c.map(key, value, "train.lora_alpha", 32)
                if "lora_dropout" not in config:
                    c.map(key, value, "train.lora_dropout", 0.05)
                # peft freezes every weight but the adapters; all-linear adapts the vision tower too
                c.map(key, value, "train.lora_towers", ["lm", "vision"] if all_linear else ["lm"])
                c.map(key, value, "train.freeze_vision", not all_linear)
            else:
                c.map(key, value, "train.lora_r", 0)
        elif key == "lora_target_modules":
            if value is None:
                c.ignore(key, value, "not set (null): peft's default for the model type stands")
            else:
                names = [n.strip() for n in (value if isinstance(value, list) else str(value).split(",")) if n.strip()]
                lora_targets(c, key, value, names, every=all_linear, vision=True)
        elif key == "lora_target_parameters":
            c.map(key, value, "train.lora_target_parameters", list(value or []))
        elif key == "lora_modules_to_save":
            if value:
                raise c.refuse(key, value, "fully trained modules beside the adapters are not modelled; use null")
            c.ignore(key, value, "none: nothing to model")
        elif key in ("load_in_4bit", "load_in_8bit"):
            on = as_bool(c, key, value)
            if on:
                c.map(key, value, "train.quantization", "nf4" if key == "load_in_4bit" else "int8")
                if key == "load_in_4bit" and "use_bnb_nested_quant" not in config:
                    c.map(key, value, "train.quantization_double_quant", False)  # ModelConfig default
            else:
                c.ignore(key, value, "false: no quantization")
        elif key == "bnb_4bit_quant_type":
            nf4_only(c, key, value)
        elif key in ("bf16", "fp16"):
            precision_flag(c, key, key, value, config)
        elif key in ("gradient_checkpointing", "activation_checkpointing"):
            checkpointing(c, key, value)
        elif key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
            checkpoint_kwargs(c, key, value)
        elif key == "deepspeed":
            deepspeed_entries(c, key, value, base)
        elif key == "fsdp":
            if not value:
                c.ignore(key, value, "not set: no FSDP")
            else:
                options = config.get("fsdp_config") if isinstance(config.get("fsdp_config"), dict) else {}
                version = options.get("fsdp_version", options.get("version", 1))
                if str(version) != "2":
                    raise c.refuse(key, value, f"FSDP version {version} is not modelled: vlmprobe models FSDP2 "
                                               f"(fully_shard); set fsdp_config.fsdp_version: 2")
                c.map(key, value, "dist", "fsdp2")
        elif key == "fsdp_config":
            c.ignore(key, value, "read with fsdp (its version); its other keys are not read from here")
        elif key == "activation_offloading":
            only_false(c, key, value, "TRL's activation offloading is not modelled; use false")
        elif key in ("max_length", "max_seq_length") and kind in ("trl_sft", "hf_trainer"):
            if value is None:
                c.ignore(key, value, "not set (null): no truncation; give data.lm_max_length")
            else:
                c.map(key, value, "data.lm_max_length", as_count(c, key, value))
        elif key == "max_length" and kind == "trl_dpo":
            prompt, completion = split_row(as_count(c, key, value), config.get("max_prompt_length"),
                                           config.get("max_completion_length"))
            if "max_prompt_length" not in config:
                c.map(key, value, "data.lm_max_length", prompt)
            if "max_completion_length" not in config:
                c.map(key, value, "step.completion_length", completion)
        elif key in ("packing", "padding_free"):
            if kind != "trl_sft":
                c.ignore(key, value, "not modelled outside SFT: vlmprobe packs SFT rows only")
            else:  # TRL's padding_free / packed rows: one row, position ids restarting per sample
                c.map(key, value, "data.packing", as_bool(c, key, value))
        elif kind == "trl_grpo" and key in ("steps_per_generation", "generation_batch_size"):
            c.ignore(key, value, "not modelled: one generation covers data.batch_size x train.grad_accum_steps "
                                 "rows (TRL's default)")
        elif kind == "trl_dpo" and key == "precompute_ref_log_probs":
            only_false(c, key, value, "a reference scored before training is not modelled (vlmprobe scores it in the "
                                      "step); use false", "false: the reference scores the rows in the step")
        elif kind == "trl_dpo" and key == "beta":
            c.ignore(key, value, "no memory effect (the loss's temperature)")
        elif not ignore_known(c, key, key, value):
            ignore_unknown(c, key, value)
    return c.result()
