"""Mistral 3 (Mistral-Small-3.1 / 3.2, 24B): transformers' Mistral3ForConditionalGeneration with random weights --
a Pixtral vision tower, a projector with a learned 2 x 2 patch merger and a Mistral LM. Images follow
PixtralImageProcessor and PixtralProcessor (transformers 5.24) as arithmetic: scaled down to `longest_edge`
(1540 px) if larger, each side rounded up to 28 px, each row of [IMG] tokens closed by [IMG_BREAK] ([IMG_END] last). The
images are square (`data.image_size` a side); image_sizes is a constant input (models/fake_constants.py). The
tower runs all images of a micro batch as one sequence, with a (1, 1, N, N) block mask under sdpa and eager
(cu_seqlens under flash_attention_2). Towers: vision = the Pixtral tower; lm = the language model and lm_head;
the projector belongs to neither. Tied head: `model=hf` follows transformers 5.24, which reads
`tie_word_embeddings` from the config's top level (default true); the shipped YAML sets it false.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor

__all__ = ["Mistral3Spec", "pixtral_grid", "resized_side", "TEKKEN_IMAGE_BREAK", "TEKKEN_IMAGE_END"]

# [IMG_BREAK] and [IMG_END] of Mistral's tekken tokenizer (its tokenizer files, not config.json): what model=hf
# writes; their values do not change memory
TEKKEN_IMAGE_BREAK, TEKKEN_IMAGE_END = 12, 13


def resized_side(side: int, longest_edge: int, cell: int) -> int:
    """The side of a `side` x `side` image after PixtralImageProcessor (get_resize_output_image_size, with
    PixtralProcessor's patch size `cell` = patch x merge): scaled down to `longest_edge` where longer (floored, as
    the processor floors), then rounded up to a whole number of cells."""
    ratio = side / longest_edge
    if ratio > 1:
        side = int(math.floor(side / ratio))
    return ((side - 1) // cell + 1) * cell


def pixtral_grid(height: int, width: int, longest_edge: int, cell: int) -> tuple[int, int]:
    """(rows, cols) of `cell` px cells of one `height` x `width` image after PixtralImageProcessor's resize
    (transformers 5.25 image_processing_pil_pixtral.py get_resize_output_image_size): scaled down by the larger
    side's ratio to `longest_edge` where longer (each side floored), then each side up to whole cells."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return (height - 1) // cell + 1, (width - 1) // cell + 1


