"""GLM-4.1V and GLM-4.5V: transformers' Glm4vForConditionalGeneration and Glm4vMoeForConditionalGeneration with
random weights. Their processor and their M-RoPE positions are Qwen2-VL's (qwen2_vl.py) with differences read from
transformers 5.24 (models/glm4v): the pixel bounds hold both frames of the temporal patch (`frames`), a side below
28 px is scaled up instead of refused (`scale_up_small_sides`), the bounds are Glm4vImageProcessor's own (or a
model=hf folder's preprocessor_config.json), and an image is <|begin_of_image|>, one <|image|> per merged token,
<|end_of_image|>. Videos are refused: each frame's timestamp is written as text, which only the model's tokenizer
can count. The rest (a vision tower whose learned position table is resampled in fp32, the GLM-4 LM, GLM-4.5V's
mixture of experts after first_k_dense_replace dense layers: vlmprobe/models/moe.py) runs as the model runs it.
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
