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
