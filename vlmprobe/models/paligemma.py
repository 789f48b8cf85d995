"""PaliGemma 2: transformers' PaliGemmaForConditionalGeneration with random weights -- a SigLIP-So400m vision
tower, a one-matrix projector and a Gemma 2 LM (soft-capped logits, tied head). Images follow PaliGemmaProcessor:
resized to the checkpoint's size (224, 448 or 896 px), (size / 14)^2 image tokens each; the images, <bos> and
"\\n" are the prefix (token_type_ids 0, labels -100, attended both ways) and the suffix fills the length.
input_ids and token_type_ids are constant fakes (models/fake_constants.py). Attention is eager only: transformers
5.x gives Gemma 2 no SDPA path and PaliGemma no flash path, so each layer keeps its (B, H, L, L) attention weights
for backward. Towers: vision = `vision_tower`; lm = `language_model` + `lm_head`; the projector belongs to neither.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor

__all__ = ["NEWLINE", "PaliGemmaSpec"]

NEWLINE = 108  # "\n" in Gemma's vocabulary: the end of the prefix (its value changes no byte)


class PaliGemmaSpec(ModelSpec):
    """Hydra target for conf/model/paligemma*.yaml."""

    model_class = "PaliGemmaForConditionalGeneration"

    def __init__(self, name: str, vision: dict, text: dict, projection_dim: int, image_token_id: int,
                 attn_implementation: str = "eager"):
        if text.get("model_type") == "gemma2" and attn_implementation != "eager":
            raise ConfigError(f"model.attn_implementation={attn_implementation!r} is not allowed for {name}: "
                              f"transformers gives Gemma 2's attention no SDPA path (its logit soft-capping) and "
                              f"PaliGemma no flash path (its two-way prefix mask); use eager")
        self.name = name
        self.vision = dict(vision)
        self.text = dict(text)
        self.projection_dim = projection_dim
        self.image_token_id = image_token_id
        self.attn_implementation = attn_implementation
        self.native_image_size = vision["image_size"]  # the size the processor resizes every image to

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of a PaliGemma config.json (`raw`), read through transformers' PaliGemmaConfig (fields it
        leaves out as from_pretrained reads them). preprocessor_config.json is not needed: the processor resizes
        to the tower's image_size. A Gemma 2 LM runs eager attention whatever model=hf's default says."""
        from transformers import PaliGemmaConfig

        config = PaliGemmaConfig(**raw)
        text = hyperparameters(config.text_config)
        if text.get("model_type") == "gemma2" and attn_implementation == "sdpa":
            attn_implementation = "eager"  # model=hf's default; the only one transformers builds this with
        return cls(name=name, vision=hyperparameters(config.vision_config), text=text,
                   projection_dim=config.projection_dim, image_token_id=config.image_token_id,
                   attn_implementation=attn_implementation)

    # -- image geometry -------------------------------------------------------------------------------
    def tokens_per_image(self) -> int:
        return (self.native_image_size // self.vision["patch_size"]) ** 2

    def image_tokens(self, data: DataShape) -> int:
        self.native_size_only(data, "PaliGemmaProcessor resizes",
                              "the checkpoint's size: another is another checkpoint")
        return data.images_per_sample * self.tokens_per_image()

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """Any image: PaliGemmaProcessor resizes it to the checkpoint's size, so tokens_per_image."""
        return self.tokens_per_image()

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        return 2, " plus <bos> and the prefix's newline"

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        from transformers import PaliGemmaConfig

        return PaliGemmaConfig(vision_config=dict(self.vision), text_config={**self.text, "use_cache": False},
                               projection_dim=self.projection_dim, image_token_index=self.image_token_id,
                               attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_tower], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def _sample(self, data: DataShape) -> tuple[list[int], list[int], list[int]]:
        """input_ids, labels and token_type_ids of one sample: the images, <bos> and "\\n" (the prefix), then
        the suffix."""
        prefix = [self.image_token_id] * self.image_tokens(data) + [self.text.get("bos_token_id", 2), NEWLINE]
        # ordinary text ids lie below the image token
        ids, labels = prompt_then_text(prefix, data.lm_max_length, min(self.image_token_id, self.text["vocab_size"]))
        return ids, labels, [0] * len(prefix) + [1] * (len(ids) - len(prefix))

    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        input_ids, labels, token_types = self._sample(data)
        b, size = data.batch_size, self.native_image_size
        return collated(data, device, input_ids, labels, lambda: {  # the forward reads token_type_ids too
            "token_type_ids": constant_tensor([token_types] * b, device),
            "pixel_values": torch.randn(b * data.images_per_sample, self.vision.get("num_channels", 3), size, size,
                                        dtype=torch.float32, device=device),
        })
