"""LLaVA (1.5 and the llava-hf family): transformers' LlavaForConditionalGeneration with random weights -- a
CLIP or SigLIP vision tower, a 2-layer MLP projector and a causal LM. Images follow CLIPImageProcessor as LLaVA-1.5
configures it: resized and center-cropped to the tower's `image_size` (336 px), 576 image tokens each (the class
token dropped). A sample is `lm_max_length` tokens, no padding: <s>, the image tokens, then text; labels are -100
at <s> and the image tokens; attention_mask is None; the loss is the model's own. input_ids are constant fakes
for the image-token count check (vlmprobe/models/fake_constants.py). Towers: vision = the vision tower; lm = the
language model and lm_head; the projector belongs to neither. LLaVA-NeXT (llava_next.py) subclasses LlavaSpec.

A Pixtral tower (Pixtral-12B: model_type llava with vision_config pixtral) takes images as PixtralImageProcessor and
PixtralProcessor write them (transformers 5.25 processing_pixtral.py, image_processing_pixtral.py; the arithmetic
is Mistral 3's, models/mistral3.py, without the merge): scaled down to `longest_edge` (1024 px) if larger, each
side rounded up to the 16 px patch, one [IMG] per patch, each row closed by [IMG_BREAK] ([IMG_END] last); square
images of `data.image_size` px, any size; pixel_values of that size and image_sizes, a constant input the tower and
get_image_features (modeling_llava.py) read to crop and split. vision_feature_select_strategy must be "full" (the
tower has no class token). LLaVA's own class only: LLaVA-NeXT and -OneVision keep CLIP / SigLIP towers.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.errors import ConfigError, whole
from vlmprobe.models.base import IGNORE_INDEX, DataShape, ModelSpec, dataset_samples, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor
from vlmprobe.models.mistral3 import TEKKEN_IMAGE_BREAK, TEKKEN_IMAGE_END, pixtral_grid, resized_side
from vlmprobe.models.packing import padded_or_packed

__all__ = ["CLASS_TOKENS", "LlavaSpec"]

# Vision towers whose output sequence we know: patch tokens plus this many class tokens
CLASS_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}
STRATEGIES = ("default", "full")  # "default" drops the first token of the selected hidden states
PIXTRAL = "pixtral"  # a Pixtral tower (Pixtral-12B): one sequence of all images' patches, no class token
PIXTRAL_ONLY = ("image_size", "longest_edge", "image_break_token_id", "image_end_token_id")  # spec fields of its own


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
                 attn_implementation: str = "sdpa", image_size: int | None = None, longest_edge: int | None = None,
                 image_break_token_id: int | None = None, image_end_token_id: int | None = None):
        # LLaVA's own class takes a Pixtral tower too; LLaVA-NeXT's tiling (the subclasses) has no Pixtral form
        known = (*CLASS_TOKENS, PIXTRAL) if self.model_class == LlavaSpec.model_class else tuple(CLASS_TOKENS)
        if vision.get("model_type") not in known:
            raise ConfigError(f"model.vision.model_type={vision.get('model_type')!r} is not allowed for {name}: "
                              f"vlmprobe knows the image tokens of {', '.join(known)} towers only")
        if vision_feature_select_strategy not in STRATEGIES:
            raise ConfigError(f"model.vision_feature_select_strategy={vision_feature_select_strategy!r} is not "
                              f"allowed for {name}: use one of {', '.join(STRATEGIES)}")
        self.pixtral = vision["model_type"] == PIXTRAL
        own = dict(zip(PIXTRAL_ONLY, (image_size, longest_edge, image_break_token_id, image_end_token_id)))
        given = [k for k, v in own.items() if v is not None]
        if given and not self.pixtral:
            raise ConfigError(f"model.{given[0]}={own[given[0]]!r} is not allowed for {name} with a "
                              f"{vision['model_type']} tower: it is a setting of Pixtral towers; use null")
        if self.pixtral and vision_feature_select_strategy != "full":
            # "default" drops the first patch of all images' one sequence: get_image_features' split then fails
            raise ConfigError(f"model.vision_feature_select_strategy={vision_feature_select_strategy!r} is not "
                              f"allowed for {name} with a pixtral tower: it has no class token to drop; use full")
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
        if self.pixtral:
            for key, value in (("image_size", image_size), ("longest_edge", longest_edge)):
                if value is not None and (not whole(value) or value <= 0):
                    raise ConfigError(f"model.{key}={value!r} is not allowed for {name}: it must be a positive "
                                      f"integer (px) or null")
            # the processor's longest edge: preprocessor_config.json's, else the tower's image_size (both 1024 in
            # Pixtral-12B); the default side: that edge, at most 1024 px (as Mistral 3's)
            self.longest_edge = longest_edge or vision["image_size"]
            self.native_image_size = image_size or min(self.longest_edge, 1024)
            self.size_decides_tokens = True
            # [IMG_BREAK] / [IMG_END]: the tekken tokenizer's where not given (what model=hf writes)
            self.image_break_token_id = TEKKEN_IMAGE_BREAK if image_break_token_id is None else image_break_token_id
            self.image_end_token_id = TEKKEN_IMAGE_END if image_end_token_id is None else image_end_token_id

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of a LLaVA config.json (`raw`), read through transformers' config class (sub-configs it
        leaves out take their class defaults, as from_pretrained gives them). preprocessor_config.json is
        not needed for CLIP / SigLIP: the crop (tile) size is the tower's image_size. A Pixtral tower's longest
        edge is preprocessor_config.json's size.longest_edge where there is one, else the tower's image_size;
        its [IMG_BREAK] / [IMG_END] ids are the tekken tokenizer's (not in config.json: the spec's defaults)."""
        import transformers

        config = getattr(transformers, cls.config_class)(**raw)
        pixtral = {}
        if config.vision_config.model_type == PIXTRAL and cls.model_class == LlavaSpec.model_class:
            pixtral = {"longest_edge": ((preprocessor or {}).get("size") or {}).get("longest_edge")}
        return cls(**cls.family_kwargs(config), **pixtral, name=name, vision=hyperparameters(config.vision_config),
                   text=hyperparameters(config.text_config),
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
        if self.pixtral:
            rows = self.pixel_side(data) // self.vision["patch_size"]
            return data.images_per_sample * rows * (rows + 1)  # each row of [IMG] ends in [IMG_BREAK] / [IMG_END]
        self.native_size_only(data, "its processor resizes and center-crops",
                              "the tower's position embeddings cover that size only")
        return data.images_per_sample * self.tokens_per_image()

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: CLIPImageProcessor resizes and crops every image to the tower's size, so
        tokens_per_image; a Pixtral tower: mistral3.pixtral_grid's rows x cols patches, each row closed by
        [IMG_BREAK] / [IMG_END] (PixtralImageProcessor, transformers 5.25 image_processing_pil_pixtral.py)."""
        if self.pixtral:
            rows, cols = pixtral_grid(height, width, self.longest_edge, self.vision["patch_size"])
            return rows * (cols + 1)
        return self.tokens_per_image()

    def pixel_side(self, data: DataShape) -> int:
        """Pixtral: pixels per side the tower sees for one image of this point (the processor's output size:
        PixtralProcessor hands the processor patch_size x spatial_merge_size = the tower's patch, merge 1)."""
        return resized_side(self.image_size(data), self.longest_edge, self.vision["patch_size"])

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
                           # Pixtral: 1, as Pixtral-12B's config.json (its processor counts each image; no model reads it)
                           image_seq_length=1 if self.pixtral else self.tokens_per_image(),
                           tie_word_embeddings=self.tie_word_embeddings,
                           attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision_tower], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def _image_text(self, data: DataShape) -> list[int]:
        """Pixtral: token ids of one image as PixtralProcessor writes it (replace_image_token)."""
        rows = self.pixel_side(data) // self.vision["patch_size"]
        text = ([self.image_token_id] * rows + [self.image_break_token_id]) * rows
        text[-1] = self.image_end_token_id
        return text

    def _sample(self, data: DataShape) -> tuple[list[int], list[int]]:
        """input_ids and labels of one sample."""
        if self.pixtral:
            prompt = [self.text.get("bos_token_id", 1)] + self._image_text(data) * data.images_per_sample
            # ordinary text ids lie above the image tokens (tekken's low ids are its control tokens)
            first = max(self.image_token_id, self.image_break_token_id, self.image_end_token_id) + 1
            return prompt_then_text(prompt, data.lm_max_length, self.text["vocab_size"], first)
        prompt = [self.text.get("bos_token_id", 1)] + [self.image_token_id] * self.image_tokens(data)
        # ordinary text ids lie below <image>
        return prompt_then_text(prompt, data.lm_max_length, min(self.image_token_id, self.text["vocab_size"]))

    def image_inputs(self, n_images: int, data: DataShape, device: torch.device) -> dict:
        """The image processor's outputs for `n_images` images of this point: pixel_values of the tower's size
        (Pixtral: of the processor's output size, with their image_sizes)."""
        if self.pixtral:
            side = self.pixel_side(data)
            return {"pixel_values": torch.randn(n_images, self.vision.get("num_channels", 3), side, side,
                                                dtype=torch.float32, device=device),
                    "image_sizes": constant_tensor([[side, side]] * n_images, device)}
        size = self.vision["image_size"]
        return {"pixel_values": torch.randn(n_images, self.vision.get("num_channels", 3), size, size,
                                            dtype=torch.float32, device=device)}

    def dataset_batch(self, samples: list[tuple[list[tuple[int, int]], int]], padded_length: int, data: DataShape,
                      device: torch.device) -> dict:
        """The inputs of one micro batch of a dataset's samples (vlmprobe.point.dataset_steps; LLaVA 1.5's CLIP
        tower): `samples` holds each sample's images ((height, width) px) and its LM tokens after truncation. The
        processor resizes every image to the tower's size, so each image is tokens_per_image <image> tokens after
        <s>, then the sample's text; each sample is right-padded to `padded_length` with the pad token, mask 0 and
        labels -100 at the pads (LLaVA's train.py DataCollatorForSupervisedDataset, which ShareGPT4V trains with,
        pads right; transformers' DataCollatorForSeq2Seq pads on the tokenizer's side: the same shapes).
        pixel_values: every image of the batch, float32, as CLIPImageProcessor returns them."""
        if self.pixtral:
            raise ConfigError(f"model={self.name} is not allowed with data.source: a Pixtral tower's batches are not "
                              f"built from a dataset yet")
        bos, per_image = self.text.get("bos_token_id", 1), self.tokens_per_image()
        rows = dataset_samples(self.name, [[bos] + [self.image_token_id] * per_image * len(sizes)
                                           for sizes, _ in samples], [tokens for _, tokens in samples],
                               min(self.image_token_id, self.text["vocab_size"]))
        batch = padded_or_packed(rows, {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX}, padded_length,
                                 False, device)
        images = sum(len(sizes) for sizes, _ in samples)
        if images:
            batch.update(self.image_inputs(images, data, device))
        return batch

    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        input_ids, labels = self._sample(data)
        return collated(data, device, input_ids, labels,
                        lambda: self.image_inputs(data.batch_size * data.images_per_sample, data, device))
