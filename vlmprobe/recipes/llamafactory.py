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

from vlmprobe.recipes.common import (ALL_LINEAR_LM, VISION_LINEAR, Collector, FileRecipe, as_bool, as_count,
                                     as_number, autocast, checkpoint_kwargs, checkpointing, deepspeed_entries,
                                     ignore_known, ignore_unknown, optimizer_option)

__all__ = ["read_llamafactory"]

STAGES = {"sft": "sft", "pt": "sft"}  # pt's step is SFT's: a causal LM loss over every token
PIXELS = {"image_max_pixels": "data.max_pixels", "image_min_pixels": "data.min_pixels",
          "video_max_pixels": "data.video_max_pixels", "video_min_pixels": "data.video_min_pixels"}
ATTENTION = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}  # constants.py AttentionFunction


def zero_stage(config: dict, base: Path | None) -> int | None:
    """The ZeRO stage the file's deepspeed key runs (None: no DeepSpeed), read without recording anything."""
    if config.get("deepspeed") is None:
        return None
    scratch = Collector("llamafactory", "")
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
    zero3 = zero_stage(config, base) == 3
    pure = as_bool(c, "pure_bf16", config.get("pure_bf16", False))
    rank = as_count(c, "lora_rank", config.get("lora_rank", 8))

    def weights(key, value, dtype: str) -> None:
        # init_adapter: trainable weights upcast to float32 unless pure_bf16 or ZeRO-3; LoRA's are the adapters
        full_upcast = not lora and not zero3 and not pure
        c.map(key, value, "train.param_dtype", "float32" if full_upcast else dtype)

    for key, value in config.items():
        if key == "model_name_or_path":
            c.map(key, value, "model", str(value))
        elif key in PIXELS:
            c.map(key, value, PIXELS[key], as_count(c, key, value))
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
        elif key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target") and not lora:
            c.ignore(key, value, f"read only with finetuning_type: lora (this file: {method})")
        elif key == "lora_rank":
            c.map(key, value, "train.lora_r", rank)
            if "lora_alpha" not in config:  # finetuning_args.py: lora_alpha or lora_rank * 2
                c.map(key, value, "train.lora_alpha", 2 * rank)
        elif key == "lora_alpha":
            c.map(key, value, "train.lora_alpha", as_number(c, key, value))
        elif key == "lora_dropout":
            c.map(key, value, "train.lora_dropout", as_number(c, key, value))
        elif key == "lora_target":
            names = [n.strip() for n in str(value).split(",") if n.strip()]
            if names == ["all"]:
                names = ALL_LINEAR_LM + ([] if freeze_vision else VISION_LINEAR)
            c.map(key, value, "train.lora_target_modules", names)
        elif key == "freeze_vision_tower":
            c.map(key, value, "train.freeze_vision", freeze_vision)
            if lora:  # adapters go into the vision tower only where it is not frozen (patch_target_modules)
                c.map(key, value, "train.lora_towers", ["lm"] if freeze_vision else ["lm", "vision"])
        elif key == "freeze_language_model":
            if lora and as_bool(c, key, value):
                raise c.refuse(key, value, "with finetuning_type: lora vlmprobe adapts the language model; use "
                                           "false, or finetuning_type: full")
            c.map(key, value, "train.freeze_lm", as_bool(c, key, value))
        elif key == "freeze_multi_modal_projector":
            c.ignore(key, value, "not modelled: vlmprobe freezes the projector with the vision tower where the "
                                 "family holds it there (Qwen-VL's merger) and trains it elsewhere")
        elif key == "deepspeed":
            deepspeed_entries(c, key, value, base, "llamafactory")
        elif key == "cutoff_len":
            length = as_count(c, key, value)
            if stage == "dpo":  # a row is prompt + answer; infer_seqlen shares cutoff_len by the data's lengths
                c.map(key, value, "data.lm_max_length", length // 2)
                c.map(key, value, "step.completion_length", length - length // 2)
            else:
                c.map(key, value, "data.lm_max_length", length)
        elif key == "per_device_train_batch_size":
            c.map(key, value, "data.batch_size", as_count(c, key, value))
        elif key == "gradient_accumulation_steps":
            c.map(key, value, "train.grad_accum_steps", as_count(c, key, value))
        elif key in ("bf16", "fp16"):
            dtype = "bfloat16" if key == "bf16" else "float16"
            autocast(c, key, value, dtype, config.get("fp16" if key == "bf16" else "bf16"))
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
        elif key == "enable_liger_kernel":
            c.map(key, value, "train.liger_kernel", as_bool(c, key, value))
        elif key == "use_unsloth_gc":
            if as_bool(c, key, value):  # checkpointing.py: a reentrant function keeping each layer's input on the host
                c.map(key, value, "train.grad_ckpt.offload", True)
                c.map(key, value, "train.grad_ckpt_reentrant", True)
            else:
                c.ignore(key, value, "false: no offloaded checkpointing")
        elif key == "use_unsloth":
            if as_bool(c, key, value):
                raise c.refuse(key, value, "Unsloth's patched model is not read from this file; use "
                                           "recipe=unsloth, or false")
            c.ignore(key, value, "false: no Unsloth")
        elif key == "disable_gradient_checkpointing":
            checkpointing(c, key, not as_bool(c, key, value))
        elif key == "gradient_checkpointing":
            checkpointing(c, key, value)
        elif key == "use_reentrant_gc":
            c.map(key, value, "train.grad_ckpt_reentrant", as_bool(c, key, value))
        elif key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
            checkpoint_kwargs(c, key, value)
        elif key == "quantization_bit":
            if value is None:
                c.ignore(key, value, "not set (null): no quantization")
            elif value in (4, 8, "4", "8"):
                c.map(key, value, "train.quantization", "nf4" if int(value) == 4 else "int8")
            else:
                raise c.refuse(key, value, "vlmprobe models bitsandbytes 4 (nf4) and 8 (int8)")
        elif key == "quantization_method":
            if value != "bnb":
                raise c.refuse(key, value, "vlmprobe models bitsandbytes' on-the-fly quantization (bnb) only")
            c.ignore(key, value, "bnb: quantization_bit decides")
        elif key == "quantization_type":
            if value != "nf4":
                raise c.refuse(key, value, "vlmprobe models nf4 4-bit quantization only")
            c.ignore(key, value, "nf4: what train.quantization=nf4 is")
        elif key == "double_quantization":
            c.map(key, value, "train.quantization_double_quant", as_bool(c, key, value))
        elif key == "optim":
            c.map(key, value, "optimizer", optimizer_option(c, key, value))
        elif key == "packing":
            c.ignore(key, value, "no memory effect here: LLaMA-Factory packs samples into cutoff_len rows, and "
                                 "vlmprobe's rows always fill data.lm_max_length")
        elif key in ("neat_packing", "upcast_layernorm", "upcast_lmhead_output", "use_galore", "use_apollo",
                     "use_badam", "use_dora", "pissa_init", "use_llama_pro", "shift_attn"):
            if as_bool(c, key, value):
                raise c.refuse(key, value, "not modelled by vlmprobe; use false")
            c.ignore(key, value, "false: nothing to model")
        elif not ignore_known(c, key, key, value):
            ignore_unknown(c, key, value)
    return c.result()

