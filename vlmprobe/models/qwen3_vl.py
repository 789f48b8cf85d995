"""Qwen3-VL: transformers' Qwen3VLForConditionalGeneration with random weights. The processor, the image
arithmetic, the batch, the loss and generation are Qwen2-VL's (qwen2_vl.py), read from transformers 5.23, with
16 px patches (a side a multiple of 32 px) and the published bounds min_pixels 65536, max_pixels 16777216. The rest
(a LayerNorm tower with a learned position table, DeepStack projectors whose features the LM adds after its first
layers, a Qwen3 LM) runs as the model runs it; the DeepStack gathers have known sizes because input_ids are
constant fakes. The merger and DeepStack projectors go with the vision tower. Videos are refused: each temporal
patch's timestamp is written as text, which only the model's tokenizer can count. Qwen3-VL-MoE (`Qwen3VLMoeSpec`)
has a mixture-of-experts LM (vlmprobe/models/moe.py).
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
