"""Qwen2-VL: exact sizes, the processor's image arithmetic, consistent inputs, and fake == real bookkeeping."""

import gc

import pytest
import torch
import torch.nn.functional as F

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape, count_params
from vlmprobe.models.qwen2_vl import IGNORE_INDEX, smart_resize
from vlmprobe.point.measure import measure

CPU = torch.device("cpu")
MIN_PIXELS, MAX_PIXELS = 3136, 12845056  # Qwen2-VL's preprocessor_config.json


def _split(model):
    visual = sum(p.numel() for p in model.model.visual.parameters())
    lm = sum(p.numel() for p in model.model.language_model.parameters())
    return visual, lm, model.lm_head.weight.numel()


def test_qwen2_vl_7b_on_meta_has_the_published_parameter_count(spec):
    model = spec("qwen2_vl_7b").build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (8_291_375_616, 8_291_375_616)
    assert _split(model) == (675_759_104, 7_070_619_136, 544_997_376)  # untied lm_head


def test_qwen2_vl_2b_on_meta_has_the_published_parameter_count_with_tied_embeddings(spec):
    # 2,208,985,600: the safetensors parameter count of Qwen/Qwen2-VL-2B-Instruct on the Hub ("2.21B params")
    model = spec("qwen2_vl_2b").build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (2_208_985_600, 2_208_985_600)
    assert _split(model) == (665_271_296, 1_543_714_304, 233_373_696)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # counted once


@pytest.mark.parametrize("side,resized", [
    (448, 448),    # 16 x 28: unchanged
    (500, 504),    # 500 / 28 = 17.86 -> 18 x 28
    (126, 112),    # 126 / 28 = 4.5 -> 4 (round half to even, as transformers' Python round does)
    (98, 112),     # 98 / 28 = 3.5 -> 4
    (10, 56),      # 28 x 28 < min_pixels: scaled up to 56 x 56 = 3136
    (4000, 3584),  # 4004^2 > max_pixels: scaled down to 3584^2 = 12845056
])
def test_smart_resize_matches_hand_computations(side, resized):
    assert smart_resize(side, side, 28, MIN_PIXELS, MAX_PIXELS) == (resized, resized)


def test_ms_swift_max_pixels_caps_a_square_image_below_768_tokens():
    # 602112 = 768 * 28^2; a square gets floor(sqrt(602112) / 28) = floor(27.7) = 27 blocks per side
    for side in (896, 1024, 2048):
        height, width = smart_resize(side, side, 28, MIN_PIXELS, 602112)
        assert (height, width) == (756, 756) and (height // 28) * (width // 28) == 729 <= 768


def test_smart_resize_agrees_with_transformers_for_every_side_up_to_4000():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    for max_pixels in (784, 602112, 1003520, MAX_PIXELS):
        for side in range(1, 4001):
            assert smart_resize(side, side, 28, MIN_PIXELS, max_pixels) == pil.smart_resize(
                side, side, 28, MIN_PIXELS, max_pixels), (side, max_pixels)


@pytest.mark.parametrize("side,tokens", [(224, 64), (448, 256), (672, 576), (896, 1024), (500, 324)])
def test_image_tokens_are_a_quarter_of_the_patches(spec, side, tokens):
    qwen = spec("qwen2_vl_2b")
    assert qwen.grid(DataShape(1, 2048, image_size=side)) == (2 * int(tokens**0.5),) * 2
    assert qwen.image_tokens(DataShape(1, 2048, image_size=side)) == tokens
    assert qwen.image_tokens(DataShape(1, 4096, image_size=side, images_per_sample=3)) == 3 * tokens


def test_native_448_px_image_is_1024_patches_and_256_tokens(spec):
    qwen = spec("qwen2_vl_7b")
    data = DataShape(batch_size=1, lm_max_length=512)
    assert qwen.image_size(data) == 448 and qwen.grid(data) == (32, 32) and qwen.image_tokens(data) == 256


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("qwen2_vl_tiny")  # 112 px -> 8 x 8 patches -> 16 tokens per image
    data = DataShape(batch_size=3, lm_max_length=60, images_per_sample=2)
    batch = tiny.batch(data, CPU)
    ids, labels, types = batch["input_ids"], batch["labels"], batch["mm_token_type_ids"]
    image_id = tiny.token_ids["image_token_id"]
    assert ids.shape == labels.shape == types.shape == (3, 60)
    assert tiny.image_tokens(data) == 32
    assert ((ids == image_id).sum(dim=1) == 32).all()
    assert torch.equal(types, (ids == image_id).long())  # 1 exactly at the image tokens
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8]] * 6
    assert batch["pixel_values"].shape == (6 * 64, 3 * 2 * 14 * 14) and batch["pixel_values"].dtype == torch.float32
    vision = (types == 1) | (ids == tiny.token_ids["vision_start_token_id"]) | (ids == tiny.token_ids["vision_end_token_id"])
    assert (labels[vision] == IGNORE_INDEX).all() and torch.equal(labels[~vision], ids[~vision])
    assert ((ids == tiny.token_ids["vision_start_token_id"]).sum(dim=1) == 2).all()


