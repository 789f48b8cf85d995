"""GLM-4.1V and GLM-4.5V: exact sizes from the config (GLM-4.5V's against the count of its published weight files),
the image arithmetic against the real image processor, the collator's M-RoPE positions against the model's own,
the router's fp32 weight, step=grpo's rollout, and the values refused. (Estimate vs cpu in every setting, the knobs
and FSDP2 on real ranks: test_families.py; config.json: test_hf.py.)"""

import pytest
import torch

from conftest import meta_counts
from hand_counts import glm4_lm_params, glm4_moe_lm_params, glm4v_vision_params
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.point.measure import measure

CPU = torch.device("cpu")


@pytest.mark.parametrize("name,params,parts", [
    ("glm4_1v_9b", 10_292_777_472, (892_498_432, 8_779_522_048, 620_756_992)),
    # A public report of the downloaded zai-org/GLM-4.5V counts 107,710,933,120 values in its 46 safetensors files:
    # these parameters and the 45 MoE layers' e_score_correction_bias (128 fp32 values each), a buffer here
    ("glm4_5v", 107_710_933_120 - 45 * 128, (858_681_856, 106_231_488_512, 620_756_992)),
    ("glm4v_tiny", 220_640, (80_544, 107_328, 32_768)),
    ("glm4v_moe_tiny", 251_616, (80_544, 138_304, 32_768)),  # layer 0 dense, layer 1 experts
])
def test_glm4v_on_meta_matches_the_hand_count_of_its_config(spec, name, params, parts):
    glm = spec(name)
    assert meta_counts(glm) == (params, parts)
    assert parts[0] == glm4v_vision_params(glm.vision)
    assert parts[1] == (glm4_moe_lm_params if "n_routed_experts" in glm.text else glm4_lm_params)(glm.text)
    model = glm.build("meta", torch.bfloat16, init=False)
    routers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert routers == (glm.text["num_hidden_layers"] - glm.text["first_k_dense_replace"]) * glm.text[
        "n_routed_experts"] if "n_routed_experts" in glm.text else routers == 0


@pytest.mark.parametrize("side,patches", [
    (448, 32),   # 2 x 448^2 within the bounds: 32 x 32 patches, 256 tokens
    (500, 36),   # 500 / 28 = 17.9 -> 18 x 28 = 504 px
    (20, 6),     # a side below 28 px is scaled up to 28, then 2 x 28^2 < 12544: up to 84 px
    (100, 8),    # 2 x 112^2 = 25088 within the bounds (Qwen2-VL's bounds would not count the 2 frames): 112 px
    (60, 6),     # 2 x 56^2 = 6272 < 12544: up by sqrt(12544 / (2 x 60^2)), ceil(60 x 1.32 / 28) x 28 = 84 px
    pytest.param(3000, 172, marks=pytest.mark.slow),  # 2 x 3000^2 > 11760000: down to 2408 px (29584 patches)
])
def test_image_grid_and_pixel_values_are_what_the_real_image_processor_gives(spec, side, patches):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    pil = pytest.importorskip("transformers.models.glm4v.image_processing_pil_glm4v")
    processor = pil.Glm4vImageProcessorPil()  # the class's own bounds, as the shipped YAMLs take them
    glm = spec("glm4_1v_9b")
    data = DataShape(batch_size=1, lm_max_length=20000, image_size=side)
    assert glm.grid(data) == (patches, patches) and glm.image_tokens(data) == (patches // 2) ** 2
    real = processor(images=[image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))], return_tensors="pt")
    assert real["image_grid_thw"].tolist() == [[1, patches, patches]]
    # the batch's shapes alone (the tiny model has the 9B's patch and the processor's bounds)
    tiny = spec("glm4v_tiny", "model.min_pixels=12544")
    ours = tiny.batch(data, CPU)
    assert ours["pixel_values"].shape == real["pixel_values"].shape == (patches**2, 1176)
    assert ours["pixel_values"].dtype == real["pixel_values"].dtype
    assert ours["image_grid_thw"].tolist() == [[1, patches, patches]]


