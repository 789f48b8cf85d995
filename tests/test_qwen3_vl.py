"""Qwen3-VL: exact sizes from the config, the image arithmetic (Qwen2-VL's with 16 px patches and Qwen3-VL's
pixel bounds) against the real image processor, the DeepStack path running under the estimate, and step=grpo's
rollout. (Estimate vs cpu and the knobs: test_families.py; config.json: test_hf.py; the collator's M-RoPE
positions against the model's own: test_qwen2_vl.py.)"""

import pytest
import torch

from conftest import meta_counts
from hand_counts import qk_norm_lm_params, qwen3_vl_vision_params
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.point.measure import measure

CPU = torch.device("cpu")
MIN_PIXELS, MAX_PIXELS = 65536, 16777216  # Qwen3-VL's preprocessor_config.json (size.shortest_edge / longest_edge)


def test_qwen3_vl_8b_on_meta_matches_the_hand_count_of_its_config(spec):
    # The model card says "8B"; the Hub's safetensors count (recalled, not re-read: no hub access here) is
    # "8.77B", which this exact count rounds to
    qwen = spec("qwen3_vl_8b")
    parts = (576_388_336, 7_568_405_504, 622_329_856)  # untied head
    assert meta_counts(qwen) == (8_767_123_696, parts)
    assert parts[0] == qwen3_vl_vision_params(qwen.vision)
    assert parts[1] == qk_norm_lm_params(qwen.text, 2)  # Qwen3: 2 norms a layer
    assert len(qwen.build("meta", torch.bfloat16, init=False).model.visual.deepstack_merger_list) == 3


@pytest.mark.parametrize("side,resized", [
    (448, 448),      # 14 x 32: unchanged -> 28 x 28 patches, 196 tokens
    (500, 512),      # 500 / 32 = 15.6 -> 16 x 32
    (100, 256),      # 96 x 96 < min_pixels 65536: scaled up to 256 x 256
    pytest.param(5000, 4096, marks=pytest.mark.slow),  # 4992^2 > max_pixels: down to 4096^2 (65536 patches: ~10 s)
])
def test_image_grid_and_pixel_values_are_what_the_real_image_processor_gives(spec, side, resized):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    # Qwen3VLProcessor's image processor (image_processing_auto: qwen3_vl -> Qwen2VLImageProcessor) as
    # Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json sets it
    processor = pil.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                             patch_size=16, temporal_patch_size=2, merge_size=2)
    qwen = spec("qwen3_vl_8b")
    data = DataShape(batch_size=1, lm_max_length=20000, image_size=side)
    assert qwen.grid(data) == (resized // 16, resized // 16)
    assert qwen.image_tokens(data) == (resized // 32) ** 2
    real = processor(images=[image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))], return_tensors="pt")
    thw = [[1, resized // 16, resized // 16]]
    assert real["image_grid_thw"].tolist() == thw
    # the batch's shapes alone (no model): patches x (3 * 2 * 16 * 16) values
    tiny = spec("qwen3_vl_tiny")
    tiny.vision, tiny.min_pixels, tiny.max_pixels = {**tiny.vision, "patch_size": 16}, MIN_PIXELS, MAX_PIXELS
    ours = tiny.batch(data, CPU)
    assert ours["pixel_values"].shape == real["pixel_values"].shape == ((resized // 16) ** 2, 1536)
    assert ours["pixel_values"].dtype == real["pixel_values"].dtype and ours["image_grid_thw"].tolist() == thw


def test_the_estimate_runs_the_deepstack_features_through_the_first_lm_layers(point, monkeypatch):
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    text_model = modeling_qwen3_vl.Qwen3VLTextModel
    added = []  # (image positions, features) of each DeepStack addition

    def deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
        added.append((int(visual_pos_masks.sum()), tuple(visual_embeds.shape)))
        return original(self, hidden_states, visual_pos_masks, visual_embeds)

    original = text_model._deepstack_process
    monkeypatch.setattr(text_model, "_deepstack_process", deepstack_process)
    row = measure(point(["model=qwen3_vl_tiny", "data.batch_size=2", "data.lm_max_length=48", "measure.steps=1",
                         "measure.backend=estimate"]))
    assert row["status"] == "ok", row.get("error")
    # one step: vision blocks 0 and 1 feed LM layers 0 and 1, each at the 2 x 16 image tokens of the batch
    assert added == [(32, (32, 64))] * 2


@pytest.mark.parametrize("size", [3, 31])
def test_an_image_side_below_one_32_px_block_is_refused(plan_points, size):
    with pytest.raises(ConfigError, match=rf"data.image_size={size} is not allowed for qwen3_vl_tiny: a side must be "
                                          rf"at least 32 px, one 16 px patch x merge 2"):
        plan_points(["model=qwen3_vl_tiny", f"data.image_size={size}"])
    (edge,) = plan_points(["model=qwen3_vl_tiny", "data.image_size=32", "data.lm_max_length=4"])
    assert edge.inputs["image_tokens"] == 1


def test_the_native_448_px_image_is_196_tokens_of_the_8b(plan_points):
    (point,) = plan_points(["model=qwen3_vl_8b", "data.lm_max_length=1024"])
    assert point.inputs["image_tokens"] == 196 and point.inputs["params"] == 8_767_123_696


@pytest.mark.slow  # about 40 s: a GRPO step on each backend and a token-by-token rollout
def test_grpo_estimate_matches_a_real_run_and_the_token_by_token_rollout(point):
    tiny = ["model=qwen3_vl_tiny", "step=grpo", "data.lm_max_length=40", "data.batch_size=4",
            "step.max_completion_length=16", "measure.steps=2"]
    phases = ("generate", "reference", "forward", "backward", "optimizer")
    rows = {k: measure(point(tiny + extra)) for k, extra in {
        "cpu": ["measure.backend=cpu"], "estimate": ["measure.backend=estimate"],
        "full": ["measure.backend=cpu", "step.rollout=full"]}.items()}
    assert {k: r["status"] for k, r in rows.items()} == dict.fromkeys(rows, "ok")
    peaks = {k: {p: r[f"{p}_peak_bytes"] for p in phases} for k, r in rows.items()}
    assert peaks["full"] == peaks["cpu"]
    # generation within 2 KiB, as for Qwen2.5-VL (tests/test_grpo.py: scalar-sized paths generate reads from data)
    assert {p: peaks["estimate"][p] for p in phases[1:]} == {p: peaks["cpu"][p] for p in phases[1:]}
    assert abs(peaks["estimate"]["generate"] - peaks["cpu"]["generate"]) <= 2048
