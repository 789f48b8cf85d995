"""Idefics3 and SmolVLM (v1): transformers' Idefics3ForConditionalGeneration with random weights -- a SigLIP-style
vision tower of variable resolution, a pixel-shuffle connector and a Llama LM; SmolVLM2 is the same code under
other class names (SmolVLMSpec). Images follow Idefics3ImageProcessor as pure arithmetic (`idefics3_tiles`): resized to
the processor's `size.longest_edge` (`data.image_size`; null = the shipped processor's), cut into tiles of the
tower's `image_size`, plus a global image. The forward reads pixel_values (to drop all-zero padding images) and the
patch mask from pixel_attention_mask: both are constant fakes (models/fake_constants.py). Towers: vision =
`vision_model`; lm = `text_model` + `lm_head`; the connector (the projector) belongs to neither.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor

__all__ = ["Idefics3Spec", "idefics3_tiles", "MAX_IMAGE_SIZE", "SmolVLMSpec"]

MAX_IMAGE_SIZE = 4096  # transformers' idefics3 / smolvlm image processors: no side beyond it ("4k resolution")


def idefics3_tiles(height: int, width: int, longest_edge: int, tile: int, splitting: bool = True) -> tuple[int, int]:
    """(rows, cols) of tiles Idefics3ImageProcessor cuts one `height` x `width` image into (0, 0: one tile, no
    global image): its resize (the longest edge to `longest_edge`, the other side made even, then below
    MAX_IMAGE_SIZE), resize_for_vision_encoder (whole tiles) and split_images (transformers 5.25
    image_processing_idefics3.py)."""
    if not splitting:
        return 0, 0
    aspect = width / height  # resize: the longest edge to `longest_edge`, the other side made even
    if width >= height:
        width, height = longest_edge, int(longest_edge / aspect)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height  # then below MAX_IMAGE_SIZE
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, max(int(MAX_IMAGE_SIZE / aspect), 1)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, max(int(MAX_IMAGE_SIZE * aspect), 1)
    aspect = width / height  # resize_for_vision_encoder: up to whole tiles
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height > tile or width > tile:
        return math.ceil(height / tile), math.ceil(width / tile)
    return 0, 0


class Idefics3Spec(ModelSpec):
    """Hydra target for conf/model/smolvlm_*.yaml (and idefics3_tiny)."""

    config_class = "Idefics3Config"  # transformers classes, by name (SmolVLM2's subclass names its own)
    model_class = "Idefics3ForConditionalGeneration"

    def __init__(self, name: str, image_size: int, do_image_splitting: bool, image_token_id: int, scale_factor: int,
                 vision: dict, text: dict, tie_word_embeddings: bool, attn_implementation: str = "sdpa"):
        self.name = name
        self.native_image_size = image_size  # the processor's size.longest_edge
        self.do_image_splitting = do_image_splitting
        self.image_token_id = image_token_id
        self.scale_factor = scale_factor
        self.vision = dict(vision)
        self.text = dict(text)
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_implementation = attn_implementation
        self.tile = self.vision["image_size"]

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of a config.json (`raw`) read through transformers' config class, with the processor's
        longest edge and splitting from preprocessor_config.json beside it (else 4 tiles per side, as
        SmolVLM ships: 4 x 512 for the 256M, 4 x 384 for SmolVLM-Instruct)."""
        import transformers

        config = getattr(transformers, cls.config_class)(**raw)
        tile = config.vision_config.image_size
        preprocessor = preprocessor or {}
        most = (preprocessor.get("max_image_size") or {}).get("longest_edge", tile)
        if most != tile:
            raise ConfigError(f"model.config of {name} is not allowed: its processor's max_image_size {most} differs "
                              f"from the tower's image_size {tile}, which vlmprobe cannot build inputs for (the "
                              f"processor's image tokens would not match the tower's features)")
        return cls(name=name, image_size=(preprocessor.get("size") or {}).get("longest_edge", 4 * tile),
                   do_image_splitting=preprocessor.get("do_image_splitting", True),
                   image_token_id=config.image_token_id, scale_factor=config.scale_factor,
                   vision=hyperparameters(config.vision_config), text=hyperparameters(config.text_config),
                   tie_word_embeddings=config.tie_word_embeddings, attn_implementation=attn_implementation)

    # -- image geometry -------------------------------------------------------------------------------
    def tokens_per_tile(self) -> int:
        """Idefics3Model.image_seq_len: the tile's patches after the pixel shuffle."""
        return (self.tile // self.vision["patch_size"]) ** 2 // self.scale_factor**2

    def grid(self, data: DataShape) -> tuple[int, int]:
        size = self.image_size(data)
        if size > MAX_IMAGE_SIZE:
            raise ConfigError(f"data.image_size={size} is not allowed for {self.name}: Idefics3ImageProcessor scales "
                              f"every image down to at most {MAX_IMAGE_SIZE} px per side, so the model never sees it; "
                              f"use at most {MAX_IMAGE_SIZE}")
        return idefics3_tiles(size, size, size, self.tile, self.do_image_splitting)  # resized to its side already

    def frames(self, data: DataShape) -> int:
        """Tiles of one image the tower runs on: rows x cols + the global image, or 1."""
        rows, cols = self.grid(data)
        return rows * cols + 1 if rows else 1

    def image_tokens(self, data: DataShape) -> int:
        return data.images_per_sample * self.frames(data) * self.tokens_per_tile()

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: idefics3_tiles' rows x cols tiles and the global image (or one tile), each
        tokens_per_tile."""
        rows, cols = idefics3_tiles(height, width, self.native_image_size, self.tile, self.do_image_splitting)
        return (rows * cols + 1 if rows else 1) * self.tokens_per_tile()

    def _image_text(self, rows: int, cols: int) -> list[int]:
        """Token ids of one image as Idefics3Processor writes it (transformers' own count,
        Idefics3Processor._get_num_multimodal_tokens, is the length of this list): markers and
        newlines are text tokens here (their ids do not change memory; "\\n\\n" is one token, as in SmolLM2's
        tokenizer)."""
        marker, image = self.text.get("bos_token_id") or 1, [self.image_token_id] * self.tokens_per_tile()
        ids = []
        for _ in range(rows):
            for _ in range(cols):
                ids += [marker, marker, *image]  # <fake_token_around_image><row_r_col_c>, the tile's tokens
            ids.append(marker)  # "\n" (after the last row "\n\n", which opens the global image: one token)
        ids += [marker, marker, *image, marker]  # <fake_token_around_image><global-img> ... <fake_token_around_image>
        return ids

    size_decides_tokens = True

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        written = data.images_per_sample * len(self._image_text(*self.grid(data))) + 1  # + <|im_start|>
        return written - self.image_tokens(data), " plus the processor's tile markers"

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        import transformers

        return getattr(transformers, self.config_class)(
            vision_config=dict(self.vision), text_config={**self.text, "use_cache": False},
            image_token_id=self.image_token_id, scale_factor=self.scale_factor, tie_word_embeddings=self.tie_word_embeddings, attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_model], "lm": [model.model.text_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def _sample(self, data: DataShape) -> tuple[list[int], list[int]]:
        """input_ids and labels of one sample: a start token, the images, then text."""
        prompt = [self.text.get("bos_token_id") or 1] + self._image_text(*self.grid(data)) * data.images_per_sample
        # ordinary text ids lie below <image>
        return prompt_then_text(prompt, data.lm_max_length, min(self.image_token_id, self.text["vocab_size"]))

    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        input_ids, labels = self._sample(data)
        b, frames = data.batch_size, data.images_per_sample * self.frames(data)
        pixels = (b, frames, self.vision.get("num_channels", 3), self.tile, self.tile)
        # The forward reads pixel_values (all-zero images are padding) and the pixel mask: both constant
        # while the batch lives, so the limit covers them as well as the token count
        return collated(data, device, input_ids, labels, lambda: {
            # content does not change memory; no image is all zeros (a padding image)
            "pixel_values": constant_tensor(np.full(pixels, 0.5, dtype=np.float32), device, torch.float32),
            "pixel_attention_mask": constant_tensor(np.ones((b, frames, self.tile, self.tile), dtype=np.int64), device),
        }, limit=math.prod(pixels))


class SmolVLMSpec(Idefics3Spec):
    """SmolVLM2 (model_type smolvlm): Idefics3's architecture and processor under SmolVLM class names."""

    config_class = "SmolVLMConfig"
    model_class = "SmolVLMForConditionalGeneration"