class Mistral3Spec(ModelSpec):
    """Hydra target for conf/model/mistral3_*.yaml and mistral_small_*.yaml."""

    model_class = "Mistral3ForConditionalGeneration"
    size_decides_tokens = True

    def __init__(self, name: str, vision: dict, text: dict, image_size: int, longest_edge: int, spatial_merge_size: int,
                 image_token_id: int, image_break_token_id: int, image_end_token_id: int, projector_hidden_act: str,
                 vision_feature_layer: int | list[int], multimodal_projector_bias: bool, tie_word_embeddings: bool,
                 attn_implementation: str = "sdpa"):
        self.name = name
        self.vision = dict(vision)
        self.text = dict(text)
        self.native_image_size = image_size  # the model takes any size: the default side
        self.longest_edge = longest_edge
        self.spatial_merge_size = spatial_merge_size
        self.image_token_id = image_token_id
        self.image_break_token_id = image_break_token_id
        self.image_end_token_id = image_end_token_id
        self.projector_hidden_act = projector_hidden_act
        self.vision_feature_layer = vision_feature_layer
        self.multimodal_projector_bias = multimodal_projector_bias
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_implementation = attn_implementation

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of a Mistral3 config.json (`raw`), read through transformers' Mistral3Config (what
        from_pretrained builds, its tied-head default included). preprocessor_config.json's size.longest_edge
        where there is one, else the tower's image_size (1540 in Mistral-Small-3.1's, the same figure); the
        default side is the smaller of that edge and 1024 px."""
        from transformers import Mistral3Config

        config = Mistral3Config(**raw)
        edge = ((preprocessor or {}).get("size") or {}).get("longest_edge") or config.vision_config.image_size
        return cls(name=name, vision=hyperparameters(config.vision_config), text=hyperparameters(config.text_config),
                   image_size=min(edge, 1024), longest_edge=edge, spatial_merge_size=config.spatial_merge_size,
                   image_token_id=config.image_token_id, image_break_token_id=TEKKEN_IMAGE_BREAK,
                   image_end_token_id=TEKKEN_IMAGE_END, projector_hidden_act=config.projector_hidden_act,
                   vision_feature_layer=config.vision_feature_layer,
                   multimodal_projector_bias=config.multimodal_projector_bias,
                   tie_word_embeddings=config.tie_word_embeddings, attn_implementation=attn_implementation)

    # -- image geometry -------------------------------------------------------------------------------
    def cell(self) -> int:
        """Pixels per LM token per side: a patch times the merge."""
        return self.vision["patch_size"] * self.spatial_merge_size

    def pixel_side(self, data: DataShape) -> int:
        """Pixels per side the model sees for one image of this point (the processor's output size)."""
        return resized_side(self.image_size(data), self.longest_edge, self.cell())

    def image_tokens(self, data: DataShape) -> int:
        rows = self.pixel_side(data) // self.cell()
        if rows == 1 and data.batch_size * data.images_per_sample == 1:
            # get_image_features squeezes the batch's (1, 1, width) features to (width,) and its split then fails
            raise ConfigError(f"data.image_size={self.image_size(data)} is not allowed for {self.name} with one image "
                              f"in the micro batch: it is one LM token ({self.cell()} px or less), and transformers' "
                              f"Mistral3 forward fails on a batch of one image token; use a side above {self.cell()} px "
                              f"or more images")
        return data.images_per_sample * rows * (rows + 1)  # each row of [IMG] ends in [IMG_BREAK] / [IMG_END]

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: pixtral_grid's rows x cols cells (patch x merge px), one [IMG] each, each
        row closed by [IMG_BREAK] / [IMG_END]."""
        rows, cols = pixtral_grid(height, width, self.longest_edge, self.cell())
        return rows * (cols + 1)

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        return 1, " plus <s>"

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        from transformers import Mistral3Config

        return Mistral3Config(vision_config=dict(self.vision), text_config={**self.text, "use_cache": False},
                              image_token_index=self.image_token_id, spatial_merge_size=self.spatial_merge_size,
                              projector_hidden_act=self.projector_hidden_act,
                              vision_feature_layer=self.vision_feature_layer,
                              multimodal_projector_bias=self.multimodal_projector_bias,
                              tie_word_embeddings=self.tie_word_embeddings, attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_tower], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def _image_text(self, data: DataShape) -> list[int]:
        """Token ids of one image as PixtralProcessor writes it (replace_image_token)."""
        rows = self.pixel_side(data) // self.cell()
        text = ([self.image_token_id] * rows + [self.image_break_token_id]) * rows
        text[-1] = self.image_end_token_id
        return text

    def _sample(self, data: DataShape) -> tuple[list[int], list[int]]:
        """input_ids and labels of one sample: <s>, the images, then text."""
        prompt = [self.text.get("bos_token_id", 1)] + self._image_text(data) * data.images_per_sample
        # ordinary text ids lie above the image tokens (tekken's low ids are its control tokens)
        first = max(self.image_token_id, self.image_break_token_id, self.image_end_token_id) + 1
        return prompt_then_text(prompt, data.lm_max_length, self.text["vocab_size"], first)

    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        input_ids, labels = self._sample(data)
        n, side = data.batch_size * data.images_per_sample, self.pixel_side(data)
        return collated(data, device, input_ids, labels, lambda: {
            "pixel_values": torch.randn(n, self.vision.get("num_channels", 3), side, side, dtype=torch.float32,
                                        device=device),
            "image_sizes": constant_tensor([[side, side]] * n, device),
        })
