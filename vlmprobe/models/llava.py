"""LLaVA (1.5 and the llava-hf family): transformers' LlavaForConditionalGeneration with random weights -- a
CLIP or SigLIP vision tower, a 2-layer MLP projector and a causal LM. Images follow CLIPImageProcessor as LLaVA-1.5
configures it: resized and center-cropped to the tower's `image_size` (336 px), 576 image tokens each (the class
token dropped). A sample is `lm_max_length` tokens, no padding: <s>, the image tokens, then text; labels are -100
at <s> and the image tokens; attention_mask is None; the loss is the model's own. input_ids are constant fakes
for the image-token count check (vlmprobe/models/fake_constants.py). Towers: vision = the vision tower; lm = the
language model and lm_head; the projector belongs to neither. LLaVA-NeXT (llava_next.py) subclasses LlavaSpec.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape, ModelSpec, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated

__all__ = ["CLASS_TOKENS", "LlavaSpec"]

# Vision towers whose output sequence we know: patch tokens plus this many class tokens
CLASS_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}
STRATEGIES = ("default", "full")  # "default" drops the first token of the selected hidden states


class LlavaSpec(ModelSpec):
    """Hydra target for conf/model/llava_*.yaml."""

    # -- what differs between LLaVA and LLaVA-NeXT (a subclass overrides these) ------------------------------
    config_class = "LlavaConfig"  # transformers classes, by name (imported when a model is built)
    model_class = "LlavaForConditionalGeneration"

    def family_config(self) -> dict:
        """Config fields of the subclass's own (LLaVA-NeXT's tiling grid); none here."""
        return {}

    @classmethod
    def family_kwargs(cls, config) -> dict:
        """Spec arguments of the subclass's own, read from a transformers config; none here."""
        return {}

    def __init__(self, name: str, vision: dict, text: dict, image_token_id: int, projector_hidden_act: str,
                 vision_feature_layer: int | list[int], vision_feature_select_strategy: str,
                 multimodal_projector_bias: bool, tie_word_embeddings: bool, pad_token_id: int | None = None,
                 attn_implementation: str = "sdpa"):
        if vision.get("model_type") not in CLASS_TOKENS:
            raise ConfigError(f"model.vision.model_type={vision.get('model_type')!r} is not allowed for {name}: "
                              f"vlmprobe knows the image tokens of {', '.join(CLASS_TOKENS)} towers only")
        if vision_feature_select_strategy not in STRATEGIES:
            raise ConfigError(f"model.vision_feature_select_strategy={vision_feature_select_strategy!r} is not "
                              f"allowed for {name}: use one of {', '.join(STRATEGIES)}")
        self.name = name
        self.vision = dict(vision)
        self.text = dict(text)
        self.image_token_id = image_token_id
        self.pad_token_id = pad_token_id
        self.projector_hidden_act = projector_hidden_act
        self.vision_feature_layer = vision_feature_layer
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.multimodal_projector_bias = multimodal_projector_bias
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_implementation = attn_implementation
        self.native_image_size = vision["image_size"]  # the size the processor crops every image to

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of a LLaVA config.json (`raw`), read through transformers' config class (sub-configs it
        leaves out take their class defaults, as from_pretrained gives them). preprocessor_config.json is
        not needed: the crop (tile) size is the tower's image_size."""
        import transformers

        config = getattr(transformers, cls.config_class)(**raw)
        return cls(**cls.family_kwargs(config), name=name, vision=hyperparameters(config.vision_config), text=hyperparameters(config.text_config),
                   image_token_id=config.image_token_id, pad_token_id=getattr(config, "pad_token_id", None),
                   projector_hidden_act=config.projector_hidden_act, vision_feature_layer=config.vision_feature_layer,
                   vision_feature_select_strategy=config.vision_feature_select_strategy,
                   multimodal_projector_bias=config.multimodal_projector_bias,
                   tie_word_embeddings=config.tie_word_embeddings, attn_implementation=attn_implementation)

    # -- image geometry -------------------------------------------------------------------------------
    def tokens_per_image(self) -> int:
        """LM tokens of one tower-size image (LLaVA-NeXT: of one tile): the tower's output sequence (patches + class token), less the first
        token under the "default" strategy (LlavaProcessor: patches + num_additional_image_tokens - 1)."""
        patches = (self.vision["image_size"] // self.vision["patch_size"]) ** 2
        return patches + CLASS_TOKENS[self.vision["model_type"]] - (self.vision_feature_select_strategy == "default")

    def image_tokens(self, data: DataShape) -> int:
        self.native_size_only(data, "its processor resizes and center-crops",
                              "the tower's position embeddings cover that size only")
        return data.images_per_sample * self.tokens_per_image()

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        return 1, " plus <s>"

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        import transformers

        return getattr(transformers, self.config_class)(**self.family_config(), vision_config=dict(self.vision), text_config={**self.text, "use_cache": False},
                           image_token_id=self.image_token_id, pad_token_id=self.pad_token_id,
                           projector_hidden_act=self.projector_hidden_act,
                           vision_feature_layer=self.vision_feature_layer,
                           vision_feature_select_strategy=self.vision_feature_select_strategy,
                           multimodal_projector_bias=self.multimodal_projector_bias,
                           image_seq_length=self.tokens_per_image(), tie_word_embeddings=self.tie_word_embeddings,
                           attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_tower], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def _sample(self, data: DataShape) -> tuple[list[int], list[int]]:
        """input_ids and labels of one sample."""
        prompt = [self.text.get("bos_token_id", 1)] + [self.image_token_id] * self.image_tokens(data)
        # ordinary text ids lie below <image>
        return prompt_then_text(prompt, data.lm_max_length, min(self.image_token_id, self.text["vocab_size"]))

    def image_inputs(self, n_images: int, data: DataShape, device: torch.device) -> dict:
        """The image processor's outputs for `n_images` images of this point: pixel_values of the tower's size."""
        size = self.vision["image_size"]
        return {"pixel_values": torch.randn(n_images, self.vision.get("num_channels", 3), size, size,
                                            dtype=torch.float32, device=device)}

    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        input_ids, labels = self._sample(data)
        return collated(data, device, input_ids, labels,
                        lambda: self.image_inputs(data.batch_size * data.images_per_sample, data, device))