def test_the_collators_positions_and_token_types_are_the_models_own(spec):
    # Glm4vModel.get_rope_index on the batch's input_ids, token types and grids (two images per sample, of 4 x 4
    # and merged tokens) gives the positions the collator computed, and a text-only tail continues them
    glm = spec("glm4v_tiny")
    data = DataShape(batch_size=2, lm_max_length=48, images_per_sample=2)
    model = glm.build("cpu", torch.float32)
    batch = glm.batch(data, CPU)
    ids, types = batch["input_ids"], batch["mm_token_type_ids"]
    # the processor's create_mm_token_type_ids: 1 where the id is <|image|> outside a video
    assert types.tolist() == (ids == glm.token_ids["image_token_id"]).int().tolist()
    positions, deltas = model.model.get_rope_index(ids, types, image_grid_thw=batch["image_grid_thw"])
    assert positions.tolist() == batch["position_ids"].tolist()
    assert deltas.flatten().tolist() == [2 * (4 - 16)] * 2  # each image: 16 tokens at 4 positions
    # the prompt: <|begin_of_image|>, 16 <|image|>, <|end_of_image|> per image, none learned
    start, end = glm.token_ids["image_start_token_id"], glm.token_ids["image_end_token_id"]
    assert ids[0, :36].tolist() == ([start] + [glm.token_ids["image_token_id"]] * 16 + [end]) * 2
    assert (batch["labels"][:, :36] == -100).all() and (batch["labels"][:, 36:] == ids[:, 36:]).all()


def test_the_router_weight_stays_fp32_in_a_bf16_model_as_from_pretrained_keeps_it(spec):
    model = spec("glm4v_moe_tiny").build("meta", torch.bfloat16, init=False)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {n for n, d in dtypes.items() if d == torch.float32} == {"model.language_model.layers.1.mlp.gate.weight"}
    assert type(model)._keep_in_fp32_modules_strict == ["e_score_correction_bias", "gate.weight"]


@pytest.mark.slow  # about 30 s: a GRPO step on each backend
def test_grpo_estimate_matches_a_real_run(point):
    tiny = ["model=glm4v_tiny", "step=grpo", "data.lm_max_length=40", "data.batch_size=4",
            "step.max_completion_length=16", "measure.steps=2"]
    phases = ("generate", "reference", "forward", "backward", "optimizer")
    rows = {k: measure(point(tiny + [f"measure.backend={k}"])) for k in ("cpu", "estimate")}
    assert {k: r["status"] for k, r in rows.items()} == dict.fromkeys(rows, "ok")
    peaks = {k: {p: r[f"{p}_peak_bytes"] for p in phases} for k, r in rows.items()}
    # generation within 2 KiB, as for Qwen2-VL (tests/test_grpo.py: scalar-sized paths generate reads from data)
    assert {p: peaks["estimate"][p] for p in phases[1:]} == {p: peaks["cpu"][p] for p in phases[1:]}
    assert abs(peaks["estimate"]["generate"] - peaks["cpu"]["generate"]) <= 2048


@pytest.mark.parametrize("overrides,message", [
    (["model=glm4v_tiny", "data.videos_per_sample=1", "data.video_frames=4"],
     r"^data\.videos_per_sample=1 is not allowed for glm4v_tiny: its processor writes every frame's timestamp"),
    (["model=glm4v_moe_tiny", "model.experts_implementation=eager"],
     r"^model\.experts_implementation='eager' is not allowed for glm4v_moe_tiny: use grouped_mm or batched_mm "),
    (["model=glm4v_moe_tiny", "model.text.num_experts_per_tok=9"],
     r"^model\.text\.num_experts_per_tok=9 is not allowed for glm4v_moe_tiny: each token goes to 1 to "
     r"n_routed_experts \(8\) experts$"),
    (["model=glm4v_tiny", "data.lm_max_length=17"],
     r"^data\.lm_max_length=17 is too short for glm4v_tiny at 112 px: the images take 16 tokens plus 2 vision "
     r"markers each, so it must be at least 19$"),
])
def test_values_glm_cannot_take_are_one_line(plan_points, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_points(overrides)
