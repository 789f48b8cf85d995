"""LLaVA-NeXT (LLaVA-1.6): transformers' LlavaNextForConditionalGeneration with random weights -- LLaVA's tower,
projector and LM (llava.py) plus anyres tiling and a learned `image_newline` vector (trained with the projector: it
belongs to neither tower). Images follow LlavaNextProcessor and LlavaNextImageProcessor (transformers 5.23) as pure
arithmetic: the best of the `image_grid_pinpoints` canvases (`select_best_resolution`), tiles of 336 px after a
base tile, the padding rows removed and one newline after each row (`anyres_tokens`, LlavaProcessor's
_get_number_of_features). Every image size is accepted, as the processor accepts it; the images are square
(`data.image_size` a side); image_sizes is a constant input (vlmprobe/models/fake_constants.py).
LLaVA-OneVision (llava_onevision.py) subclasses this spec.
"""

from __future__ import annotations

import math

import torch

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.models.fake_constants import constant_tensor
from vlmprobe.models.llava import CLASS_TOKENS, LlavaSpec

__all__ = ["anyres_tokens", "LlavaNextSpec", "select_best_resolution", "tiles"]

DEFAULT_IMAGE_SIZE = 336  # px per side when data.image_size is null and a config.json gives none: 1 + 2 tiles


def select_best_resolution(height: int, width: int, pinpoints: list) -> tuple[int, int]:
    """The (height, width) canvas LLaVA-NeXT resizes a `height` x `width` image into (transformers'
    image_processing_utils.select_best_resolution): the most of the image's pixels kept, then the fewest
    canvas pixels wasted; the first such canvas in the list."""
    best, kept_best, wasted_best = None, 0, float("inf")
    for canvas_h, canvas_w in pinpoints:
        scale = min(canvas_w / width, canvas_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_w * canvas_h - kept
        if kept > kept_best or (kept == kept_best and wasted < wasted_best):
            best, kept_best, wasted_best = (canvas_h, canvas_w), kept, wasted
    return best


def anyres_tokens(height: int, width: int, pinpoints: list, tile: int, patch: int, tile_tokens: int,
                  max_tiles: int | None = None) -> int:
    """LM tokens of one `height` x `width` image (LlavaNextProcessor._get_number_of_features): the base
    tile's `tile_tokens`, then the tiles' patch grid with the padding rows or columns removed, each row
    followed by a newline token. `max_tiles` is LLaVA-OneVision's "anyres_max_N" (N): where the unpadded grid
    holds more than 1.1^2 x N tiles' patches, the model shrinks it (bilinear) by the ratio's square root, each
    side rounded down (LlavaOnevisionProcessor._get_unpadded_features, the model's pack_image_features)."""
    canvas_h, canvas_w = select_best_resolution(height, width, pinpoints)
    side = tile // patch
    rows, cols = canvas_h // tile * side, canvas_w // tile * side
    if width / height > cols / rows:  # wider than the canvas: padding rows above and below
        rows -= (rows - int(round(height * (cols / width), 7))) // 2 * 2
    else:
        cols -= (cols - int(round(width * (rows / height), 7))) // 2 * 2
    if max_tiles is not None:
        ratio = math.sqrt(rows * cols / (max_tiles * side ** 2))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
    return tile_tokens + rows * (cols + 1)


def tiles(height: int, width: int, pinpoints: list, tile: int) -> int:
    """Tiles of the best canvas (LlavaNext's image_size_to_num_patches, less the base tile: it steps over the
    canvas in strides of a tile, so a canvas side that is not a whole number of tiles rounds up)."""
    canvas_h, canvas_w = select_best_resolution(height, width, pinpoints)
    return -(-canvas_h // tile) * -(-canvas_w // tile)


class LlavaNextSpec(LlavaSpec):
    """Hydra target for conf/model/llava_next_*.yaml and llava_v1_6_*.yaml."""

    config_class = "LlavaNextConfig"
    model_class = "LlavaNextForConditionalGeneration"
    max_tiles = None  # LLaVA-OneVision's cap on an image's unpadded grid, in tiles (anyres_tokens); none here

    def __init__(self, *, image_grid_pinpoints: list, image_size: int, **llava):
        super().__init__(**llava)
        if CLASS_TOKENS[self.vision["model_type"]] != int(self.vision_feature_select_strategy == "default"):
            # pack_image_features lays each tile's features out as a (tile / patch)^2 grid: "default" must drop
            # exactly CLIP's class token ("full" with CLIP, or "default" with SigLIP, breaks the model's view)
            raise ConfigError(f"model.vision_feature_select_strategy={self.vision_feature_select_strategy!r} is not "
                              f"allowed for {self.name} with a {self.vision['model_type']} tower: LLaVA-NeXT needs "
                              f"exactly the patch features of each tile (CLIP: default, SigLIP: full)")
        self.image_grid_pinpoints = [list(p) for p in image_grid_pinpoints]
        self.native_image_size = image_size  # the model takes any size: the default side

    def family_config(self) -> dict:
        return {"image_grid_pinpoints": self.image_grid_pinpoints}

    @classmethod
    def family_kwargs(cls, config) -> dict:
        return {"image_grid_pinpoints": config.image_grid_pinpoints, "image_size": DEFAULT_IMAGE_SIZE}

    # -- image geometry -------------------------------------------------------------------------------
    def image_tokens(self, data: DataShape) -> int:
        size = self.image_size(data)
        return data.images_per_sample * anyres_tokens(size, size, self.image_grid_pinpoints, self.vision["image_size"],
                                                      self.vision["patch_size"], self.tokens_per_image(),
                                                      self.max_tiles)

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: anyres_tokens (already (height, width)); LLaVA-OneVision's anyres_max_N
        through max_tiles."""
        return anyres_tokens(height, width, self.image_grid_pinpoints, self.vision["image_size"],
                             self.vision["patch_size"], self.tokens_per_image(), self.max_tiles)

    def tiles_per_image(self, data: DataShape) -> int:
        """Tiles the processor cuts one image of this point into: the base tile and the canvas's."""
        size = self.image_size(data)
        return 1 + tiles(size, size, self.image_grid_pinpoints, self.vision["image_size"])

    def image_inputs(self, n_images: int, data: DataShape, device: torch.device) -> dict:
        size, tile = self.image_size(data), self.vision["image_size"]
        return {"pixel_values": torch.randn(n_images, self.tiles_per_image(data), self.vision.get("num_channels", 3),
                                            tile, tile, dtype=torch.float32, device=device),
                "image_sizes": constant_tensor([[size, size]] * n_images, device)}
