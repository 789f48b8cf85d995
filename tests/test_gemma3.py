"""Gemma 3: exact sizes from the config, the processor's image arithmetic against the real image processor and
the model's own image features, consistent inputs, and image sizes the model cannot see refused. (Estimate vs
cpu and the knobs: test_families.py.)"""

import pytest
import torch

from hand_counts import qk_norm_lm_params, siglip_params
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params

CPU = torch.device("cpu")


def gemma3_lm_params(t: dict) -> int:
    """Hand count of the Gemma 3 LM without its (tied) head: q/k norms and four RMSNorms per layer."""
    return qk_norm_lm_params(t, 4)


def test_gemma3_4b_on_meta_has_the_published_parameter_count(spec):
    # 4,300,079,472: the Hub's safetensors count of google/gemma-3-4b-it ("4.3B"; recalled, no hub access here),
    # equal to the hand count of its parts below
    gemma = spec("gemma3_4b")
    model = gemma.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (4_300_079_472, 4_300_079_472)
    assert count_params(model.model.vision_tower)[0] == siglip_params(gemma.vision) == 416_866_032
    assert count_params(model.model.language_model)[0] == gemma3_lm_params(gemma.text) == 3_880_263_168
    d_v, d = gemma.vision["hidden_size"], gemma.text["hidden_size"]
    assert count_params(model.model.multi_modal_projector)[0] == d_v * d + d_v  # the matrix and the RMSNorm
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied: counted once


def test_pixel_values_have_the_shape_the_real_image_processor_gives(spec):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    from transformers import Gemma3ImageProcessorPil

    # google/gemma-3-4b-it's preprocessor_config.json: 896 x 896, pan-and-scan off (it is also what the class
    # does with pan-and-scan on for a square image)
    for pan_and_scan in (False, True):
        processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, do_pan_and_scan=pan_and_scan,
                                            pan_and_scan_min_ratio_to_activate=1.2, pan_and_scan_max_num_crops=4,
                                            pan_and_scan_min_crop_size=256)
        real = processor(images=[image.fromarray(np.zeros((500, 500, 3), dtype=np.uint8))] * 2, return_tensors="pt")
        tiny = spec("gemma3_tiny", "model.vision.image_size=896", "model.vision.patch_size=56")  # the 4B's geometry
        ours = tiny.batch(DataShape(batch_size=2, lm_max_length=64), CPU)
        assert ours["pixel_values"].shape == real["pixel_values"].shape == (2, 3, 896, 896)
        assert ours["pixel_values"].dtype == real["pixel_values"].dtype


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("gemma3_tiny")
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=64, images_per_sample=2), CPU)
    ids, labels, types = batch["input_ids"], batch["labels"], batch["token_type_ids"]
    assert ids.shape == labels.shape == types.shape == (3, 64)
    image = ids == tiny.image_token_id
    assert (image.sum(dim=1) == 32).all() and torch.equal(types, image.long())
    prompt = 1 + 2 * (16 + 4)  # <bos>, then per image \n\n <start_of_image> 16 tokens <end_of_image> \n\n
    assert (ids[:, 0] == 2).all() and (ids[:, 2] == tiny.boi_token_id).all() and (ids[:, 19] == tiny.eoi_token_id).all()
    assert (labels[:, :prompt] == IGNORE_INDEX).all() and torch.equal(labels[:, prompt:], ids[:, prompt:])
    assert (ids[:, prompt:] < tiny.boi_token_id).all() and batch["pixel_values"].shape == (6, 3, 64, 64)
