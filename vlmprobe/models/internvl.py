"""InternVL (3 and 2.5, the -hf checkpoints): transformers' InternVLForConditionalGeneration with random weights
-- an InternViT tower, a pixel-shuffle projector and a Qwen2 / Qwen2.5 LM. Images follow GotOcr2ImageProcessor with
InternVL's crop_to_patches, through transformers' own pure get_optimal_tiled_canvas: 1 to 12 tiles of 448 px on the
grid closest to the image's aspect ratio, plus a thumbnail where there is more than one; 256 image tokens per tile.
`data.image_size` is the input image's side (null = 448, one tile). input_ids are constant fakes for the image-token
count check. Towers: vision = `vision_tower`; lm = `language_model` + `lm_head`; the projector belongs to neither.

The InternVL repository's own format (`model_type: internvl_chat`: OpenGVLab/InternVL2-*, 2_5-*, 3-* without "-hf",
ms-swift's recipes) builds the same native model, mapped as transformers' convert_internvl_weights_to_hf.py maps it
(`native_of_chat`): tiles, thumbnail and tokens as the chat code's dynamic_preprocess; llm_config as Qwen2 / Qwen3 /
LLaMA, InternLM2 as LLaMA (the same parameter shapes). What cannot map is refused; the chat code's fused qkv,
interpolated position table and stochastic depth (activations only) are not modelled (docs/models.md).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, ModelSpec, dataset_samples, hyperparameters, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor
from vlmprobe.models.packing import packed, padded_or_packed, restarting_positions

__all__ = ["CHAT_LMS", "InternVLSpec", "native_of_chat"]

# internvl_chat: llm_config.architectures[0] as modeling_internvl_chat.py dispatches on it -> the transformers
# model_type built here (InternLM2 as LLaMA: the same parameter shapes, see the module docstring)
CHAT_LMS = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
            "InternLM2ForCausalLM": "internlm2"}
# InternLM2Config's defaults (the InternVL repository's internlm2/configuration_internlm2.py), for absent keys
INTERNLM2_DEFAULTS = {"vocab_size": 103168, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
                      "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                      "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
                      "bias": True, "rope_theta": 10000, "rope_scaling": None}
# InternVisionConfig's and InternVLChatConfig's defaults, for keys a config.json leaves out
VIT_DEFAULTS = {"patch_size": 14, "image_size": 224, "qkv_bias": False, "hidden_size": 3200, "num_attention_heads": 25,
                "intermediate_size": 12800, "qk_normalization": True, "num_hidden_layers": 48, "hidden_act": "gelu",
                "norm_type": "rms_norm", "layer_norm_eps": 1e-6, "dropout": 0.0, "attention_dropout": 0.0,
                "initializer_range": 0.02, "initializer_factor": 0.1}
CHAT_DEFAULTS = {"select_layer": -1, "force_image_size": None, "downsample_ratio": 0.5, "dynamic_image_size": False,
                 "use_thumbnail": False, "min_dynamic_patch": 1, "max_dynamic_patch": 6, "use_backbone_lora": 0,
                 "use_llm_lora": 0}
CHAT_IMAGE_TOKEN = {"qwen2": 151667, "internlm2": 92546}  # <IMG_CONTEXT> as convert_internvl_weights_to_hf.py sets it
LLM_BOOKKEEPING = ("auto_map", "attn_implementation", "_attn_implementation_autoset", "use_bfloat16", "use_flash_attn",
                   "moe_config", "rope_pos_id_version", "rope_pos_id_stride")  # no parameter or activation of the LM


class InternVLSpec(ModelSpec):
    """Hydra target for conf/model/internvl*.yaml."""

    model_class = "InternVLForConditionalGeneration"
    image_markers = 2  # <img> and </img> around each image's tokens (InternVLProcessor)

    def __init__(self, name: str, image_size: int, min_patches: int, max_patches: int, vision: dict, text: dict,
                 image_token_id: int, image_seq_length: int, downsample_ratio: float, projector_hidden_act: str,
                 vision_feature_layer: int, vision_feature_select_strategy: str, tie_word_embeddings: bool,
                 attn_implementation: str = "sdpa", use_thumbnail: bool = True, tile_size: int | None = None):
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
        self.use_thumbnail = use_thumbnail  # a thumbnail beside a grid of more than one tile
        self.tile = tile_size or self.vision["image_size"][0]  # px per tile (internvl_chat's force_image_size)

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of an InternVL config.json (`raw`) through transformers' InternVLConfig, with min / max
        tiles from preprocessor_config.json beside it (else InternVL's 1 and 12); an internvl_chat one as
        native_of_chat maps it."""
        from transformers import InternVLConfig

        if raw.get("model_type") == "internvl_chat":
            native, tiling = native_of_chat(raw, name)
            config = InternVLConfig(**native)
            vocab = config.text_config.vocab_size  # <IMG_CONTEXT> where the vocabulary holds it, else its last id
            return cls(name=name, vision=hyperparameters(config.vision_config),
                       text=hyperparameters(config.text_config),
                       image_token_id=config.image_token_id if 0 <= config.image_token_id < vocab else vocab - 1,
                       image_seq_length=config.image_seq_length,
                       downsample_ratio=config.downsample_ratio, projector_hidden_act=config.projector_hidden_act,
                       vision_feature_layer=config.vision_feature_layer,
                       vision_feature_select_strategy=config.vision_feature_select_strategy,
                       tie_word_embeddings=config.tie_word_embeddings, attn_implementation=attn_implementation,
                       **tiling)
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
        return cols * rows + 1 if cols * rows > 1 and self.use_thumbnail else cols * rows

    def image_tokens(self, data: DataShape) -> int:
        return data.images_per_sample * self.tiles(data) * self.image_seq_length

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: GotOcr2's get_optimal_tiled_canvas on (height, width) (transformers 5.25
        image_processing_pil_got_ocr2.py), a thumbnail beside more than one tile, image_seq_length tokens each."""
        return self.tiles_at(height, width) * self.image_seq_length

    def tiles_at(self, height: int, width: int) -> int:
        """Tiles of one `height` x `width` image, the thumbnail included."""
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        cols, rows = get_optimal_tiled_canvas((height, width), (self.tile, self.tile), self.min_patches,
                                              self.max_patches)
        return cols * rows + 1 if cols * rows > 1 and self.use_thumbnail else cols * rows

    size_decides_tokens = True

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        return self.image_markers * data.images_per_sample, " plus <img> and </img> each"

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

        def images() -> dict:
            return {"pixel_values": torch.randn(n, self.vision.get("num_channels", 3), self.tile, self.tile,
                                                dtype=torch.float32, device=device)}

        if data.packing:  # one row, positions restarting per sample (vlmprobe.models.packing)
            return packed(data, device, input_ids, labels,
                          lambda: {"position_ids": constant_tensor([restarting_positions(data)], device), **images()})
        return collated(data, device, input_ids, labels, images)

    def dataset_batch(self, samples: list[tuple[list[tuple[int, int]], int]], padded_length: int, data: DataShape,
                      device: torch.device) -> dict:
        """The inputs of one micro batch of a dataset's samples (vlmprobe.point.dataset_steps): per image its tiles
        (tiles_at: GotOcr2's canvas and the thumbnail) as pixel_values rows of the tile's size, float32, and
        <img>, image_seq_length tokens a tile, </img> in the prompt (InternVLProcessor), then the sample's text;
        right-padded to `padded_length` with the pad token, mask 0 and labels -100 at the pads (transformers 5.25's
        DataCollatorForSeq2Seq); with data.packing one row of the samples end to end, positions restarting per
        sample (vlmprobe.models.packing)."""
        start, end = self.text.get("bos_token_id") or 1, self.text.get("eos_token_id") or 2  # <img>, </img>, as batch()
        tiles = [[self.tiles_at(height, width) for height, width in images] for images, _ in samples]
        prompts = [[token for count in counts
                    for token in (start, *[self.image_token_id] * (count * self.image_seq_length), end)]
                   for counts in tiles]
        rows = dataset_samples(self.name, prompts, [tokens for _, tokens in samples],
                               min(self.image_token_id, self.text["vocab_size"]))
        batch = padded_or_packed(rows, {"input_ids": self.text.get("pad_token_id") or 0, "labels": IGNORE_INDEX},
                                 padded_length, data.packing, device)
        if count := sum(map(sum, tiles)):
            batch["pixel_values"] = torch.randn(count, self.vision.get("num_channels", 3), self.tile, self.tile,
                                                dtype=torch.float32, device=device)
        return batch


def native_of_chat(raw: dict, name: str) -> tuple[dict, dict]:
    """(transformers' InternVLConfig keyword arguments, the spec's tiling arguments) of an internvl_chat
    config.json `raw`; ConfigError (one line) for what does not map (see the module docstring)."""
    top = {**CHAT_DEFAULTS, **raw}
    where = f"in {name}'s internvl_chat config.json"
    for key in ("use_backbone_lora", "use_llm_lora"):
        if top[key]:
            raise ConfigError(f"{key}={top[key]!r} {where} is not allowed: LoRA baked into the model is not mapped; "
                              f"use 0 and vlmprobe's train.lora_r / train.lora_towers")
    vit = {**VIT_DEFAULTS, **(raw.get("vision_config") or {})}
    if vit.get("use_moe"):
        raise ConfigError(f"vision_config.use_moe={vit['use_moe']!r} {where} is not allowed: the published InternViT "
                          f"code has no mixture-of-experts layers to map; use false")
    if vit["norm_type"] not in ("rms_norm", "layer_norm"):
        raise ConfigError(f"vision_config.norm_type={vit['norm_type']!r} {where} is not allowed: use rms_norm or "
                          f"layer_norm")
    vision = {"model_type": "internvl_vision", "hidden_size": vit["hidden_size"],
              "num_hidden_layers": vit["num_hidden_layers"], "num_attention_heads": vit["num_attention_heads"],
              "intermediate_size": vit["intermediate_size"], "hidden_act": vit["hidden_act"],
              "attention_bias": vit["qkv_bias"], "use_qk_norm": vit["qk_normalization"], "norm_type": vit["norm_type"],
              "layer_norm_eps": vit["layer_norm_eps"], "layer_scale_init_value": vit["initializer_factor"],
              "attention_dropout": vit["attention_dropout"], "projection_dropout": vit["dropout"],
              "initializer_range": vit["initializer_range"], "image_size": [vit["image_size"]] * 2,
              "patch_size": [vit["patch_size"]] * 2, "num_channels": 3,  # InternViT's Conv2d takes 3 channels always
              "use_mean_pooling": True, "use_absolute_position_embeddings": True}
    tile, patch, ratio = top["force_image_size"] or vit["image_size"], vit["patch_size"], top["downsample_ratio"]
    merge = round(1 / ratio) if ratio > 0 else 0
    if merge < 1 or abs(merge * ratio - 1) > 1e-9 or tile % patch or (tile // patch) % merge:
        raise ConfigError(f"downsample_ratio={ratio} {where} is not allowed with {tile} px tiles of {patch} px "
                          f"patches: the pixel shuffle needs the tile's patch grid ({tile / patch:g}) to be a multiple "
                          f"of 1 / downsample_ratio")
    text, kind = chat_llm(raw.get("llm_config") or {}, where)
    native = {"vision_config": vision, "text_config": text, "downsample_ratio": ratio, "projector_hidden_act": "gelu",
              "vision_feature_layer": top["select_layer"], "vision_feature_select_strategy": "default",
              "image_seq_length": int((tile // patch) ** 2 * ratio**2),
              "tie_word_embeddings": text["tie_word_embeddings"], "image_token_id": CHAT_IMAGE_TOKEN.get(kind, -1)}
    dynamic = top["dynamic_image_size"]
    tiling = {"image_size": tile, "tile_size": tile, "use_thumbnail": bool(top["use_thumbnail"]),
              "min_patches": top["min_dynamic_patch"] if dynamic else 1,
              "max_patches": top["max_dynamic_patch"] if dynamic else 1}
    return native, tiling


def chat_llm(llm: dict, where: str) -> tuple[dict, str]:
    """(transformers text_config keyword arguments, the chat LM's kind: a CHAT_LMS value) of an internvl_chat
    llm_config."""
    architecture = (llm.get("architectures") or [None])[0]
    if architecture not in CHAT_LMS:
        raise ConfigError(f"llm_config.architectures[0]={architecture!r} {where} is not allowed: vlmprobe maps "
                          f"the chat format's {', '.join(CHAT_LMS)} language models (InternLM2 as LLaMA, transformers "
                          f"5.25 having no InternLM2)")
    kind = CHAT_LMS[architecture]
    if kind != "internlm2":  # the chat code builds transformers' class from llm_config as it is (4.x: untied default)
        return {k: v for k, v in llm.items() if k not in LLM_BOOKKEEPING} | {
            "model_type": kind, "tie_word_embeddings": llm.get("tie_word_embeddings", False)}, kind
    lm = {k: llm.get(k, default) for k, default in INTERNLM2_DEFAULTS.items()}
    bias, scaling = lm.pop("bias"), lm.pop("rope_scaling")
    lm["num_key_value_heads"] = lm["num_key_value_heads"] or lm["num_attention_heads"]
    return lm | {"model_type": "llama", "attention_bias": bias, "mlp_bias": False,
                 **({"rope_scaling": scaling} if scaling else {})}, kind
