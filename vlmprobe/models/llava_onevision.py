"""LLaVA-OneVision: transformers' LlavaOnevisionForConditionalGeneration with random weights -- LLaVA-NeXT
(llava_next.py) on a SigLIP tower at 384 px (729 patch features per tile, no class token) and a Qwen2 LM, with two
differences re-implemented as arithmetic from LlavaOnevisionProcessor and the model's pack_image_features
(transformers 5.24): "anyres_max_N" shrinks an image's feature grid to about (N + 1) x 729 tokens plus newlines,
and a sample of several images (`data.images_per_sample` > 1) takes one untiled tile per image (`batch_num_images`,
a constant input: vlmprobe/models/fake_constants.py). Videos (pooled frames) are not modelled: a point is images
and text.
"""

from __future__ import annotations

import re

import torch

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.models.fake_constants import constant_tensor
from vlmprobe.models.llava_next import LlavaNextSpec

__all__ = ["LlavaOnevisionSpec"]

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

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: in a sample of several images one untiled tile and its newline
        (LlavaOnevisionProcessor's is_multi_image), else LLaVA-NeXT's anyres rule with anyres_max_N."""
        if images_in_sample > 1:
            return self.tokens_per_image() + 1
        return super().image_tokens_at(height, width, images_in_sample=images_in_sample, min_pixels=min_pixels,
                                       max_pixels=max_pixels)

    def tiles_per_image(self, data: DataShape) -> int:
        return 1 if data.images_per_sample > 1 else super().tiles_per_image(data)

    def image_inputs(self, n_images: int, data: DataShape, device: torch.device) -> dict:
        samples = n_images // data.images_per_sample
        return {**super().image_inputs(n_images, data, device),
                "batch_num_images": constant_tensor([data.images_per_sample] * samples, device)}
