"""LLaVA-OneVision: exact size from the config, the anyres_max_9 arithmetic (the cap that shrinks a large
image's features) and the several-images case against the real LlavaOnevisionProcessor and against the model's
own packed image features, and what the model cannot take refused. (Estimate vs cpu and the knobs:
test_families.py; config.json: test_hf.py.)"""

import pytest
import torch

from hand_counts import qwen2_params, siglip_params
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params
from vlmprobe.models.llava_next import anyres_tokens

CPU = torch.device("cpu")
PINPOINTS = [[h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)]  # 1-6 x 1-6 tiles of 384 px


@pytest.fixture(scope="module")
def processor():
    """LlavaOnevisionProcessor as llava-hf/llava-onevision-qwen2-7b-ov-hf configures it (384 x 384 tiles, the 36
    canvases, 729 tokens per tile, "full", anyres_max_9), with a word-level tokenizer built offline. Its own
    __init__ wants a video processor, which needs torchvision: only the attributes its image-token arithmetic
    and __call__ read are set, every method is the real one."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("PIL.Image")
    from transformers import LlavaOnevisionProcessor, PreTrainedTokenizerFast
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    class WithoutVideos(LlavaOnevisionProcessor):
        def __init__(self, image_processor, tokenizer):
            self.image_processor, self.tokenizer = image_processor, tokenizer
            self.num_image_tokens, self.vision_feature_select_strategy = 729, "full"
            self.vision_aspect_ratio = "anyres_max_9"
            self.image_token, self.image_token_id, self.video_token, self.video_token_id = "<image>", 0, "<video>", 1

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"<image>": 0, "<video>": 1, "<unk>": 2}, unk_token="<unk>")))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    return WithoutVideos(LlavaOnevisionImageProcessorPil(size={"height": 384, "width": 384},
                                                         image_grid_pinpoints=PINPOINTS), tokenizer)


# 8,030,807,584: the Hub page of llava-hf/llava-onevision-qwen2-7b-ov-hf says "8.03B" (recalled, no hub access
# here); and less 2 x 64 x 3584 (a vocabulary of 152,064 for its 152,128) it is 8,030,348,832, what LLaVA-NeXT's
# own model printed for a user (LLaVA-VL/LLaVA-NeXT#203: "all params: 8,041,160,224" with 10,811,392 of LoRA)
def test_the_published_model_on_meta_matches_the_hand_count_of_its_config(spec):
    llava = spec("llava_onevision_qwen2_7b")
    model = llava.build("meta", torch.bfloat16, init=False)
    total = 8_030_807_584
    assert count_params(model) == (total, total)
    d_v, d, vocab = llava.vision["hidden_size"], llava.text["hidden_size"], llava.text["vocab_size"]
    parts = (count_params(model.model.vision_tower)[0], count_params(model.model.multi_modal_projector)[0],
             model.model.image_newline.numel(), count_params(model.model.language_model)[0],
             count_params(model.lm_head)[0])
    assert parts == (siglip_params({"num_channels": 3, **llava.vision}), (d_v * d + d) + (d * d + d), d,
                     qwen2_params(llava.text), vocab * d)
    assert sum(parts) == total


# (height, width): square at 1, 2 and 6 tiles (the last shrunk by anyres_max_9), wide, tall, tiny, extreme
SIZES = [(384, 384), (768, 768), (2304, 2304), (500, 300), (300, 500), (1, 1), (10, 2000), (2000, 10),
         (1000, 900), (1152, 1536), (4000, 3000), (123, 457)]


def test_image_tokens_are_what_the_real_processor_counts_at_any_size_and_aspect_ratio(processor):
    for height, width in SIZES:
        ours = anyres_tokens(height, width, PINPOINTS, 384, 14, 729, max_tiles=9)
        real = processor._get_num_multimodal_tokens(image_sizes=[[height, width]])["num_image_tokens"][0]
        assert ours == real, (height, width)


@pytest.mark.parametrize("side,images,tiles,tokens", [
    (384, 1, 2, 1485),   # one 384 px canvas: 729 + 27 x 28
    (768, 1, 5, 3699),   # 2 x 2 tiles: 729 + 54 x 55, under the cap
    (1000, 1, 10, 7371),  # 3 x 3 tiles: 81 x 81 features, 9 tiles' worth: not shrunk
    (768, 2, 1, 1460),   # two images in a sample: one tile each, 729 + 1 newline
])
def test_inputs_and_tokens_are_what_the_real_processor_gives(spec, processor, side, images, tiles, tokens):
    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))
    real = processor(images=[[image] * images] * 2, text=["<image>" * images] * 2, return_tensors="pt")
    assert int((real["input_ids"][0] == 0).sum()) == tokens
    llava = spec("llava_onevision_tiny", "model.vision.image_size=384", f"model.image_grid_pinpoints={PINPOINTS}")
    data = DataShape(batch_size=2, lm_max_length=8000, image_size=side, images_per_sample=images)
    assert llava.image_tokens(data) == tokens
    ours = llava.batch(data, CPU)  # the 7B's geometry on a tiny tower: the inputs alone, no model built
    assert ours["pixel_values"].shape == real["pixel_values"].shape == (2 * images, tiles, 3, 384, 384)
    assert ours["pixel_values"].dtype == real["pixel_values"].dtype
    assert ours["image_sizes"].tolist() == real["image_sizes"].tolist() == [[side, side]] * 2 * images
    assert ours["batch_num_images"].tolist() == real["batch_num_images"].tolist() == [images] * 2
    assert ((ours["input_ids"] == llava.image_token_id).sum(dim=1) == tokens).all()


@pytest.mark.parametrize("side,images", [(56, 1), (100, 1), (200, 1), (336, 1), (100, 3)])  # 336: 6 x 6 tiles, shrunk
def test_image_tokens_are_what_the_models_packed_features_have(spec, side, images):
    llava = spec("llava_onevision_tiny")
    model = llava.build("cpu", torch.float32)
    data = DataShape(batch_size=2, lm_max_length=400, image_size=side, images_per_sample=images)
    batch = llava.batch(data, CPU)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"],
                                                  batch_num_images=batch["batch_num_images"]).pooler_output
    assert sum(f.shape[0] for f in features) == 2 * llava.image_tokens(data)


def test_a_large_image_is_shrunk_to_the_cap_but_every_tile_is_encoded(spec):
    tiny = spec("llava_onevision_tiny")  # 336 px: the 6 x 6 canvas, 37 tiles; 24 x 24 features > 1.1^2 x 9 tiles'
    data = DataShape(batch_size=1, lm_max_length=400, image_size=336)
    assert tiny.image_tokens(data) == 16 + 12 * 13 and tiny.batch(data, CPU)["pixel_values"].shape[1] == 37
    assert spec("llava_onevision_tiny", "model.vision_aspect_ratio=anyres_max_36").image_tokens(data) == 16 + 24 * 25


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("llava_onevision_tiny")  # 2 images per sample: 2 x (16 + 1) tokens after the first token
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=80, images_per_sample=2), CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (3, 80)
    assert ((ids == tiny.image_token_id).sum(dim=1) == 34).all() and (ids[:, 1:35] == tiny.image_token_id).all()
    assert (labels[:, :35] == IGNORE_INDEX).all() and torch.equal(labels[:, 35:], ids[:, 35:])
    assert batch["pixel_values"].shape == (6, 1, 3, 56, 56) and batch["batch_num_images"].tolist() == [2, 2, 2]


@pytest.mark.parametrize("value", ["anyres", "anyres_max_0", "pad", "anyres_max_nine"])
def test_an_aspect_ratio_the_model_cannot_parse_is_refused(plan_points, value):
    with pytest.raises(ConfigError, match=rf"model.vision_aspect_ratio='{value}' is not allowed for llava_onevision_tiny: "
                                          r"transformers' LLaVA-OneVision takes anyres_max_N only"):
        plan_points(["model=llava_onevision_tiny", f"model.vision_aspect_ratio={value}"])


def test_any_image_size_is_taken_and_a_sequence_too_short_is_refused(plan_points):
    (native,) = plan_points(["model=llava_onevision_qwen2_7b", "data.image_size=null", "data.lm_max_length=2048"])
    assert native.inputs["image_size"] == 384 and native.inputs["image_tokens"] == 1485
    (tiny,) = plan_points(["model=llava_onevision_qwen2_7b", "data.image_size=1", "data.lm_max_length=2048"])
    assert tiny.inputs["image_tokens"] == 1485  # the processor takes 1 x 1 px: one canvas
    with pytest.raises(ConfigError, match=r"data.lm_max_length=4096 is too short for llava_onevision_qwen2_7b: the "
                                          r"images take 7371 tokens plus a text token before them, so it must be at "
                                          r"least 7373"):
        plan_points(["model=llava_onevision_qwen2_7b", "data.image_size=2304", "data.lm_max_length=4096"])
