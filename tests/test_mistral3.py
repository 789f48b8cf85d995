"""Mistral 3 (Mistral-Small-3.1): sizes by hand from the config, the processor's arithmetic against the real Pixtral
image processor and the model's own image features, the vision tower's block mask as CUDA's memory-efficient
attention copies it where it runs, what transformers 5.24 builds from the published config.json, and what the model cannot
take refused. (Estimate vs cpu to the byte and the knobs: test_families.py.)"""

import pytest
import torch

from conftest import TESTS, image_features_of
from hand_counts import llama_params
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params
from vlmprobe.point.measure import measure

CPU = torch.device("cpu")
HF = TESTS / "data" / "hf"


def pixtral_params(v: dict) -> int:
    """A Pixtral tower: a patch convolution without bias, ln_pre, per block q/k/v/o and a gated MLP without bias
    and two RMSNorms."""
    d, f = v["hidden_size"], v["intermediate_size"]
    return v["num_channels"] * v["patch_size"] ** 2 * d + d + v["num_hidden_layers"] * (4 * d * d + 3 * d * f + 2 * d)


# 24,011,361,280: "24B" on the Hub page of mistralai/Mistral-Small-3.1-24B-Instruct-2503 (recalled, no hub access)
def test_mistral_small_on_meta_matches_the_hand_count_of_its_config(spec):
    mistral = spec("mistral_small_3_1_24b")
    model = mistral.build("meta", torch.bfloat16, init=False)
    modules = (model.model.vision_tower, model.model.multi_modal_projector, model.model.language_model, model.lm_head)
    parts = tuple(count_params(m)[0] for m in modules)
    d_v, d, vocab = mistral.vision["hidden_size"], mistral.text["hidden_size"], mistral.text["vocab_size"]
    projector = d_v + 4 * d_v * d_v + d_v * d + d * d  # RMSNorm, the 2 x 2 merger, Linear, Linear (no bias)
    assert parts == (pixtral_params(mistral.vision), projector, llama_params(mistral.text), vocab * d)
    assert count_params(model) == (sum(parts), sum(parts)) and sum(parts) == 24_011_361_280


def test_the_published_config_json_builds_a_tied_head_as_transformers_5_reads_it(spec):
    # its top level does not say tie_word_embeddings, and Mistral3Config's default is true since transformers#43429:
    # from_pretrained builds one matrix for embedding and head (the checkpoint's own lm_head is then not used)
    from_json = spec("hf", f"model.config={HF / 'Mistral-Small-3.1-24B-Instruct-2503'}")
    from_yaml = spec("mistral_small_3_1_24b")
    json_model, yaml_model = (s.build("meta", torch.bfloat16, init=False) for s in (from_json, from_yaml))
    assert json_model.lm_head.weight is json_model.model.language_model.embed_tokens.weight
    assert count_params(yaml_model)[0] - count_params(json_model)[0] == 131_072 * 5120 == 671_088_640
    untied = spec("hf", f"model.config={HF / 'Mistral-Small-3.1-24B-Instruct-2503'}")
    untied.tie_word_embeddings = False  # what the YAML says: then the same model to the parameter
    assert [(n, p.shape) for n, p in untied.build("meta", torch.bfloat16, init=False).named_parameters()] == [
        (n, p.shape) for n, p in yaml_model.named_parameters()]
    assert (from_json.longest_edge, from_json.native_image_size) == (1540, 1024) == (from_yaml.longest_edge,
                                                                                    from_yaml.native_image_size)


def test_a_tiny_config_json_point_uses_the_memory_of_its_shipped_yaml_to_the_byte(plan_points):
    data = ["data.batch_size=2", "data.lm_max_length=48", "data.image_size=70", "measure.backend=estimate",
            "measure.steps=1"]
    (hf,) = plan_points(["model=hf", f"model.config={HF / 'mistral3_tiny'}", *data])
    (yaml,) = plan_points(["model=mistral3_tiny", *data])
    assert hf.inputs["params"] == yaml.inputs["params"] and hf.inputs["image_tokens"] == yaml.inputs["image_tokens"] == 12
    rows = [measure(p.config) for p in (hf, yaml)]
    assert rows[0]["status"] == "ok" and {k: v for k, v in rows[0].items() if k.endswith("_bytes")} == {
        k: v for k, v in rows[1].items() if k.endswith("_bytes")}


# sides: tiny, around one 28 px cell, odd, at and past the 1540 px edge (floored there as the processor floors)
SIDES = [1, 27, 28, 29, 100, 700, 1000, 1024, 1539, 1540, 1541, 2000, 3001]


def test_pixels_and_tokens_are_what_the_real_pixtral_image_processor_gives(spec):
    import numpy as np

    pytest.importorskip("PIL.Image")
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    # as Mistral-Small-3.1 configures it: longest edge 1540; PixtralProcessor hands it patch x merge = 28 px
    processor = PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14})
    mistral = spec("mistral_small_3_1_24b")
    for side in SIDES:
        real = processor(images=[Image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))],
                         patch_size={"height": 28, "width": 28}, return_tensors="pt")
        (height, width), = real["image_sizes"].tolist()
        data = DataShape(batch_size=2, lm_max_length=4000, image_size=side)  # 2: a lone 28 px image is refused
        assert mistral.pixel_side(data) == height == width, side
        # PixtralProcessor.replace_image_token: rows of width // 28 [IMG] tokens, each ending in a break / the end
        assert mistral.image_tokens(data) == height // 28 * (width // 28 + 1), side
        assert mistral.batch(data, CPU)["pixel_values"].shape[1:] == real["pixel_values"].shape[1:], side


