"""Llama 3.2 Vision (Mllama): exact sizes from the config, the tiles, aspect-ratio inputs and cross-attention mask
against the real image processor and the processor's own functions, and the model's own image features. (Estimate
vs cpu and the knobs: test_families.py.)"""

import pytest
import torch

from hand_counts import llama_params
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params

CPU = torch.device("cpu")


def test_llama3_2_11b_vision_on_meta_has_the_published_parameter_count(spec):
    # 10,670,220,835: the Hub's safetensors count of meta-llama/Llama-3.2-11B-Vision-Instruct ("10.7B"; recalled, no
    # hub access here). The LM is Llama 3.1 8B's 32 layers (hand count below, with the 8 extra embedding rows) and
    # 8 cross-attention layers; the head is the 8B's.
    llama = spec("llama3_2_11b_vision")
    model = llama.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (10_670_220_835, 10_670_220_835)
    text = llama.text
    lm = model.model.language_model
    self_layers = [layer for i, layer in enumerate(lm.layers) if i not in text["cross_attention_layers"]]
    as_llama_8b = {**text, "num_hidden_layers": 32, "vocab_size": text["vocab_size"] + 8, "head_dim": 128}
    assert count_params(lm.embed_tokens)[0] + sum(count_params(m)[0] for m in self_layers) + count_params(lm.norm)[0] \
        == llama_params(as_llama_8b)
    assert count_params(model.lm_head)[0] == text["vocab_size"] * text["hidden_size"]
    d_v, d = llama.vision["vision_output_dim"], text["hidden_size"]
    assert count_params(model.model.multi_modal_projector)[0] == d_v * d + d


@pytest.mark.parametrize("size,tiles", [(3, (1, 1)), (560, (1, 1)), (561, (2, 2)), (1500, (2, 2))])
def test_tiles_and_inputs_are_what_the_real_processor_makes(spec, size, tiles):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    from transformers import MllamaImageProcessorPil
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    # meta-llama/Llama-3.2-11B-Vision-Instruct's preprocessor_config.json: 560 px tiles, at most 4
    processor = MllamaImageProcessorPil(size={"height": 560, "width": 560}, max_image_tiles=4)
    real = processor(images=[[image.fromarray(np.zeros((size, size, 3), dtype=np.uint8))]], return_tensors="pt")
    llama = spec("llama3_2_11b_vision")
    data = DataShape(batch_size=1, lm_max_length=64, image_size=size)
    assert llama.tiles(data) == tiles
    ours = llama.batch(data, CPU)
    for key in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
        assert ours[key].shape == real[key].shape and ours[key].dtype == real[key].dtype, key
    assert torch.equal(ours["aspect_ratio_ids"], real["aspect_ratio_ids"])
    assert torch.equal(ours["aspect_ratio_mask"], real["aspect_ratio_mask"])
    # what MllamaProcessor makes of our input_ids with the real processor's tile count
    ids = ours["input_ids"][0].tolist()
    dense = convert_sparse_cross_attention_mask_to_dense([get_cross_attention_token_mask(ids, llama.image_token_id)],
                                                         [real["num_tiles"][0]], 4, 64)
    assert torch.equal(ours["cross_attention_mask"], torch.from_numpy(dense))


def test_one_image_token_per_image_and_consistent_labels(spec):
    tiny = spec("mllama_tiny")
    data = DataShape(batch_size=3, lm_max_length=32, images_per_sample=2, image_size=56)
    batch = tiny.batch(data, CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    assert tiny.image_tokens(data) == 2 and ((ids == tiny.image_token_id).sum(dim=1) == 2).all()
    assert (labels[:, :3] == IGNORE_INDEX).all() and torch.equal(labels[:, 3:], ids[:, 3:])
    assert batch["pixel_values"].shape == (3, 2, 4, 3, 28, 28)
    # the first image attends from its token to the second's, the second from there on; 4 real tiles (2 x 2)
    mask = batch["cross_attention_mask"][0]
    assert mask[:1].sum() == 0 and mask[1, 0].tolist() == [1, 1, 1, 1] and mask[1, 1].sum() == 0
    assert mask[2:, 1].sum() == 4 * 30


def test_the_cross_attention_layers_see_every_tile_the_vision_model_makes(spec):
    tiny = spec("mllama_tiny")
    model = tiny.build("cpu", torch.float32)
    batch = tiny.batch(DataShape(batch_size=2, lm_max_length=32), CPU)
    with torch.no_grad():
        states = model.model.vision_model(pixel_values=batch["pixel_values"], aspect_ratio_ids=batch["aspect_ratio_ids"],
                                          aspect_ratio_mask=batch["aspect_ratio_mask"]).last_hidden_state
    # (28 / 14)^2 + class token = 5 per tile (padded to 8 inside the tower, unpadded out), padding tiles included
    assert states.shape[:4] == (2, 1, 4, model.model.vision_model.num_patches) == (2, 1, 4, 5)
