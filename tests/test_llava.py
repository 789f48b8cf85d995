"""LLaVA-1.5: exact sizes from the config, the processor's image arithmetic against the real image processor
and the model's own image features, consistent inputs, and image sizes the model cannot see refused.
(Estimate vs cpu and the knobs: test_families.py.)"""

import pytest
import torch

from hand_counts import clip_vision_params, llama_params
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params

CPU = torch.device("cpu")


# 7,063,427,072: the Hub's safetensors count of llava-hf/llava-1.5-7b-hf ("7.06B"); llava-hf/llava-v1.6-mistral-7b-hf's
# page says "7.57B" (both recalled, no hub access here); each equal to the hand count of its parts below. LLaVA-NeXT
# adds the image_newline vector (one LM width) to LLaVA's parts.
@pytest.mark.parametrize("name,total,parts,newline", [
    ("llava_1_5_7b", 7_063_427_072, (303_507_456, 20_979_712, 6_607_605_760, 131_334_144), 0),
    ("llava_v1_6_mistral_7b", 7_566_747_648, (303_507_456, 20_979_712, 7_110_922_240, 131_334_144), 4096),  # Mistral LM
])
def test_published_llava_models_on_meta_match_the_hand_count_of_their_config(spec, name, total, parts, newline):
    llava = spec(name)
    model = llava.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (total, total)
    modules = (model.model.vision_tower, model.model.multi_modal_projector, model.model.language_model, model.lm_head)
    assert tuple(count_params(m)[0] for m in modules) == parts and total == sum(parts) + newline
    assert count_params(model.model.vision_tower)[0] == clip_vision_params(llava.vision)
    assert count_params(model.model.language_model)[0] == llama_params(llava.text)  # Mistral has Llama's layout
    d_v, d = llava.vision["hidden_size"], llava.text["hidden_size"]
    assert count_params(model.model.multi_modal_projector)[0] == (d_v * d + d) + (d * d + d)  # 2-layer MLP
    assert newline == (d if hasattr(model.model, "image_newline") else 0)


def test_a_336_px_image_is_576_tokens_and_the_tiny_one_16(spec):
    llava = spec("llava_1_5_7b")
    assert llava.image_tokens(DataShape(1, 1024)) == 576  # (336 / 14)^2, class token dropped
    batch = llava.batch(DataShape(batch_size=2, lm_max_length=1024), CPU)  # the inputs alone: no model built
    assert ((batch["input_ids"] == 32000).sum(dim=1) == 576).all() and batch["pixel_values"].shape == (2, 3, 336, 336)
    assert spec("llava_1_5_7b").image_tokens(DataShape(1, 2048, images_per_sample=3)) == 3 * 576
    assert spec("llava_tiny").image_tokens(DataShape(1, 64)) == 16  # (56 / 14)^2


@pytest.mark.parametrize("extra,tokens", [
    ([], 16),                                                                      # CLIP, class token dropped
    (["model.vision_feature_select_strategy=full"], 17),                           # CLIP, class token kept
    (["model.vision.model_type=siglip_vision_model", "~model.vision.projection_dim"], 15),  # no class token: first patch dropped
    (["model.vision.model_type=siglip_vision_model", "~model.vision.projection_dim",
      "model.vision_feature_select_strategy=full"], 16),
])
def test_image_tokens_are_what_the_models_vision_features_have(spec, extra, tokens):
    llava = spec("llava_tiny", *extra)
    model = llava.build("cpu", torch.float32)
    pixel_values = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    assert [f.shape[0] for f in features] == [tokens, tokens]
    assert llava.image_tokens(DataShape(1, 64)) == tokens


def test_pixel_values_have_the_shape_the_real_image_processor_gives(spec):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    clip = pytest.importorskip("transformers.models.clip.image_processing_pil_clip")
    # llava-hf/llava-1.5-7b-hf's preprocessor_config.json: resize the shortest edge to 336, center-crop 336 x 336
    processor = clip.CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    real = processor(images=[image.fromarray(np.zeros((500, 400, 3), dtype=np.uint8))] * 2, return_tensors="pt")
    tiny = spec("llava_tiny", "model.vision.image_size=336")  # the 7B's geometry on a tiny tower
    ours = tiny.batch(DataShape(batch_size=2, lm_max_length=600), CPU)
    assert ours["pixel_values"].shape == real["pixel_values"].shape == (2, 3, 336, 336)
    assert ours["pixel_values"].dtype == real["pixel_values"].dtype


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("llava_tiny")
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=48, images_per_sample=2), CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (3, 48)
    image = ids == tiny.image_token_id
    assert (image.sum(dim=1) == 32).all() and image[:, 1:33].all()  # <s>, then the 2 x 16 image tokens
    assert (ids[:, 0] == tiny.text["bos_token_id"]).all() and (ids[:, 33:] < tiny.image_token_id).all()
    assert (labels[:, :33] == IGNORE_INDEX).all() and torch.equal(labels[:, 33:], ids[:, 33:])
    assert batch["pixel_values"].shape == (6, 3, 56, 56)


