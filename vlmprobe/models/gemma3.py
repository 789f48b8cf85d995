"""Gemma 3 (4B and up): transformers' Gemma3ForConditionalGeneration with random weights -- a SigLIP vision
tower, a pooling projector and the Gemma 3 LM (5 sliding-window layers to 1 global one, tied head). Images follow
Gemma3ImageProcessor and Gemma3Processor: every image is resized to 896 x 896 px (pan-and-scan off) and pooled to
256 image tokens, 260 tokens with its markers. The batch carries token_type_ids (1 at the image tokens), with which
the LM's masks let an image's tokens attend to each other both ways, as on CUDA; input_ids and token_type_ids are
constant fakes (models/fake_constants.py). Towers: vision = `vision_tower`; lm = `language_model` + `lm_head`
(tied to the embedding); the projector belongs to neither.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor

__all__ = ["Gemma3Spec"]

NEWLINES = 1  # "\n\n" before <start_of_image> and after <end_of_image>: one token each in Gemma's vocabulary


class Gemma3Spec(ModelSpec):
    """Hydra target for conf/model/gemma3_*.yaml."""

    model_class = "Gemma3ForConditionalGeneration"

    def __init__(self, name: str, vision: dict, text: dict, mm_tokens_per_image: int, image_token_id: int,
                 boi_token_id: int, eoi_token_id: int, tie_word_embeddings: bool, attn_implementation: str = "sdpa"):
        self.name = name
        self.vision = dict(vision)
        self.text = dict(text)
        self.mm_tokens_per_image = mm_tokens_per_image
        self.image_token_id = image_token_id
        self.boi_token_id = boi_token_id
        self.eoi_token_id = eoi_token_id
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_implementation = attn_implementation
        self.native_image_size = vision["image_size"]  # the size the processor resizes every image to

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of a Gemma 3 config.json (`raw`), read through transformers' Gemma3Config (legacy rope keys
        and left-out sub-config fields as from_pretrained reads them). preprocessor_config.json is not needed:
        the processor resizes to the tower's image_size."""
        from transformers import Gemma3Config

        config = Gemma3Config(**raw)
        return cls(name=name, vision=hyperparameters(config.vision_config), text=hyperparameters(config.text_config),
                   mm_tokens_per_image=config.mm_tokens_per_image, image_token_id=config.image_token_id,
                   boi_token_id=config.boi_token_id, eoi_token_id=config.eoi_token_id,
                   tie_word_embeddings=config.tie_word_embeddings, attn_implementation=attn_implementation)

    # -- image geometry -------------------------------------------------------------------------------
    def image_tokens(self, data: DataShape) -> int:
        self.native_size_only(data, "Gemma3ImageProcessor resizes",
                              "pan-and-scan, off by default, crops only images longer than wide")
        return data.images_per_sample * self.mm_tokens_per_image

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """Any image: Gemma3ImageProcessor resizes it to the tower's size (pan-and-scan off), so
        mm_tokens_per_image."""
        return self.mm_tokens_per_image

    def _image_text(self) -> list[int]:
        """Token ids of one image as Gemma3Processor writes it; the newline ids are text (their value does not
        change memory)."""
        newline = [self.text.get("pad_token_id", 0)] * NEWLINES
        return [*newline, self.boi_token_id, *[self.image_token_id] * self.mm_tokens_per_image, self.eoi_token_id,
                *newline]

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        written = data.images_per_sample * len(self._image_text()) + 1  # + <bos>
        return written - self.image_tokens(data), " plus 4 markers each and <bos>"

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        from transformers import Gemma3Config

        return Gemma3Config(vision_config=dict(self.vision), text_config={**self.text, "use_cache": False},
                            mm_tokens_per_image=self.mm_tokens_per_image, image_token_index=self.image_token_id,
                            boi_token_index=self.boi_token_id, eoi_token_index=self.eoi_token_id,
                            tie_word_embeddings=self.tie_word_embeddings, attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_tower], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def _sample(self, data: DataShape) -> tuple[list[int], list[int]]:
        """input_ids and labels of one sample: <bos>, the images, then text."""
        prompt = [self.text.get("bos_token_id", 2)] + self._image_text() * data.images_per_sample
        # ordinary text ids lie below the image markers
        return prompt_then_text(prompt, data.lm_max_length,
                                min(self.boi_token_id, self.image_token_id, self.text["vocab_size"]))

    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        input_ids, labels = self._sample(data)
        b, size = data.batch_size, self.native_image_size
        return collated(data, device, input_ids, labels, lambda: {  # the forward reads token_type_ids too
            "token_type_ids": constant_tensor([[int(i == self.image_token_id) for i in input_ids]] * b, device),
            "pixel_values": torch.randn(b * data.images_per_sample, self.vision.get("num_channels", 3), size, size,
                                        dtype=torch.float32, device=device),
        })
