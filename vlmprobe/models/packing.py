"""Packed micro batches (`data.packing=true`): the micro batch's samples end to end in one row, no padding.

Rule, as ms-swift 4.6.0 builds it for `--packing true` / `--padding_free true` (swift/template/base.py:
Template.packing_row, _data_collator): the samples' input_ids and labels concatenated into one row of
batch_size x lm_max_length tokens, position_ids restarting at 0 at each sample, no attention_mask; for Qwen2-VL and
Qwen2.5-VL (templates/qwen.py: Qwen2VLTemplate.packing_row) each sample's M-RoPE positions are its own
get_rope_index with a text row 0..L-1 on top, concatenated along the sequence into (4, 1, N), the packed layout
transformers 5.25's Qwen2-VL text model reads (row 0 finds the samples; with three rows it would attend across them).
TRL 1.16.0's padding-free collator is the same for text (trl/trainer/sft_trainer.py); its SFTTrainer refuses packing
and padding_free for vision datasets. transformers then keeps the samples apart from the positions alone: sdpa and
eager through a block-diagonal causal mask over the whole row (masking_utils: find_packed_sequence_indices), a
(1, 1, N, N) tensor; flash_attention_2 through the varlen kernel on cu_seqlens each layer derives from the positions
(modeling_flash_attention_utils: _is_packed_sequence, _prepare_from_posids). docs/models.md has the figures.

Families: Qwen2-VL, Qwen2.5-VL and InternVL (1-D positions), each checked against its model's per-sample forward;
others are refused (ms-swift also packs Qwen3-VL and GLM-4.xV: not modelled here), and so is any attention but sdpa,
eager and flash_attention_2. Limits: step=sft only; every sample fills lm_max_length (no samples of mixed lengths);
ms-swift hands Qwen2-VL's cu_seqlens to the model from its collator, which skips the q/k/v copies transformers makes
when it derives them from the positions (modelled here; InternVL's route in ms-swift).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from vlmprobe.errors import ConfigError
from vlmprobe.models.fake_constants import collated, constant_tensor

__all__ = ["check_packing", "packed", "packed_rows", "padded_or_packed", "PACKING_ATTENTION", "PACKING_MODELS",
           "restarting", "restarting_positions"]

# transformers model classes whose batch() packs, and how the refusal names their configs
PACKING_MODELS = {"Qwen2VLForConditionalGeneration": "qwen2_vl_*", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_*",
                  "InternVLForConditionalGeneration": "internvl*"}
# attention implementations under which transformers keeps packed samples apart (and the estimate models it)
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2")


def check_packing(spec) -> None:
    """ConfigError (one line) unless `spec`'s family builds packed batches under its attention implementation."""
    if getattr(spec, "model_class", None) not in PACKING_MODELS:
        raise ConfigError(f"data.packing=true is not allowed for {spec.name}: packed batches are modelled for "
                          f"Qwen2-VL, Qwen2.5-VL and InternVL ({', '.join(PACKING_MODELS.values())}, hf); use false")
    attention = getattr(spec, "attn_implementation", None)
    if attention not in PACKING_ATTENTION:
        raise ConfigError(f"model.attn_implementation={attention!r} is not allowed with data.packing=true: "
                          f"packed samples are kept apart (and modelled) under {', '.join(PACKING_ATTENTION)}; use "
                          f"one of those")


def packed_rows(data, rows: list[list[int]]) -> list[list[int]]:
    """Per-token rows of one sample (token types, M-RoPE positions), each repeated for every sample of the micro
    batch, end to end."""
    return [row * data.batch_size for row in rows]


def restarting_positions(data) -> list[int]:
    """The packed row's 1-D position ids: 0 .. lm_max_length - 1 for each sample."""
    return restarting([data.lm_max_length] * data.batch_size)


def restarting(lengths: list[int]) -> list[int]:
    """1-D position ids of samples of these lengths end to end: 0 .. length - 1 for each."""
    return [i for length in lengths for i in range(length)]


def padded_or_packed(rows: dict[str, list[list[int]]], fills: dict[str, int], padded_length: int, packing: bool,
                     device: torch.device, positions: list | None = None) -> dict:
    """A dataset's micro batch (vlmprobe.point.dataset_steps) from its samples' per-token rows (input_ids and
    labels first, then any other; each a list of one list per sample): each sample right-padded to
    `padded_length` with the row's `fills` value, an attention_mask 0 at the pads after the labels
    (transformers 5.25's DataCollatorForSeq2Seq, padding on the tokenizer's side, "right" by default); with
    `packing` the samples end to end in one row, no mask, and position_ids `positions` (default: restarting at
    each sample, this module's rule). Tensors are made in that order. The caller holds the constant limit over
    the batch's tokens (dataset_steps)."""
    lengths = [len(sample) for sample in rows["input_ids"]]
    if packing:
        return {**{k: constant_tensor([sum(samples, [])], device) for k, samples in rows.items()},
                "position_ids": constant_tensor(positions or [restarting(lengths)], device)}
    batch = {}
    for key, samples in rows.items():
        batch[key] = constant_tensor([row + [fills[key]] * (padded_length - len(row)) for row in samples], device)
        if key == "labels":
            batch["attention_mask"] = constant_tensor([[1] * n + [0] * (padded_length - n) for n in lengths], device)
    return batch


def packed(data, device: torch.device, input_ids: list[int], labels: list[int], inputs: Callable[[], dict],
           limit: int = 0) -> dict:
    """One packed micro batch: the batch_size samples' input_ids and labels in one row, (1, batch_size x
    lm_max_length), then the family's other inputs, position_ids among them (`inputs()`), made as
    fake_constants.collated makes them. The constant limit covers the row plus one value (or `limit` where
    larger): find_packed_sequence_indices prepends a column to the positions before it takes their differences."""
    tokens = data.batch_size * data.lm_max_length
    row = dataclasses.replace(data, batch_size=1, lm_max_length=tokens)
    return collated(row, device, input_ids * data.batch_size, labels * data.batch_size, inputs,
                    max(limit, tokens + 1))
