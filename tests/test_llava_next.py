"""LLaVA-NeXT: the anyres arithmetic (canvas, tiles, unpadding, newlines) against
the real LlavaNextProcessor built offline and against the model's own packed image features, consistent
inputs, and what the model cannot take refused. (Parameter count: test_llava.py; estimate vs cpu and the knobs:
test_families.py; config.json: test_hf.py.)"""

import pytest
import torch

from conftest import image_features_of
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape
from vlmprobe.models.llava_next import anyres_tokens

CPU = torch.device("cpu")
PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # llava-v1.6's canvases


@pytest.fixture(scope="module")
def processor():
    """LlavaNextProcessor as llava-hf/llava-v1.6-mistral-7b-hf configures it (preprocessor_config.json: shortest
    edge 336, crop 336 x 336, the 5 canvases; processor: patch 14, "default", CLIP's class token), with a
    one-word tokenizer built offline (the processor only counts the <image> tokens it writes)."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("PIL.Image")
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    images = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                        image_grid_pinpoints=PINPOINTS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"<image>": 0, "<unk>": 1}, unk_token="<unk>")))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


# (height, width): square, wide, tall, tiny, extreme, and sizes landing on each of the 5 canvases
SIZES = [(336, 336), (672, 672), (500, 300), (300, 500), (1, 1), (10, 2000), (2000, 10), (1000, 900), (337, 1100),
         (1100, 337), (800, 1600), (4000, 3000), (123, 457)]


def test_image_tokens_are_what_the_real_processor_counts_at_any_size_and_aspect_ratio(processor):
    for height, width in SIZES:
        ours = anyres_tokens(height, width, PINPOINTS, 336, 14, 576)
        real = processor._get_num_multimodal_tokens(image_sizes=[[height, width]])["num_image_tokens"][0]
        assert ours == real, (height, width)


@pytest.mark.parametrize("side,patches,tokens", [(336, 3, 1176), (672, 5, 2928), (100, 3, 1176), (1, 3, 1176)])
def test_pixel_values_image_sizes_and_tokens_are_what_the_real_processor_gives(spec, processor, side, patches, tokens):
    import numpy as np
    from PIL import Image

    real = processor(images=[Image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))], text=["<image>"],
                     return_tensors="pt")
    assert int((real["input_ids"] == 0).sum()) == tokens
    llava = spec("llava_next_tiny", "model.vision.image_size=336", f"model.image_grid_pinpoints={PINPOINTS}")
    data = DataShape(batch_size=1, lm_max_length=3000, image_size=side)
    assert llava.image_tokens(data) == tokens
    ours = llava.batch(data, CPU)  # the 7B's geometry on a tiny tower: the inputs alone, no model built
    assert ours["pixel_values"].shape == real["pixel_values"].shape == (1, patches, 3, 336, 336)
    assert ours["pixel_values"].dtype == real["pixel_values"].dtype
    assert ours["image_sizes"].tolist() == real["image_sizes"].tolist() == [[side, side]]
    assert int((ours["input_ids"] == llava.image_token_id).sum()) == tokens


@pytest.mark.parametrize("side", [56, 100, 150, 300])  # canvases 56 x 112, 112 x 112, 168 x 56... of the tiny
def test_image_tokens_are_what_the_models_packed_features_have(spec, side):
    llava = spec("llava_next_tiny")
    data = DataShape(batch_size=2, lm_max_length=400, image_size=side)
    assert image_features_of(llava, data)[0] == [llava.image_tokens(data)] * 2


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("llava_next_tiny")  # 56 px: a 56 x 112 canvas, base + 2 tiles, 16 + 4 x (4 + 1) = 36 tokens
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=80, images_per_sample=2), CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (3, 80)
    assert ((ids == tiny.image_token_id).sum(dim=1) == 72).all() and (ids[:, 1:73] == tiny.image_token_id).all()
    assert (labels[:, :73] == IGNORE_INDEX).all() and torch.equal(labels[:, 73:], ids[:, 73:])
    assert batch["pixel_values"].shape == (6, 3, 3, 56, 56) and batch["image_sizes"].tolist() == [[56, 56]] * 6


def test_a_feature_selection_that_breaks_the_tile_grid_is_refused(plan_points):
    with pytest.raises(ConfigError, match=r"model.vision_feature_select_strategy='full' is not allowed for "
                                          r"llava_next_tiny with a clip_vision_model tower: LLaVA-NeXT needs exactly "
                                          r"the patch features of each tile"):
        plan_points(["model=llava_next_tiny", "model.vision_feature_select_strategy=full"])


def test_any_image_size_is_taken_and_a_sequence_too_short_is_refused(plan_points):
    (point,) = plan_points(["model=llava_v1_6_mistral_7b", "data.image_size=1", "data.lm_max_length=2048"])  # the processor takes 1 x 1 px
    assert point.inputs["image_tokens"] == 1176
    (native,) = plan_points(["model=llava_v1_6_mistral_7b", "data.image_size=null", "data.lm_max_length=2048"])
    assert native.inputs["image_size"] == 336 and native.inputs["params"] == 7_566_747_648
    with pytest.raises(ConfigError, match=r"data.lm_max_length=2048 is too short for llava_v1_6_mistral_7b: the "
                                          r"images take 2928 tokens plus <s>, so it must be at least 2930"):
        plan_points(["model=llava_v1_6_mistral_7b", "data.image_size=672", "data.lm_max_length=2048"])