# -- a Pixtral tower (Pixtral-12B: model_type llava, vision_config pixtral) --------------------------------------

# mistral-community/pixtral-12b's config.json as transformers records it (no hub access here):
# tests/models/llava/test_configuration_llava.py's test_pixtral_reload sub-configs, with the top-level fields that
# models/pixtral/convert_pixtral_weights_to_hf.py writes; the 2024 file has no multimodal_projector_bias key
PIXTRAL_12B_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 10,
    "image_seq_length": 1, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
    "vision_config": {"model_type": "pixtral", "head_dim": 64, "hidden_act": "silu", "image_size": 1024,
                      "is_composition": True, "patch_size": 16, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "text_config": {"model_type": "mistral", "hidden_size": 5120, "head_dim": 128, "num_attention_heads": 32,
                    "intermediate_size": 14336, "is_composition": True, "max_position_embeddings": 1024000,
                    "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
}


def pixtral_text(rows: int, cols: int) -> list[int]:
    """PixtralProcessor.replace_image_token (transformers 5.25) for [IMG] = 10, [IMG_BREAK] = 12, [IMG_END] = 13:
    `rows` rows of `cols` [IMG], each closed by a break, the last break replaced by the end."""
    text = [t for _ in range(rows) for t in [10] * cols + [12]]
    return text[:-1] + [13]


# 12,682,739,712: Mistral's "12B parameter multimodal decoder + 400M parameter vision encoder" (the Pixtral-12B
# announcement); the Hub page of mistral-community/pixtral-12b says "12.7B" (recalled, no hub access)
def test_pixtral_12b_on_meta_matches_the_hand_count_of_its_config_and_the_published_figures(spec):
    from test_mistral3 import pixtral_params

    pixtral = spec("pixtral_12b")
    model = pixtral.build("meta", torch.bfloat16, init=False)
    modules = (model.model.vision_tower, model.model.multi_modal_projector, model.model.language_model, model.lm_head)
    parts = tuple(count_params(m)[0] for m in modules)
    d_v, d, vocab = pixtral.vision["hidden_size"], pixtral.text["hidden_size"], pixtral.text["vocab_size"]
    assert parts == (pixtral_params(pixtral.vision), (d_v * d + d) + (d * d + d), llama_params(pixtral.text), vocab * d)
    assert parts == (403_489_792, 31_467_520, 11_576_693_760, 671_088_640)
    assert count_params(model) == (sum(parts), sum(parts)) and sum(parts) == 12_682_739_712
    assert round(parts[0], -8) == 400_000_000 and round(parts[2] + parts[3], -9) == 12_000_000_000


@pytest.mark.parametrize("preprocessor", [None, {"image_processor_type": "PixtralImageProcessor",
                                                 "size": {"longest_edge": 512}, "patch_size": {"height": 16, "width": 16}}])
def test_the_pixtral_12b_config_json_builds_what_its_shipped_yaml_builds(spec, tmp_path, preprocessor):
    import json

    (tmp_path / "config.json").write_text(json.dumps(PIXTRAL_12B_CONFIG))
    if preprocessor:  # Pixtral-12B's own says 1024; a smaller edge shows where the spec reads it
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    from_json, from_yaml = spec("hf", f"model.config={tmp_path}"), spec("pixtral_12b")
    json_model, yaml_model = (s.build("meta", torch.bfloat16, init=False) for s in (from_json, from_yaml))
    assert [(n, p.shape) for n, p in json_model.named_parameters()] == [
        (n, p.shape) for n, p in yaml_model.named_parameters()]
    assert count_params(json_model)[0] == 12_682_739_712
    fields = ("image_token_id", "image_break_token_id", "image_end_token_id", "vision_feature_layer",
              "vision_feature_select_strategy", "multimodal_projector_bias", "tie_word_embeddings")
    assert [getattr(from_json, f) for f in fields] == [getattr(from_yaml, f) for f in fields] == [
        10, 12, 13, -1, "full", True, False]
    # the longest edge: preprocessor_config.json's where there is one (512 here), else the tower's 1024
    edge = 512 if preprocessor else 1024
    assert (from_json.longest_edge, from_json.native_image_size) == (edge, edge)
    assert from_json.image_tokens(DataShape(1, 8192, image_size=2000)) == edge // 16 * (edge // 16 + 1)


# sides: one patch and below, around a 16 px patch, odd, at and past the 1024 px edge (floored there as the
# processor floors)
PIXTRAL_SIDES = [1, 15, 16, 17, 333, 1000, 1023, 1024, 1025, 3001]


def test_pixtral_pixels_and_tokens_are_what_the_real_pixtral_image_processor_gives(spec):
    import numpy as np

    pytest.importorskip("PIL.Image")
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    # Pixtral-12B's: longest edge 1024; PixtralProcessor hands it patch 16 x merge 1 = 16 px
    processor = PixtralImageProcessorPil(size={"longest_edge": 1024}, patch_size={"height": 16, "width": 16})
    pixtral = spec("pixtral_12b")
    for side in PIXTRAL_SIDES:
        real = processor(images=[Image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))], return_tensors="pt")
        (height, width), = real["image_sizes"].tolist()
        data = DataShape(batch_size=1, lm_max_length=4200, image_size=side)
        batch = pixtral.batch(data, CPU)
        assert pixtral.pixel_side(data) == height == width, side
        assert batch["pixel_values"].shape == real["pixel_values"].shape, side
        assert batch["image_sizes"].tolist() == real["image_sizes"].tolist(), side
        text = pixtral_text(height // 16, width // 16)  # the processor's text for that size
        assert pixtral.image_tokens(data) == len(text) and batch["input_ids"][0, 1:1 + len(text)].tolist() == text


def test_pixtral_image_tokens_are_what_the_models_vision_features_have(spec):
    tiny = spec("llava_pixtral_tiny")
    model = tiny.build("cpu", torch.float32)
    # side px, images in the micro batch, rows: one patch, an odd side rounded up, a side scaled to the 64 px edge
    for side, images, rows in [(16, 1, 1), (16, 2, 1), (32, 2, 2), (40, 1, 3), (40, 3, 3), (200, 2, 4)]:
        data = DataShape(batch_size=images, lm_max_length=64, image_size=side)
        batch = tiny.batch(data, CPU)
        with torch.no_grad():
            features = model.model.get_image_features(pixel_values=batch["pixel_values"],
                                                      image_sizes=batch["image_sizes"]).pooler_output
        assert [f.shape[0] for f in features] == [rows * rows] * images, side  # one feature per 16 px patch
        assert tiny.image_tokens(data) == rows * (rows + 1), side
        assert ((batch["input_ids"] == tiny.image_token_id).sum(dim=1) == rows * rows).all(), side


def test_pixtral_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("llava_pixtral_tiny")  # 32 px: 2 rows of 2 [IMG], a break after the first, the end after the second
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=40, images_per_sample=2), CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    image = pixtral_text(2, 2)
    assert image == [10, 10, 12, 10, 10, 13]
    assert ids.shape == labels.shape == (3, 40) and ids[:, :13].tolist() == [[1, *image, *image]] * 3
    assert (labels[:, :13] == IGNORE_INDEX).all() and torch.equal(labels[:, 13:], ids[:, 13:])
    assert (ids[:, 13:] > 13).all() and (ids < tiny.text["vocab_size"]).all()  # text ids above the image tokens
    assert batch["pixel_values"].shape == (6, 3, 32, 32) and batch["image_sizes"].tolist() == [[32, 32]] * 6


