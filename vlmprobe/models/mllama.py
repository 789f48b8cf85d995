"""Llama 3.2 Vision (Mllama): transformers' MllamaForConditionalGeneration with random weights -- a tiled ViT, a
one-Linear projector and a Llama 3.1 LM in which every fifth layer is a gated cross-attention layer over the image
features. Images follow MllamaImageProcessor through transformers' own get_optimal_tiled_canvas: 560 px tiles, at
most `max_num_tiles` (4), every image padded to 4 tiles, so `data.image_size` (the input image's side) decides the
real tiles, not the tensors' shapes. The text holds one <|image|> per image; cross_attention_mask lets each token
attend to its image's real tiles. Only input_ids are constant fakes. Towers: vision = `vision_model`; lm =
`language_model` + `lm_head`; the projector belongs to neither.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor

__all__ = ["MllamaSpec"]


def canvas(size: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """(rows, cols) of tiles MllamaImageProcessor puts a square `size` px image on."""
    from transformers.models.mllama.image_processing_pil_mllama import get_optimal_tiled_canvas

    height, width = get_optimal_tiled_canvas(size, size, max_tiles, tile)
    return int(height) // tile, int(width) // tile


class MllamaSpec(ModelSpec):
    """Hydra target for conf/model/llama3_2_*_vision.yaml."""

    model_class = "MllamaForConditionalGeneration"

    def __init__(self, name: str, image_size: int, vision: dict, text: dict, image_token_id: int,
                 attn_implementation: str = "sdpa"):
        self.name = name
        self.native_image_size = image_size  # the default input side: one 560 px tile
        self.vision = dict(vision)
        self.text = dict(text)
        self.image_token_id = image_token_id
        self.attn_implementation = attn_implementation

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of an Mllama config.json (`raw`) through transformers' MllamaConfig; the default image side
        is one tile (the processor's tile size is the tower's image_size)."""
        from transformers import MllamaConfig

        config = MllamaConfig(**raw)
        return cls(name=name, image_size=config.vision_config.image_size, vision=hyperparameters(config.vision_config),
                   text=hyperparameters(config.text_config), image_token_id=config.image_token_id,
                   attn_implementation=attn_implementation)

    # -- image geometry -------------------------------------------------------------------------------
    def tiles(self, data: DataShape) -> tuple[int, int]:
        """(rows, cols) of real tiles of one image."""
        return canvas(self.image_size(data), self.vision["image_size"], self.vision["max_num_tiles"])

    def image_tokens(self, data: DataShape) -> int:
        """Text tokens the images take: one <|image|> each (the vision tokens live in the cross-attention)."""
        self.tiles(data)
        return data.images_per_sample

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """Any image: one <|image|> token (its tiles feed the cross-attention layers, not the LM's sequence)."""
        return 1

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        from transformers import MllamaConfig

        return MllamaConfig(vision_config=dict(self.vision), text_config={**self.text, "use_cache": False},
                            image_token_index=self.image_token_id, attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_model], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def batch(self, data: DataShape, device: torch.device) -> dict:
        from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        self.validate(data)
        b, images, max_tiles = data.batch_size, data.images_per_sample, self.vision["max_num_tiles"]
        prompt = [self.text.get("bos_token_id", 128000)] + [self.image_token_id] * images
        input_ids, labels = prompt_then_text(prompt, data.lm_max_length, self.image_token_id)  # text ids lie below
        rows, cols = self.tiles(data)
        ratio_id = get_all_supported_aspect_ratios(max_tiles).index((rows, cols)) + 1  # 0 is "no image"
        cross = convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(input_ids, self.image_token_id)] * b, [[rows * cols] * images] * b,
            max_tiles, data.lm_max_length)
        size = self.vision["image_size"]
        return collated(data, device, input_ids, labels, lambda: {
            "pixel_values": torch.randn(b, images, max_tiles, self.vision.get("num_channels", 3), size, size,
                                        dtype=torch.float32, device=device),
            "aspect_ratio_ids": constant_tensor([[ratio_id] * images] * b, device),
            "aspect_ratio_mask": constant_tensor([[[int(t < rows * cols) for t in range(max_tiles)]] * images] * b,
                                                 device),
            "cross_attention_mask": constant_tensor(cross, device),
        })
