"""One line on stderr where a planned point's choice is unusual for what it trains, saying what the common recipes do
instead: the choice stands (the point runs as asked), but two defaults decide most answers (weights in float32,
a vision tower that LoRA leaves trained) and a person asking about their recipe rarely means them."""

from __future__ import annotations

__all__ = ["notices"]

BILLION = 10**9


def notices(planned: list) -> list[str]:
    """The lines for these planned points, each said once."""
    lines: list[str] = []
    for item in planned:
        for line in point_notices(item.config["train"], item.inputs):
            if line not in lines:
                lines.append(line)
    return lines


def point_notices(train: dict, inputs: dict) -> list[str]:
    params, trainable = inputs.get("params") or 0, inputs.get("trainable_params") or 0
    found = []
    wide = train["param_dtype"] == "float32" and params >= BILLION
    if train["lora_r"] and wide and not train.get("quantization"):
        found.append(f"vlmprobe: notice: LoRA on float32 weights ({params / BILLION:.1f}B parameters, "
                     f"{4 * params / 2**30:.1f} GiB of weights alone): LoRA recipes (peft, TRL, LLaMA-Factory, "
                     f"ms-swift) load the base in bfloat16: train.param_dtype=bfloat16 train.autocast_dtype=null")
    if train["lora_r"] and not train["freeze_vision"] and not train.get("quantization") and trainable > 0.05 * params:
        found.append(f"vlmprobe: notice: LoRA with the vision tower trained whole ({trainable:,} of {params:,} "
                     f"parameters train): most LoRA recipes freeze it (train.freeze_vision=true)")
    if not train["lora_r"] and wide and trainable == params:
        found.append(f"vlmprobe: notice: full fine-tuning with float32 weights ({params / BILLION:.1f}B parameters): "
                     f"transformers 5 loads a checkpoint in its own dtype (bfloat16 for these models) unless told "
                     f"otherwise: train.param_dtype=bfloat16 if your run does not ask for float32")
    return found
