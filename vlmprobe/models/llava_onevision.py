"""LLaVA-OneVision: transformers' LlavaOnevisionForConditionalGeneration with random weights -- LLaVA-NeXT
(llava_next.py: anyres tiling, unpadding, a learned `image_newline`) on a SigLIP tower at 384 px (27 x 27 = 729
patch features per tile, no class token: vision_feature_select_strategy "full") and a Qwen2 LM, with two
differences that decide its memory, both re-implemented here as arithmetic from LlavaOnevisionProcessor and the
model's pack_image_features (transformers 5.24):

- "anyres_max_N" (`vision_aspect_ratio`): the 36 canvases of llava-onevision reach 2304 x 2304 px (6 x 6 tiles),
  but where an image's unpadded feature grid holds more than 1.1^2 x N tiles' features the model shrinks it
  (bilinear interpolation) by the square root of that ratio, so an image is at most about (N + 1) x 729 tokens
  plus newlines: a 384 px image is 729 + 27 x 28 = 1485 tokens, a 768 px one 729 + 54 x 55 = 3699, a 2304 px one
  729 + 81 x 82 = 7371 (9 tiles' worth, though the tower encodes all 1 + 36 tiles first).
- Several images in one sample (`data.images_per_sample` > 1) are not tiled: the processor pads each to a square
  and resizes it to the tower's size, one tile each (pixel_values (n_images, 1, 3, 384, 384)), and each takes
  729 + 1 tokens (the tile and one newline). `batch_num_images` (images per sample, a constant input the forward
  reads: vlmprobe/models/fake_constants.py) tells the model which case it is in, as the processor's output does.

Videos (pooled frames) are not modelled: a point is images and text.
"""

from __future__ import annotations

import re

import torch

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.models.fake_constants import constant_tensor
from vlmprobe.models.llava_next import LlavaNextSpec

ASPECT_RATIO = re.compile(r"anyres_max_([1-9]\d*)")  # the one form transformers' model and processor parse


class LlavaOnevisionSpec(LlavaNextSpec):
    """Hydra target for conf/model/llava_onevision_*.yaml."""

    config_class = "LlavaOnevisionConfig"
    model_class = "LlavaOnevisionForConditionalGeneration"

    def __init__(self, *, vision_aspect_ratio: str, **llava_next):
        super().__init__(**llava_next)
        match = ASPECT_RATIO.fullmatch(str(vision_aspect_ratio))
        if match is None:
            raise ConfigError(f"model.vision_aspect_ratio={vision_aspect_ratio!r} is not allowed for {self.name}: "
                              f"transformers' LLaVA-OneVision takes anyres_max_N only (N a positive integer: the "
                              f"most tiles an image's features are kept at; llava-onevision uses anyres_max_9)")
        self.vision_aspect_ratio = vision_aspect_ratio
        self.max_tiles = int(match[1])

    def family_config(self) -> dict:
        return {**super().family_config(), "vision_aspect_ratio": self.vision_aspect_ratio}

    @classmethod
    def family_kwargs(cls, config) -> dict:
        return {**super().family_kwargs(config), "image_size": config.vision_config.image_size,
                "vision_aspect_ratio": config.vision_aspect_ratio}

    # -- image geometry -------------------------------------------------------------------------------
    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        return 1, " plus a text token before them"  # LLaVA's layout (llava.py); Qwen2's tokenizer adds no <s>

    def image_tokens(self, data: DataShape) -> int:
        if data.images_per_sample > 1:  # one tile and one newline per image (the processor's is_multi_image)
            return data.images_per_sample * (self.tokens_per_image() + 1)
        return super().image_tokens(data)

    def tiles_per_image(self, data: DataShape) -> int:
        return 1 if data.images_per_sample > 1 else super().tiles_per_image(data)

    def image_inputs(self, n_images: int, data: DataShape, device: torch.device) -> dict:
        samples = n_images // data.images_per_sample
        return {**super().image_inputs(n_images, data, device),
                "batch_num_images": constant_tensor([data.images_per_sample] * samples, device)}
