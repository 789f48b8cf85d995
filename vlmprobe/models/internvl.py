"""InternVL (3 and 2.5, the -hf checkpoints): transformers' InternVLForConditionalGeneration with random weights
-- an InternViT tower, a pixel-shuffle projector and a Qwen2 / Qwen2.5 LM. Images follow GotOcr2ImageProcessor with
InternVL's crop_to_patches, through transformers' own pure get_optimal_tiled_canvas: 1 to 12 tiles of 448 px on the
grid closest to the image's aspect ratio, plus a thumbnail where there is more than one; 256 image tokens per tile.
`data.image_size` is the input image's side (null = 448, one tile). input_ids are constant fakes for the image-token
count check. Towers: vision = `vision_tower`; lm = `language_model` + `lm_head`; the projector belongs to neither.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated


class InternVLSpec(ModelSpec):
    """Hydra target for conf/model/internvl*.yaml."""

    model_class = "InternVLForConditionalGeneration"

    def __init__(self, name: str, image_size: int, min_patches: int, max_patches: int, vision: dict, text: dict,
                 image_token_id: int, image_seq_length: int, downsample_ratio: float, projector_hidden_act: str,
                 vision_feature_layer: int, vision_feature_select_strategy: str, tie_word_embeddings: bool,
                 attn_implementation: str = "sdpa"):
        self.name = name
        self.native_image_size = image_size  # the default input side: one tile
        self.min_patches = min_patches
        self.max_patches = max_patches
        self.vision = dict(vision)
        self.text = dict(text)
        self.image_token_id = image_token_id
        self.image_seq_length = image_seq_length
        self.downsample_ratio = downsample_ratio
        self.projector_hidden_act = projector_hidden_act
        self.vision_feature_layer = vision_feature_layer
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_implementation = attn_implementation
        self.tile = self.vision["image_size"][0]

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of an InternVL config.json (`raw`) through transformers' InternVLConfig, with min / max
        tiles from preprocessor_config.json beside it (else InternVL's 1 and 12)."""
        from transformers import InternVLConfig

        config = InternVLConfig(**raw)
        vision = hyperparameters(config.vision_config)
        preprocessor = preprocessor or {}
        return cls(name=name, image_size=config.vision_config.image_size[0],
                   min_patches=preprocessor.get("min_patches", 1), max_patches=preprocessor.get("max_patches", 12),
                   vision=vision, text=hyperparameters(config.text_config), image_token_id=config.image_token_id,
                   image_seq_length=config.image_seq_length, downsample_ratio=config.downsample_ratio,
                   projector_hidden_act=config.projector_hidden_act, vision_feature_layer=config.vision_feature_layer,
                   vision_feature_select_strategy=config.vision_feature_select_strategy,
                   tie_word_embeddings=config.tie_word_embeddings, attn_implementation=attn_implementation)

    # -- image geometry -------------------------------------------------------------------------------
    def tiles(self, data: DataShape) -> int:
        """Tiles of one image, the thumbnail included."""
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        size = self.image_size(data)
        cols, rows = get_optimal_tiled_canvas((size, size), (self.tile, self.tile), self.min_patches, self.max_patches)
        return cols * rows + 1 if cols * rows > 1 else 1

    def image_tokens(self, data: DataShape) -> int:
        return data.images_per_sample * self.tiles(data) * self.image_seq_length

    size_decides_tokens = True

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        return 2 * data.images_per_sample, " plus <img> and </img> each"

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        from transformers import InternVLConfig

        return InternVLConfig(vision_config=dict(self.vision), text_config={**self.text, "use_cache": False},
                              image_token_id=self.image_token_id, image_seq_length=self.image_seq_length,
                              downsample_ratio=self.downsample_ratio, projector_hidden_act=self.projector_hidden_act,
                              vision_feature_layer=self.vision_feature_layer,
                              vision_feature_select_strategy=self.vision_feature_select_strategy,
                              tie_word_embeddings=self.tie_word_embeddings, attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_tower], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        image = [self.text.get("bos_token_id") or 1,  # <img> (a text id here: its value does not change memory)
                 *[self.image_token_id] * (self.tiles(data) * self.image_seq_length),
                 self.text.get("eos_token_id") or 2]  # </img>
        input_ids, labels = prompt_then_text(image * data.images_per_sample, data.lm_max_length,
                                             min(self.image_token_id, self.text["vocab_size"]))
        n = data.batch_size * data.images_per_sample * self.tiles(data)
        return collated(data, device, input_ids, labels, lambda: {
            "pixel_values": torch.randn(n, self.vision.get("num_channels", 3), self.tile, self.tile,
                                        dtype=torch.float32, device=device),
        })
