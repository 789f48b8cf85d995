"""A LLaMA-Factory training YAML (`llamafactory-cli train x.yaml`) as vlmprobe settings.

Read from LLaMA-Factory 0.9.6.dev0 (hiyouga/LLaMA-Factory@ff6d4d12), src/llamafactory/hparams/{model_args,
data_args,finetuning_args,parser}.py and model/{adapter,model_utils/visual,model_utils/checkpointing}.py; the example
followed is examples/train_lora/qwen2_5vl_lora_sft.yaml (@00052690, the last commit that has it).
The rules: finetuning_type lora makes peft adapters of rank lora_rank (default 8; lora_alpha defaults to twice the
rank) and freezes the rest; `lora_target: all` is every Linear but lm_head and the projector, and not the vision
tower while freeze_vision_tower (default true) holds (misc.py find_all_linear_modules, visual.py
patch_target_modules); bf16 loads the weights in bf16 and autocasts, and init_adapter upcasts the trainable
weights to float32 except under ZeRO-3 or pure_bf16; gradient checkpointing is on unless
disable_gradient_checkpointing, reentrant unless use_reentrant_gc is false; a DPO row is cutoff_len tokens,
prompt and answer shared by data (processor_utils.py infer_seqlen).
Known limits: a full fine-tune's frozen tower stays bf16 in LLaMA-Factory and is float32 here (train.param_dtype is
one dtype); freeze_multi_modal_projector is not modelled (vlmprobe freezes a projector with the vision tower where
the family holds it there, Qwen-VL's merger, and trains it elsewhere); a DPO row's cutoff_len is split in half
between prompt and answer; freeze tuning, OFT, KTO, PPO and reward modelling are refused.
"""

from __future__ import annotations

from pathlib import Path

from vlmprobe.recipes.common import (LORA_RULES, TRAINER_RULES, Collector, FileRecipe, Rule, apply_rule, as_bool,
                                     as_count, as_text, checkpoint_kwargs, checkpointing, deepspeed_entries,
                                     freeze_language_model, freeze_vision_tower, ignore_known, ignore_unknown,
                                     lora_targets, nf4_only, only_false, only_value, precision_flag,
                                     quantization_bits, row_length)

__all__ = ["read_llamafactory"]

STAGES = {"sft": "sft", "pt": "sft"}  # pt's step is SFT's: a causal LM loss over every token
ATTENTION = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}  # constants.py AttentionFunction
# the keys mapped one to one (model_args.py, data_args.py, finetuning_args.py; the HF Trainer's as it names them)
RULES = {"model_name_or_path": Rule("model", as_text),
         "image_max_pixels": Rule("data.max_pixels", as_count), "image_min_pixels": Rule("data.min_pixels", as_count),
         "video_max_pixels": Rule("data.video_max_pixels", as_count),
         "video_min_pixels": Rule("data.video_min_pixels", as_count),
         **LORA_RULES,
         "use_reentrant_gc": Rule("train.grad_ckpt_reentrant", as_bool),
         "enable_liger_kernel": Rule("train.liger_kernel", as_bool),
         "quantization_bit": Rule("train.quantization", quantization_bits),
         "double_quantization": Rule("train.quantization_double_quant", as_bool),
         **TRAINER_RULES}
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target")
# methods and patches vlmprobe does not model: read only where false
NOT_MODELLED = ("neat_packing", "upcast_layernorm", "upcast_lmhead_output", "use_galore", "use_apollo", "use_badam",
                "use_dora", "pissa_init", "use_llama_pro", "shift_attn")


def zero_stage(config: dict, where: str, base: Path | None) -> int | None:
    """The ZeRO stage the file's deepspeed key runs (None: no DeepSpeed), read without recording anything; a
    refusal names the file (`where`)."""
    if config.get("deepspeed") is None:
        return None
    scratch = Collector("llamafactory", where)
    deepspeed_entries(scratch, "deepspeed", config["deepspeed"], base, "llamafactory")
    dist = next((m.becomes for m in scratch.mapped if m.setting == "dist"), None)
    return int(dist[-1]) if dist else None


