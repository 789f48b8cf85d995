"""Llama 3.2 Vision (Mllama): transformers' MllamaForConditionalGeneration with random weights -- a tiled ViT
(`vision_model`: a local encoder, then global layers with gated attention, tile and aspect-ratio embeddings;
its output is the last hidden state concatenated with 5 intermediate layers' states), a projector
(`multi_modal_projector`: one Linear to the LM width) and a Llama 3.1 LM in which every fifth layer is a gated
cross-attention layer that attends over the image features instead of the text.

Images (MllamaImageProcessor, through transformers' own pure helpers, no processor run): an image is
resized onto the best canvas of whole 560 px tiles among the aspect ratios of at most `max_num_tiles` (4)
tiles (`get_optimal_tiled_canvas`: a square image of at most 560 px is one tile, a larger one 2 x 2), and
every image is padded to `max_num_tiles` tiles: pixel_values (B, images, 4, 3, 560, 560) float32 whatever
the image size; aspect_ratio_ids (B, images) name the canvas, aspect_ratio_mask (B, images, 4) its real
tiles. Each tile is (560 / 14)^2 + 1 = 1601 patches (padded to 1608 inside the tower): the cross-attention
layers attend over images x 4 x 1601 vision tokens, padding tiles included; the text holds one <|image|> token per image, and cross_attention_mask
(B, L, images, 4) int64 lets each token from its image's <|image|> on attend to that image's real tiles
(MllamaProcessor's get_cross_attention_token_mask / convert_sparse_cross_attention_mask_to_dense).
`data.image_size` is the input image's side: it decides the canvas (1 or 4 real tiles), not the tensors'
shapes.

The loss is the model's own; attention_mask is None (every sample fills the length). Under fake tensors
the image-token check reads nothing (Mllama has no placeholder scatter) and the masks are computed without
reading values, so only input_ids are constant fakes (as for the other families).

Towers: vision = `vision_model`; lm = `language_model` + `lm_head`; the projector belongs to neither.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor


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
