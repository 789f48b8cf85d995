"""Idefics3 / SmolVLM: exact sizes from the config, the processor's tiling against the real image processor
(built offline from its defaults), the model's own image features, consistent inputs, and image sizes the
processor would not give the model refused. (Estimate vs cpu and the knobs: test_families.py.)"""

import pytest
import torch

from hand_counts import llama_params, siglip_params
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params
from vlmprobe.models.idefics3 import MAX_IMAGE_SIZE

CPU = torch.device("cpu")


@pytest.mark.parametrize("name,total", [
    # the Hub's safetensors counts of HuggingFaceTB/SmolVLM-256M-Instruct ("256M") and SmolVLM-Instruct
    # ("2.25B"), recalled (no hub access here), equal to the hand count of their parts below
    ("smolvlm_256m", 256_484_928),
    ("smolvlm_2b", 2_246_272_880),
])
def test_smolvlm_on_meta_has_the_published_parameter_count(spec, name, total):
    smol = spec(name)
    model = smol.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (total, total)
    assert count_params(model.model.vision_model)[0] == siglip_params(smol.vision)
    assert count_params(model.model.text_model)[0] == llama_params(smol.text)
    d_v, d, s = smol.vision["hidden_size"], smol.text["hidden_size"], smol.scale_factor
    assert count_params(model.model.connector)[0] == d_v * s * s * d  # pixel shuffle, then Linear without bias
    assert count_params(model.lm_head)[0] == smol.text["vocab_size"] * d  # untied


def test_transformers_caps_images_where_we_do():
    from transformers.models.idefics3 import image_processing_pil_idefics3 as pil

    assert pil.MAX_IMAGE_SIZE == MAX_IMAGE_SIZE


@pytest.mark.parametrize("longest_edge,splitting", [(3, True), (513, True), (1537, True), (2048, True), (1000, False)])
def test_tiles_and_pixel_inputs_are_what_the_real_image_processor_makes(spec, longest_edge, splitting):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    from transformers import Idefics3ImageProcessorPil

    # SmolVLM-256M-Instruct's preprocessor_config.json, with the longest edge under test; the input image's own
    # size does not matter (every image is resized to the longest edge)
    processor = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": 512},
                                          do_image_splitting=splitting)
    real = processor(images=[[image.fromarray(np.zeros((300, 300, 3), dtype=np.uint8))]], return_tensors="pt",
                     return_row_col_info=True)
    smol = spec("smolvlm_256m", f"model.image_size={longest_edge}", f"model.do_image_splitting={str(splitting).lower()}")
    data = DataShape(batch_size=1, lm_max_length=4096)
    assert smol.grid(data) == (real["rows"][0][0], real["cols"][0][0])
    ours = smol.batch(data, CPU)
    for key in ("pixel_values", "pixel_attention_mask"):
        assert ours[key].shape == real[key].shape and ours[key].dtype == real[key].dtype, key
    assert (real["pixel_attention_mask"] == 1).all()  # square tiles: no padding, as in our batch


def test_image_tokens_are_what_the_models_image_features_have(spec):
    tiny = spec("idefics3_tiny")
    model = tiny.build("cpu", torch.float32)
    data = DataShape(batch_size=2, lm_max_length=64)
    batch = tiny.batch(data, CPU)
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"], batch["pixel_attention_mask"]).pooler_output
    assert [f.shape[0] for f in features] == [tiny.image_tokens(data)] * 2 == [20, 20]  # (2 x 2 + 1) tiles x 4


def test_the_processors_token_count_is_the_image_text_length(spec):
    # Idefics3Processor._get_num_multimodal_tokens: (seq + 3) + rows * (cols * (seq + 2) + 1), "\n\n" one token
    smol = spec("smolvlm_256m")
    for size, (rows, cols) in ((2048, (4, 4)), (1000, (2, 2)), (512, (0, 0))):
        assert smol.grid(DataShape(1, 4096, image_size=size)) == (rows, cols)
        assert len(smol._image_text(rows, cols)) == (64 + 3) + rows * (cols * (64 + 2) + 1)
    assert smol.image_tokens(DataShape(1, 4096)) == 17 * 64 and spec("smolvlm_2b").image_tokens(DataShape(1, 4096)) == 17 * 81


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("idefics3_tiny")
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=80, images_per_sample=2), CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (3, 80)
    image = ids == tiny.image_token_id
    assert (image.sum(dim=1) == 40).all()
    prompt = 1 + 2 * 33  # a start token, then per image 2 rows x (2 x (2 + 4) + 1) + (4 + 3)
    assert (labels[:, :prompt] == IGNORE_INDEX).all() and torch.equal(labels[:, prompt:], ids[:, prompt:])
    assert not image[:, prompt:].any()
    assert batch["pixel_values"].shape == (3, 10, 3, 32, 32) and batch["pixel_attention_mask"].shape == (3, 10, 32, 32)
