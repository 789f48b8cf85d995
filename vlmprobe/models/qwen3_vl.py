"""Qwen3-VL: transformers' Qwen3VLForConditionalGeneration with random weights. The processor, the image
arithmetic, the batch, the loss and generation are Qwen2-VL's (qwen2_vl.py), read from transformers 5.23:

- Images: Qwen3VLProcessor uses Qwen2VLImageProcessor (image_processing_auto maps qwen3_vl to it), the same
  smart_resize with patch 16 instead of 14, so a side is a multiple of 16 x merge 2 = 32 px and a patch is
  3 x 2 x 16 x 16 = 1536 values; the published bounds are min_pixels 65536 (256 x 256) and max_pixels
  16777216 (4096 x 4096). One <|image_pad|> per merged token, between <|vision_start|> and <|vision_end|>.
- M-RoPE positions: Qwen3VLModel.get_rope_index gives a still image (p, p + row, p + col) and continues at
  p + max(rows, cols) // merge, as Qwen2-VL does (the interleaved frequency layout, mrope_interleaved,
  changes which frequencies each axis gets, not the positions); generate reads them through the same
  _prepare_position_ids_for_generation, so step=grpo runs as for Qwen2-VL.

What differs is inside the model, and runs as the model runs it (no input of its own):
- Vision tower: LayerNorm blocks with a plain GELU MLP, a learned 48 x 48 position table bilinearly resampled
  to each image's patch grid (added to the patch embeddings) besides the 2-D rope, and a 2 x 2 patch merger.
- DeepStack: the hidden states after the blocks in `deepstack_visual_indexes` ([8, 16, 24] in the 8B) go
  through merger-shaped projectors of their own (`deepstack_merger_list`); the LM adds the k-th of them to
  its hidden states at the image-token positions after decoder layer k (Qwen3VLTextModel._deepstack_process:
  a clone of the hidden states, a boolean-mask gather, add and scatter per layer), so the first
  len(deepstack_visual_indexes) LM layers each keep an image-sized tensor alive for backward. The estimate
  traces that path because it runs the real forward: the boolean masks come from the constant input_ids
  (vlmprobe/models/fake_constants.py), so the gathers have known sizes under fake tensors.
- LM: Qwen3 (per-head RMSNorm on q and k, no q/k/v bias).

Videos are refused (`frame_timestamps_as_text`): Qwen3VLProcessor writes each temporal patch's timestamp
("<1.5 seconds>") as text before its tokens, and how many tokens that text takes only the model's tokenizer can say.

Towers: the merger and the DeepStack projectors live inside `visual`, so they go with the vision tower
(frozen with it), as for Qwen2-VL's merger.

Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B; `Qwen3VLMoeSpec`) is this model with a mixture-of-experts LM: in each
layer a router (a num_experts x width weight, softmax, top num_experts_per_tok, renormalised) and the experts, run
as vlmprobe/models/moe.py says (model.experts_implementation).
"""

from __future__ import annotations

from vlmprobe.models.moe import MixtureOfExperts
from vlmprobe.models.qwen2_vl import Qwen2VLSpec


class Qwen3VLSpec(Qwen2VLSpec):
    """Hydra target for conf/model/qwen3_vl_*.yaml."""

    config_class = "Qwen3VLConfig"
    model_class = "Qwen3VLForConditionalGeneration"
    # Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json: size.shortest_edge 65536 (256 * 256), size.longest_edge
    # 16777216 (4096 * 4096)
    published_pixels = (65536, 16777216)

    frame_timestamps_as_text = True  # "<1.5 seconds>" before each temporal patch


class Qwen3VLMoeSpec(MixtureOfExperts, Qwen3VLSpec):
    """Hydra target for conf/model/qwen3_vl_30b_a3b.yaml, qwen3_vl_235b_a22b.yaml and qwen3_vl_moe_tiny.yaml:
    Qwen3-VL, mixture-of-experts LM."""

    config_class = "Qwen3VLMoeConfig"
    model_class = "Qwen3VLMoeForConditionalGeneration"
