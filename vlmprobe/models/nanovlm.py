"""nanoVLM: a SigLIP vision tower, a pixel-shuffle projector and a Llama-architecture LM.

Built from transformers parts (SiglipVisionModel without pooling head, LlamaForCausalLM), which gives
nanoVLM-222M's exact parameter count. As in nanoVLM's training code, the image tokens sit inside
`lm_max_length` (their placeholder embeddings are replaced by the projected image features), the LM
head runs over every position and the loss is cross-entropy with ignore_index -100.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape, ModelSpec

IGNORE_INDEX = -100


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """(B, S, D) patch features -> (B, S / factor^2, D * factor^2): each factor x factor block of the
    patch grid becomes one token, as nanoVLM's ModalityProjector does."""
    b, s, d = x.shape
    side = math.isqrt(s)
    x = x.view(b, side // factor, factor, side // factor, factor, d)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, s // factor**2, d * factor**2)


class NanoVLM(nn.Module):
    def __init__(self, vision_config, text_config, pixel_shuffle_factor: int):
        from transformers import LlamaForCausalLM, SiglipVisionModel

        super().__init__()
        self.pixel_shuffle_factor = pixel_shuffle_factor
        self.vision = SiglipVisionModel(vision_config)
        self.projector = nn.Linear(
            vision_config.hidden_size * pixel_shuffle_factor**2, text_config.hidden_size, bias=False
        )
        self.lm = LlamaForCausalLM(text_config)
        self.lm.tie_weights()

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        """Logits (B, L, V). The first `n` positions of each sample hold its n image tokens (nanoVLM puts
        the image before the prompt); a fixed slice keeps shapes static, which fake tensors need."""
        features = self.vision(pixel_values=pixel_values).last_hidden_state
        image_embeds = self.projector(pixel_shuffle(features, self.pixel_shuffle_factor))
        batch = input_ids.shape[0]
        image_embeds = image_embeds.reshape(batch, -1, image_embeds.shape[-1])
        token_embeds = self.lm.get_input_embeddings()(input_ids[:, image_embeds.shape[1]:])
        embeds = torch.cat([image_embeds.to(token_embeds.dtype), token_embeds], dim=1)
        # No attention mask: every synthetic sample fills lm_max_length, so the causal SDPA path needs none
        # (a mask would make transformers materialise a (B, 1, L, L) tensor that a padded-free run skips).
        return self.lm(inputs_embeds=embeds, attention_mask=None, use_cache=False).logits


class NanoVLMSpec(ModelSpec):
    """Hydra target for conf/model/nanovlm_*.yaml."""

    def __init__(self, name: str, vision: dict, text: dict, pixel_shuffle_factor: int, image_size: int,
                 attn_implementation: str = "sdpa"):
        self.name = name
        self.vision = dict(vision)
        self.text = dict(text)
        self.pixel_shuffle_factor = pixel_shuffle_factor
        self.native_image_size = image_size  # pixels per side the vision tower's position embeddings cover
        self.attn_implementation = attn_implementation

    def image_tokens(self, data: DataShape) -> int:
        size = self.image_size(data)
        if size != self.native_image_size:
            raise ConfigError(
                f"data.image_size={size} is not allowed for {self.name}: its vision tower takes "
                f"{self.native_image_size} px only (or null for that)"
            )
        patches = (size // self.vision["patch_size"]) ** 2
        return data.images_per_sample * patches // self.pixel_shuffle_factor**2

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.vision], "lm": [model.lm]}

    def _configs(self):
        from transformers import LlamaConfig, SiglipVisionConfig

        vision = SiglipVisionConfig(**self.vision, image_size=self.native_image_size, vision_use_head=False,
                                    attn_implementation=self.attn_implementation)
        text = LlamaConfig(**self.text, tie_word_embeddings=True, use_cache=False,
                           attn_implementation=self.attn_implementation)
        return vision, text

    def _construct(self) -> nn.Module:
        vision, text = self._configs()
        return NanoVLM(vision, text, self.pixel_shuffle_factor)

    def batch(self, data: DataShape, device: torch.device) -> dict:
        size = self.image_size(data)
        images = data.batch_size * data.images_per_sample
        n_image = self.image_tokens(data)
        vocab = self.text["vocab_size"]
        input_ids = torch.randint(0, vocab, (data.batch_size, data.lm_max_length), device=device)
        labels = input_ids.clone()
        labels[:, :n_image].fill_(IGNORE_INDEX)  # no loss on image positions
        pixel_values = torch.randn(images, self.vision.get("num_channels", 3), size, size, device=device)
        return {"input_ids": input_ids, "pixel_values": pixel_values, "labels": labels}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["input_ids"], batch["pixel_values"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                               ignore_index=IGNORE_INDEX)