def test_pixel_values_and_grid_have_the_shapes_the_real_image_processor_gives(spec):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    processor = pil.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    qwen = spec("qwen2_vl_2b")
    for side in (448, 500):
        real = processor(images=[image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))], return_tensors="pt")
        ours = qwen.batch(DataShape(batch_size=1, lm_max_length=400, image_size=side), CPU)
        assert ours["pixel_values"].shape == real["pixel_values"].shape
        assert ours["pixel_values"].dtype == real["pixel_values"].dtype
        assert torch.equal(ours["image_grid_thw"], real["image_grid_thw"])


@pytest.mark.parametrize("family", ["qwen2_vl_tiny", "qwen3_vl_tiny"])  # Qwen3-VL's get_rope_index, same rule
def test_batch_position_ids_are_the_models_own_m_rope_index(spec, family):
    tiny = spec(family)
    model = tiny.build("cpu", torch.float32)
    for data in (DataShape(2, 40), DataShape(2, 60, images_per_sample=2), DataShape(1, 80, image_size=150)):
        batch = tiny.batch(data, CPU)
        expected, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
        assert torch.equal(batch["position_ids"], expected)


def test_tiny_model_trains_one_step_with_the_shifted_causal_lm_loss(spec):
    tiny = spec("qwen2_vl_tiny")
    model = tiny.build("cpu", torch.float32)
    batch = tiny.batch(DataShape(batch_size=2, lm_max_length=40), CPU)
    loss, outputs = tiny.loss(model, batch)
    assert outputs.logits.shape == (2, 40, tiny.text["vocab_size"])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():  # the model's loss is the standard next-token cross-entropy over every position
        logits = model(**batch, attention_mask=None, use_cache=False).logits
        expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                   ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss.detach(), expected)


BYTE_COLUMNS = ("peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
                "after_load_bytes", "after_step_bytes", "activations_bytes", "grads_bytes", "optimizer_state_bytes", "params_bytes")


