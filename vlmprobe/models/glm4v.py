"""GLM-4.1V (GLM-4.1V-9B-Thinking / -Base) and GLM-4.5V: transformers' Glm4vForConditionalGeneration and
Glm4vMoeForConditionalGeneration with random weights. Their processor and their M-RoPE positions are Qwen2-VL's
(qwen2_vl.py) with these differences, read from transformers 5.24 (models/glm4v):

- Images (Glm4vImageProcessor): the same smart_resize with 14 px patches merged 2 x 2 (a side is a multiple of
  28 px, a patch 3 x 2 x 14 x 14 = 1176 values), but the pixel bounds hold both frames of the temporal patch a
  still image is repeated over (t_bar x H x W with t_bar = 2, so an image gets half the bounds' pixels), and a
  side below 28 px is scaled up to 28 first instead of being refused (qwen2_vl.smart_resize's `frames` and
  `scale_up_small_sides`).
  Bounds: the processor class's own (size.shortest_edge 112 x 112, size.longest_edge 28 x 28 x 15000); a
  config.json read with model=hf takes its preprocessor_config.json's where there is one.
- Prompt: <|begin_of_image|>, one <|image|> per merged token, <|end_of_image|> (the chat template writes the
  markers, the processor expands <|image|>); mm_token_type_ids 1 at the image tokens.
- M-RoPE positions: Glm4vModel.get_rope_index gives a still image (p, p + row, p + col) and continues at
  p + max(rows, cols) // merge, Qwen2-VL's rule (checked against it in the tests), so the collator's positions
  and generate's (step=grpo: the same _prepare_position_ids_for_generation) are Qwen2-VL's.
- Videos are refused: the processor writes each frame's timestamp after it as text ("<|end_of_image|>12"),
  which only the model's tokenizer can count.

Inside the model, run as the model runs it:
- Vision tower: RMSNorm blocks with a gated SiLU MLP as wide as the LM (out_hidden_size), 2-D rope, and a learned
  24 x 24 position table resampled to each image's patch grid with a bicubic grid_sample in fp32 (an fp32
  patches x width tensor, then cast to the weights' dtype and added). After the blocks a 2 x 2 stride-2
  convolution merges the patches into LM-width tokens, then a merger (linear, LayerNorm, GELU, gated SiLU MLP of
  the vision intermediate_size). Both live inside `visual` and go with the vision tower.
- LM (GLM-4): q/k/v with bias, partial rotary (half of each head), and four RMSNorms per layer (before and after
  attention and the MLP); GLM-4.1V's MLP is one fused gate_up_proj.
- GLM-4.5V's LM (`Glm4vMoeSpec`) is a mixture of experts (vlmprobe/models/moe.py) after its first
  first_k_dense_replace dense layers: a sigmoid router in fp32 (its weight and the e_score_correction_bias
  buffer are fp32 whatever the model's dtype, as from_pretrained keeps them; the hidden states are cast to fp32
  for it, a tokens x width fp32 copy per layer that its weight's gradient keeps), top num_experts_per_tok of
  n_routed_experts within the best topk_group of n_group groups, renormalised and scaled by
  routed_scaling_factor; plus n_shared_experts shared experts, an ordinary MLP every token runs.
"""

from __future__ import annotations

from vlmprobe.models.moe import MixtureOfExperts
from vlmprobe.models.qwen2_vl import Qwen2VLSpec


class Glm4vSpec(Qwen2VLSpec):
    """Hydra target for conf/model/glm4_1v_9b.yaml and glm4v_tiny.yaml."""

    config_class = "Glm4vConfig"
    model_class = "Glm4vForConditionalGeneration"
    # Glm4vImageProcessor's class defaults, size.shortest_edge and size.longest_edge (transformers 5.24): no
    # preprocessor_config.json of the published models was read here (no hub access)
    published_pixels = (112 * 112, 28 * 28 * 15000)
    token_keys = ("image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id",
                  "image_token_id", "video_token_id")
    markers = ("image_start_token_id", "image_end_token_id")
    frames_in_budget = 2  # an image is counted as its temporal patch of 2 frames against the pixel bounds
    scales_up_small_sides = True  # the processor scales a side below 28 px up to 28 px
    frame_timestamps_as_text = True  # "<|end_of_image|>12" after each frame
    reads_video_preprocessor = False  # videos are refused


class Glm4vMoeSpec(MixtureOfExperts, Glm4vSpec):
    """Hydra target for conf/model/glm4_5v.yaml and glm4v_moe_tiny.yaml: GLM-4.5V, mixture-of-experts LM."""

    config_class = "Glm4vMoeConfig"
    model_class = "Glm4vMoeForConditionalGeneration"
    experts_key = "n_routed_experts"