@pytest.mark.parametrize("side,rows", [(56, 2), (70, 3), (112, 4), (200, 4)])  # 200 px: scaled to the 112 px edge
def test_image_tokens_are_what_the_models_merged_features_have(spec, side, rows):
    tiny = spec("mistral3_tiny")
    data = DataShape(batch_size=2, lm_max_length=100, image_size=side)
    features, batch = image_features_of(tiny, data)
    assert features == [rows * rows] * 2  # one feature per [IMG]
    assert tiny.image_tokens(data) == rows * (rows + 1)
    assert ((batch["input_ids"] == tiny.image_token_id).sum(dim=1) == rows * rows).all()


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("mistral3_tiny")  # 56 px: 2 rows of 2 [IMG], a break after the first, the end after the second
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=40, images_per_sample=2), CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    image = [10, 10, 12, 10, 10, 13]
    assert ids.shape == labels.shape == (3, 40) and ids[:, :13].tolist() == [[1, *image, *image]] * 3
    assert (labels[:, :13] == IGNORE_INDEX).all() and torch.equal(labels[:, 13:], ids[:, 13:])
    assert (ids[:, 13:] > 13).all()  # text ids lie above the image tokens
    assert batch["pixel_values"].shape == (6, 3, 56, 56) and batch["image_sizes"].tolist() == [[56, 56]] * 6


def test_an_unaligned_block_mask_costs_one_padded_copy_per_vision_block_where_memory_efficient_attention_takes_it(
        plan_points):
    # one 70 px image per micro batch: 84 px seen, 6 x 6 = 36 patches, a 36 x 36 bf16 mask whose rows are not a
    # multiple of 8 elements. On an A100 (flash first, so the masked call runs memory-efficient attention) each of
    # the 2 blocks pads its own 36 x 40 copy and keeps it for backward; the same card with cuDNN first (as sm90
    # cards have it) hands cuDNN the mask as it is. With 2 images (72 patches) the mask is aligned: no copy either way.
    def activations(batch_size, first):
        (point,) = plan_points(["model=mistral3_tiny", f"data.batch_size={batch_size}", "data.lm_max_length=48",
                                "data.image_size=70", "train.param_dtype=bfloat16", "train.autocast_dtype=null",
                                "device=a100_80gb", f"device.sdpa.default={first}", "measure.backend=estimate",
                                "measure.steps=1"])
        row = measure(point.config)
        assert row["status"] == "ok", row.get("error")
        return row["activations_bytes"]

    copy, mask = (-(-36 * side * 2 // 512) * 512 for side in (40, 36))  # 2,880 B and 2,592 B in 512 B blocks
    # cuDNN keeps a random seed and offset (a 512 B block each) for each of the 4 attentions (2 + 2 layers)
    seeds = 4 * 2 * 512
    # the blocks keep their copies and no longer the tower's own mask, which dies when the tower returns
    assert activations(1, "flash") - activations(1, "cudnn") == 2 * copy - mask - seeds
    assert activations(2, "cudnn") - activations(2, "flash") == seeds


def test_flash_attention_in_the_tower_builds_no_mask(plan_points):
    # with flash_attention_2 Pixtral passes each image's length (cu_seqlens) instead of the N x N mask, which lives
    # through the tower's forward under sdpa (at 1540 px: 12,100^2 bf16 = 279 MiB); a 448 px image on the tiny
    # tower: 32 x 32 = 1,024 patches, a 2 MiB mask, far above what else differs (O(N) attention state)
    def forward_peak(attn):
        (point,) = plan_points(["model=mistral3_tiny", "model.longest_edge=448", "data.batch_size=1",
                                "data.lm_max_length=300", "data.image_size=448", "train.param_dtype=bfloat16",
                                "train.autocast_dtype=null", f"model.attn_implementation={attn}",
                                "measure.backend=estimate", "measure.steps=1"])
        row = measure(point.config)
        assert row["status"] == "ok", row.get("error")
        return row["forward_peak_bytes"]

    mask = 1024 * 1024 * 2
    assert abs(forward_peak("sdpa") - forward_peak("flash_attention_2") - mask) < mask // 16


def test_any_image_size_is_taken_and_a_sequence_too_short_is_refused(plan_points):
    (point,) = plan_points(["model=mistral_small_3_1_24b", "data.image_size=5000", "data.lm_max_length=4096"])
    assert point.inputs["image_tokens"] == 3080 and point.inputs["params"] == 24_011_361_280  # scaled to 1540 px
    with pytest.raises(ConfigError, match=r"data.lm_max_length=2048 is too short for mistral_small_3_1_24b at 1540 "
                                          r"px: the images take 3080 tokens plus <s>, so it must be at least 3082"):
        plan_points(["model=mistral_small_3_1_24b", "data.image_size=1540", "data.lm_max_length=2048"])
    # a 28 px image is one LM token: alone in a micro batch, transformers 5.24's get_image_features squeezes its
    # (1, 1, width) features to a vector and fails (tried: "split_with_sizes expects split_sizes to sum exactly to 5120")
    with pytest.raises(ConfigError, match=r"data.image_size=1 is not allowed for mistral_small_3_1_24b with one image in "
                                          r"the micro batch: it is one LM token \(28 px or less\)"):
        plan_points(["model=mistral_small_3_1_24b", "data.image_size=1", "data.lm_max_length=2048"])
    (two,) = plan_points(["model=mistral_small_3_1_24b", "data.image_size=1", "data.batch_size=2", "data.lm_max_length=64"])
    assert two.inputs["image_tokens"] == 2