@pytest.mark.parametrize("setting", [
    ["train.autocast_dtype=null"],
    ["train.autocast_dtype=bfloat16"],
    ["train.param_dtype=bfloat16", "train.autocast_dtype=null", "data.batch_size=3", "data.images_per_sample=2",
     "data.image_size=150"],
])
def test_estimate_equals_the_cpu_backend_to_the_byte(point, setting):
    base = ["model=qwen2_vl_tiny", "data.batch_size=2", "data.lm_max_length=96", *setting]
    cpu = measure(point(base + ["measure.backend=cpu"]))
    estimate = measure(point(base + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok", (cpu.get("error"), estimate.get("error"))
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


def test_the_fake_tensor_constant_limit_is_raised_only_while_a_batch_lives(spec):
    from torch._subclasses import fake_tensor

    gc.collect()  # batches of earlier tests, if any are still referenced, hold their own raise
    before = fake_tensor.CONSTANT_NUMEL_LIMIT
    batch = spec("qwen2_vl_tiny").batch(DataShape(batch_size=2, lm_max_length=40), CPU)
    # the batch's token count (2 x 40), or its patch count where that is larger: 2 images of 8 x 8 patches
    assert fake_tensor.CONSTANT_NUMEL_LIMIT == max(before, 2 * 40, 2 * 64)
    del batch
    gc.collect()
    assert fake_tensor.CONSTANT_NUMEL_LIMIT == before


def test_checkpointed_vision_blocks_recompute_under_fake_tensors(spec):
    # the recompute in backward splits the patches at cu_seqlens again, outside loss(): the constants must live on
    from vlmprobe import backends
    from vlmprobe.knobs import checkpoint_layers

    tiny = spec("qwen2_vl_tiny")
    estimate = backends.get("estimate")
    with estimate.session(None):
        model = tiny.build(estimate.device(), torch.float32)
        checkpoint_layers(model.model.visual)
        batch = tiny.batch(DataShape(batch_size=2, lm_max_length=60, images_per_sample=2), estimate.device())
        tiny.loss(model, batch)[0].backward()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("overrides,message", [
    (["data.lm_max_length=18"], r"data.lm_max_length=18 is too short for qwen2_vl_tiny at 112 px: the images take "
                                r"16 tokens plus 2 vision markers each, so it must be at least 19"),
    (["data.max_pixels=700"], r"data.max_pixels=700 is not allowed for qwen2_vl_tiny: .* at least 784"),
    (["data.min_pixels=500000", "data.max_pixels=400000"], r"data.min_pixels=500000 is not allowed .* must not exceed"),
])
def test_validation_names_the_value_and_what_is_allowed(plan_points, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_points(["model=qwen2_vl_tiny", *overrides])


def test_image_sizes_outside_the_pixel_bounds_are_resized_not_rejected(plan_points):
    (small,) = plan_points(["model=qwen2_vl_tiny", "data.image_size=30", "data.lm_max_length=19"])
    assert small.inputs["image_tokens"] == 4  # 30 x 30 px is below min_pixels: up to 56 x 56 px
    (large,) = plan_points(["model=qwen2_vl_tiny", "data.image_size=4000", "data.max_pixels=602112",
                            "data.lm_max_length=1024"])
    assert large.inputs["image_tokens"] == 729  # down to 756 x 756 px
    (lowest,) = plan_points(["model=qwen2_vl_tiny", "data.lm_max_length=19"])  # the least that fits
    assert lowest.inputs["image_tokens"] == 16


@pytest.mark.parametrize("size", [1, 3, 27])
def test_an_image_side_below_one_28_px_block_is_refused(plan_points, size):
    # transformers 4.45-4.52's smart_resize: "height:{h} or width:{w} must be larger than factor:28"
    with pytest.raises(ConfigError, match=rf"data.image_size={size} is not allowed for qwen2_vl_tiny: a side must be at least 28 px"):
        plan_points(["model=qwen2_vl_tiny", f"data.image_size={size}"])
    (edge,) = plan_points(["model=qwen2_vl_tiny", "data.image_size=28", "data.lm_max_length=19"])
    assert edge.inputs["image_tokens"] == 4  # 28 x 28 is below min_pixels (56 x 56): upsampled


def test_image_size_sweep_plans_four_2b_points_that_fit_in_its_sequence(plan_points):
    points = plan_points(["+sweep=qwen2_vl_image_size"])
    assert [p.inputs["image_tokens"] for p in points] == [64, 256, 576, 1024]
    assert {p.inputs["params"] for p in points} == {2_208_985_600}
    assert {(p.inputs["batch_size"], p.inputs["lm_max_length"]) for p in points} == {(1, 2048)}