def test_pixtral_settings_that_cannot_work_are_refused_in_one_line(compose, plan_points):
    from vlmprobe.errors import ConfigError
    from vlmprobe.point.build import build_spec  # as the planner builds it: the family's ConfigError, one line

    def spec(name, *extra):
        return build_spec(compose([f"model={name}", *extra]).model)

    with pytest.raises(ConfigError, match=r"model.vision_feature_select_strategy='default' is not allowed for "
                                          r"llava_pixtral_tiny with a pixtral tower: it has no class token to drop"):
        spec("llava_pixtral_tiny", "model.vision_feature_select_strategy=default")
    with pytest.raises(ConfigError, match=r"model.longest_edge=1024 is not allowed for llava_tiny with a "
                                          r"clip_vision_model tower: it is a setting of Pixtral towers; use null"):
        spec("llava_tiny", "+model.longest_edge=1024")
    with pytest.raises(ConfigError, match=r"model.longest_edge=0 is not allowed for llava_pixtral_tiny: it must be"):
        spec("llava_pixtral_tiny", "model.longest_edge=0")
    # LLaVA-NeXT's tiling keeps CLIP / SigLIP towers
    with pytest.raises(ConfigError, match=r"model.vision.model_type='pixtral' is not allowed for llava_next_tiny: "
                                          r"vlmprobe knows the image tokens of clip_vision_model, siglip_vision_model "
                                          r"towers only"):
        spec("llava_next_tiny", "model.vision.model_type=pixtral")
    with pytest.raises(ConfigError, match=r"data.lm_max_length=4096 is too short for pixtral_12b at 1024 px: the "
                                          r"images take 4160 tokens plus <s>, so it must be at least 4162"):
        plan_points(["model=pixtral_12b", "data.lm_max_length=4096", "data.image_size=1024"])