def read_llamafactory(config: dict, where: str, base: Path | None) -> FileRecipe:
    c = Collector("llamafactory", where)
    method = config.get("finetuning_type", "lora")
    if method not in ("lora", "full"):
        raise c.refuse("finetuning_type", method, "vlmprobe models lora and full (freeze tuning trains a few "
                                                  "chosen layers and OFT other adapters, neither modelled)")
    lora = method == "lora"
    freeze_vision = as_bool(c, "freeze_vision_tower", config.get("freeze_vision_tower", True))
    stage = config.get("stage", "sft")
    zero3 = zero_stage(config, where, base) == 3
    pure = as_bool(c, "pure_bf16", config.get("pure_bf16", False))
    rank = as_count(c, "lora_rank", config.get("lora_rank", 8))

    def weights(key, value, dtype: str) -> None:
        # init_adapter: trainable weights upcast to float32 unless pure_bf16 or ZeRO-3; LoRA's are the adapters
        full_upcast = not lora and not zero3 and not pure
        c.map(key, value, "train.param_dtype", "float32" if full_upcast else dtype)

    for key, value in config.items():
        if key in LORA_KEYS and not lora:
            c.ignore(key, value, f"read only with finetuning_type: lora (this file: {method})")
        elif key == "quantization_bit" and value is None:
            c.ignore(key, value, "not set (null): no quantization")
        elif key in RULES:
            apply_rule(c, RULES[key], key, value)
        elif key == "stage":
            if value == "dpo":
                c.map(key, value, "step", "dpo")
                c.map(key, value, "step.logits", "full_fp32")  # CustomDPOTrainer: every position's logits in fp32
            elif value in STAGES:
                c.map(key, value, "step", STAGES[value])
            else:
                raise c.refuse(key, value, "vlmprobe models the stages sft, pt (as sft) and dpo (kto, ppo and rm "
                                           "are not modelled)")
        elif key == "pref_loss":
            if stage != "dpo":
                c.ignore(key, value, "read only with stage: dpo")
            else:  # finetuning_args.py: use_ref_model unless orpo / simpo
                c.map(key, value, "step.reference", value not in ("orpo", "simpo"))
        elif key == "finetuning_type":
            c.map(key, value, "train.lora_r", rank if lora else 0)
        elif key == "lora_rank":
            c.map(key, value, "train.lora_r", rank)
            if "lora_alpha" not in config:  # finetuning_args.py: lora_alpha or lora_rank * 2
                c.map(key, value, "train.lora_alpha", 2 * rank)
        elif key == "lora_target":
            names = [str(n).strip() for n in (value if isinstance(value, list) else str(value).split(",")) if str(n).strip()]
            lora_targets(c, key, value, names, every=names == ["all"], vision=not freeze_vision)
        elif key == "freeze_vision_tower":
            freeze_vision_tower(c, key, value, freeze_vision, lora)
        elif key == "freeze_language_model":
            freeze_language_model(c, key, value, lora, "with finetuning_type: lora vlmprobe adapts the language "
                                                       "model; use false, or finetuning_type: full")
        elif key == "freeze_multi_modal_projector":
            c.ignore(key, value, "not modelled: vlmprobe freezes the projector with the vision tower where the "
                                 "family holds it there (Qwen-VL's merger) and trains it elsewhere")
        elif key == "deepspeed":
            deepspeed_entries(c, key, value, base, "llamafactory")
        elif key == "cutoff_len":  # a DPO row is prompt + answer; infer_seqlen shares cutoff_len by the data's lengths
            row_length(c, key, value, stage == "dpo")
        elif key in ("bf16", "fp16"):
            dtype = precision_flag(c, key, key, value, config)
            if as_bool(c, key, value):
                weights(key, value, dtype)
        elif key == "pure_bf16":
            if pure:
                c.map(key, value, "train.param_dtype", "bfloat16")
                if not as_bool(c, "bf16", config.get("bf16", False)):
                    c.map(key, value, "train.autocast_dtype", None)  # bf16 weights without AMP
            else:
                c.ignore(key, value, "false: bf16 / fp16 decide the precision")
        elif key == "flash_attn":
            if value == "auto":
                c.ignore(key, value, "auto: the model's own attention (transformers' default, sdpa)")
            elif value in ATTENTION:
                c.map(key, value, "model.attn_implementation", ATTENTION[value])
            else:
                raise c.refuse(key, value, "vlmprobe models auto, disabled (eager), sdpa and fa2")
        elif key == "use_unsloth_gc":
            if as_bool(c, key, value):  # checkpointing.py: a reentrant function keeping each layer's input on the host
                c.map(key, value, "train.grad_ckpt.offload", True)
                c.map(key, value, "train.grad_ckpt_reentrant", True)
            else:
                c.ignore(key, value, "false: no offloaded checkpointing")
        elif key == "use_unsloth":
            only_false(c, key, value, "Unsloth's patched model is not read from this file; use recipe=unsloth, or "
                                      "false", "false: no Unsloth")
        elif key == "disable_gradient_checkpointing":
            checkpointing(c, key, not as_bool(c, key, value))
        elif key == "gradient_checkpointing":
            checkpointing(c, key, value)
        elif key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
            checkpoint_kwargs(c, key, value)
        elif key == "quantization_method":
            only_value(c, key, value, "bnb", "vlmprobe models bitsandbytes' on-the-fly quantization (bnb) only",
                       "bnb: quantization_bit decides")
        elif key == "quantization_type":
            nf4_only(c, key, value)
        elif key == "packing":
            c.ignore(key, value, "no memory effect here: LLaMA-Factory packs samples into cutoff_len rows, and "
                                 "vlmprobe's rows always fill data.lm_max_length")
        elif key in NOT_MODELLED:
            only_false(c, key, value, "not modelled by vlmprobe; use false")
        elif not ignore_known(c, key, key, value):
            ignore_unknown(c, key, value)
    return c.result()
