"""Videos in Qwen2-VL / Qwen2.5-VL points: token counts and patches against transformers' own
Qwen2VLVideoProcessor code, M-RoPE positions against the models' get_rope_index, a 2-frame video against the
still image it equals, fake == real bookkeeping, and the refusals."""

import importlib
import importlib.machinery
import sys
import types
from pathlib import Path

import pytest
import torch

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.point.measure import measure

CPU = torch.device("cpu")
TESTS_DATA = Path(__file__).parent / "data" / "hf"
VIDEO_MIN, VIDEO_MAX = 128 * 28 * 28, 768 * 28 * 28  # Qwen2VLVideoProcessor's class defaults


@pytest.fixture
def video_processor(monkeypatch):
    """transformers' Qwen2VLVideoProcessor class. Its module imports torchvision's transforms at the top (for the
    resampling, which no count here reaches); torchvision is not installed here, so a stand-in module is in
    sys.modules while it is imported. What runs is the class's own arithmetic: get_num_of_video_patches,
    patchify (plain torch) and resize's size decision."""
    name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    if name not in sys.modules:
        # what it imports from transformers first, so those modules see no torchvision (they ask once, then remember)
        importlib.import_module("transformers.video_processing_utils")
        for module in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                       "torchvision.transforms.v2.functional"):
            if module not in sys.modules:
                standin = types.ModuleType(module)
                standin.__spec__ = importlib.machinery.ModuleSpec(module, None)
                monkeypatch.setitem(sys.modules, module, standin)
    return importlib.import_module(name).Qwen2VLVideoProcessor


class ProcessorSettings(types.SimpleNamespace):
    """A video processor's own settings as get_num_of_video_patches reads them: as attributes (transformers 5.24)
    or through _merge_and_standardize_kwargs, which lays the call's kwargs over them (5.25)."""

    def _merge_and_standardize_kwargs(self, **kwargs) -> dict:
        return {**vars(self), **kwargs}


def processor_settings(low=VIDEO_MIN, high=VIDEO_MAX):
    return ProcessorSettings(size={"shortest_edge": low, "longest_edge": high}, patch_size=14, merge_size=2,
                             temporal_patch_size=2)


@pytest.mark.parametrize("frames", [1, 2, 5, 16, 33])
@pytest.mark.parametrize("side,bounds", [
    (448, (VIDEO_MIN, VIDEO_MAX)),  # 448^2 inside the bounds: 16 x 16 tokens per temporal patch
    (112, (VIDEO_MIN, VIDEO_MAX)),  # below the 100352 px floor: scaled up to 336 x 336
    (1000, (VIDEO_MIN, VIDEO_MAX)),  # above the 602112 px cap: scaled down to 756 x 756
    (308, (3136, 12845056)),        # the image bounds (a checkpoint folder without a video processor file)
    (448, (100352, 105369)),        # Video-R1's qwen-vl-utils: 128 x 28 x 28 per frame, x 1.05 as the cap
])
def test_video_tokens_equal_the_video_processors_own_count(spec, video_processor, frames, side, bounds):
    qwen = spec("qwen2_vl_7b")
    data = DataShape(1, 100_000, images_per_sample=0, videos_per_sample=1, video_frames=frames, video_size=side,
                     video_min_pixels=bounds[0], video_max_pixels=bounds[1])
    patches = video_processor.get_num_of_video_patches(processor_settings(*bounds), frames, side, side, {})
    assert qwen.video_tokens(data) == patches // 4  # Qwen2VLProcessor: one <|video_pad|> per 2 x 2 patches
    t, rows, cols = qwen.video_grid(data)
    assert t * rows * cols == patches


@pytest.mark.parametrize("frames", [4, 15])
def test_a_minimum_above_the_cap_scales_frames_up_as_the_video_processor_does(spec, video_processor, frames):
    # transformers' smart_resize tests the cap first, then the floor: such frames end at the floor, past the cap
    qwen = spec("qwen2_vl_7b")
    data = DataShape(1, 100_000, images_per_sample=0, videos_per_sample=1, video_frames=frames, video_size=448,
                     video_min_pixels=700_000)
    patches = video_processor.get_num_of_video_patches(processor_settings(700_000, VIDEO_MAX), frames, 448, 448, {})
    assert qwen.video_tokens(data) == patches // 4


@pytest.mark.parametrize("frames,side,minimum,maximum,total,tokens", [
    # qwen-vl-utils 0.0.14 fetch_video, by hand: cap = max(min(768 x 28^2, total / frames x 2), int(min x 1.05)),
    # total by default 0.9 x 128,000 x 28^2; then smart_resize (28 px cells) and 2 x 2 patches a token
    (4, 448, 700_000, None, None, 2 * 30 * 30),  # the cap raised to 735,000: 448 -> 840 px, 30 x 30 tokens x 2
    (768, 1000, None, None, None, 384 * 17 * 17),    # the default budget: cap 235,200 -> 476 px, 17 x 17 tokens
    (16, 1000, None, 200_000, None, 8 * 15 * 15),    # a max below the cap lowers it: 420 px
    (16, 448, None, None, 802_816, 8 * 11 * 11),  # VIDEO_TOTAL_PIXELS given: share 100,352 raised to 105,369 -> 308 px
])
def test_qwen_vl_utils_sizes_frames_by_its_own_rule(spec, frames, side, minimum, maximum, total, tokens):
    qwen = spec("qwen2_vl_7b")
    data = DataShape(1, 400_000, images_per_sample=0, videos_per_sample=1, video_frames=frames, video_size=side,
                     video_min_pixels=minimum, video_max_pixels=maximum, video_total_pixels=total,
                     video_processor="qwen_vl_utils")
    assert qwen.video_tokens(data) == tokens


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_pixel_values_videos_are_what_the_processors_patchify_makes_of_the_resized_frames(spec, video_processor, name):
    tiny = spec(name)
    data = DataShape(2, 200, images_per_sample=1, image_size=56, videos_per_sample=2, video_frames=3, video_size=84,
                     video_min_pixels=3136)
    t, rows, cols = tiny.video_grid(data)
    frames = torch.zeros(1, 3, 3, rows * 14, cols * 14)  # one video: 3 frames, resized, channels first
    patches, *grid = video_processor.patchify(None, frames, patch_size=14, merge_size=2, temporal_patch_size=2)
    batch = tiny.batch(data, CPU)
    assert list(batch["video_grid_thw"][0]) == grid == [2, 6, 6]  # 3 frames padded to 4: 2 temporal patches
    assert batch["video_grid_thw"].shape == (4, 3)  # 2 samples x 2 videos
    assert batch["pixel_values_videos"].shape == (4 * patches.shape[1], patches.shape[2])
    assert batch["pixel_values_videos"].dtype == torch.float32
    assert (batch["mm_token_type_ids"] == 2).sum() == 2 * tiny.video_tokens(data)


@pytest.mark.parametrize("frames,total", [(400, 90316800), (64, 90316800), (64, 9031680), (16, 1000)])
def test_the_total_pixel_cap_lowers_the_frame_cap_as_the_processor_does(spec, video_processor, monkeypatch,
                                                                        frames, total):
    from transformers.image_utils import SizeDict
    from transformers.video_processing_utils import BaseVideoProcessor

    qwen = spec("qwen2_vl_7b")
    data = DataShape(1, 10**7, images_per_sample=0, videos_per_sample=1, video_frames=frames, video_size=1000,
                     video_total_pixels=total)
    asked = {}
    monkeypatch.setattr(BaseVideoProcessor, "resize", lambda self, image, size, **_: asked.update(size=size))
    processor = object.__new__(video_processor)
    processor.max_video_tokens = total / (0.9 * 28 * 28)  # the processor's budget: 90% of this many tokens' pixels
    video = torch.zeros(1, 1, 3, 1, 1).expand(1, frames, 3, 1000, 1000)  # shapes only
    processor.resize(video, size=SizeDict(shortest_edge=VIDEO_MIN, longest_edge=VIDEO_MAX), resample=None, factor=28,
                     temporal_factor=2, cap_pixels_per_frame=True)
    _, rows, cols = qwen.video_grid(data)
    assert (rows * 14, cols * 14) == (asked["size"].height, asked["size"].width)


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_batch_position_ids_with_videos_are_the_models_own_m_rope_index(spec, name):
    tiny = spec(name)
    model = tiny.build("cpu", torch.float32)
    for data in (DataShape(2, 120, images_per_sample=0, videos_per_sample=1, video_frames=4, video_size=84,
                           video_min_pixels=3136),
                 DataShape(1, 300, images_per_sample=2, image_size=56, videos_per_sample=2, video_frames=7,
                           video_size=112, video_min_pixels=3136)):
        batch = tiny.batch(data, CPU)
        n_videos = batch["video_grid_thw"].shape[0]
        # Qwen2.5-VL: what Qwen2_5_VLProcessor returns at its default 2 fps, temporal_patch_size / fps seconds each
        seconds = {"second_per_grid_ts": torch.full((n_videos,), 2 / 2.0)} if "2_5" in name else {}
        expected, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                                 batch.get("image_grid_thw"), batch["video_grid_thw"], **seconds)
        assert torch.equal(batch["position_ids"], expected)


def test_qwen2_5_vl_spaces_a_videos_temporal_patches_by_tokens_per_second(spec):
    # tokens_per_second 2 (the shipped configs) x 1 s per temporal patch (2 frames at 2 fps): steps of 2
    tiny = spec("qwen2_5_vl_tiny")
    data = DataShape(1, 60, images_per_sample=0, videos_per_sample=1, video_frames=6, video_size=56,
                     video_min_pixels=3136)
    t_row = tiny.batch(data, CPU)["position_ids"][0, 0].tolist()
    assert t_row[1:13] == [1] * 4 + [3] * 4 + [5] * 4  # after <|vision_start|> at 0: 3 patches of 2 x 2 tokens


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_a_two_frame_video_costs_what_the_same_still_image_costs(point, name):
    # an image is one temporal patch (the processor repeats it over 2 frames): a 2-frame video of the same size is
    # the same patches through the same tower and the same number of LM tokens, so every byte figure must agree
    common = [f"model={name}", "data.batch_size=2", "data.lm_max_length=100", "measure.backend=estimate",
              "measure.steps=2"]
    image = measure(point(common + ["data.image_size=112"]))
    video = measure(point(common + ["data.images_per_sample=0", "data.videos_per_sample=1", "data.video_frames=2",
                                    "data.video_size=112", "data.video_min_pixels=3136"]))
    assert image["status"] == video["status"] == "ok", (image.get("error"), video.get("error"))
    assert {k: v for k, v in video.items() if k.endswith("_bytes")} == {
        k: v for k, v in image.items() if k.endswith("_bytes")}


BYTE_COLUMNS = ("peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
                "after_load_bytes", "after_step_bytes", "activations_bytes", "grads_bytes", "optimizer_state_bytes")


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
@pytest.mark.parametrize("setting", [
    ["data.images_per_sample=0", "data.video_frames=5"],
    ["data.video_frames=8", "data.videos_per_sample=2", "train.grad_ckpt.vision=true", "train.param_dtype=bfloat16",
     "train.autocast_dtype=null"],
])
def test_estimate_equals_the_cpu_backend_to_the_byte_with_videos(point, name, setting):
    base = [f"model={name}", "data.batch_size=2", "data.lm_max_length=160", "data.image_size=56",
            "data.videos_per_sample=1", "data.video_size=84", "data.video_min_pixels=3136", *setting]
    cpu = measure(point(base + ["measure.backend=cpu"]))
    estimate = measure(point(base + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok", (cpu.get("error"), estimate.get("error"))
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


def test_more_frames_cost_more_memory_by_their_tokens(plan_points):
    rows = {}
    for frames in (4, 8):
        (p,) = plan_points(["model=qwen2_vl_tiny", "data.images_per_sample=0", "data.videos_per_sample=1",
                            f"data.video_frames={frames}", "data.video_size=56", "data.video_min_pixels=3136",
                            "data.lm_max_length=64", "measure.backend=estimate"])
        assert p.inputs["video_tokens"] == frames // 2 * 4 and p.inputs["image_size"] is None
        rows[frames] = measure(p.config)
    assert rows[8]["activations_bytes"] > rows[4]["activations_bytes"]


def test_a_video_point_runs_the_grpo_step_as_a_real_run_does(point):
    # the rollout's prefill sees the video through get_video_features with the collator's window index; every
    # phase but generation to the byte, generation within tests/test_grpo.py's 2 KiB (generate's scalar reads)
    rows = {backend: measure(point(["model=qwen2_5_vl_tiny", "step=grpo", "data.lm_max_length=60",
                                    "data.batch_size=4", "step.max_completion_length=4", "measure.steps=1",
                                    f"measure.backend={backend}", "data.videos_per_sample=1", "data.video_frames=4",
                                    "data.video_size=56", "data.video_min_pixels=3136", "data.image_size=56"]))
            for backend in ("cpu", "estimate")}
    assert rows["cpu"]["status"] == rows["estimate"]["status"] == "ok", [r.get("error") for r in rows.values()]
    phases = ("reference", "forward", "backward", "optimizer")
    assert {p: rows["estimate"][f"{p}_peak_bytes"] for p in phases} == {p: rows["cpu"][f"{p}_peak_bytes"] for p in phases}
    assert abs(rows["estimate"]["generate_peak_bytes"] - rows["cpu"]["generate_peak_bytes"]) <= 2048


@pytest.mark.parametrize("overrides,message", [
    (["model=llava_tiny", "data.videos_per_sample=1", "data.video_frames=4"],
     r"^data\.videos_per_sample=1 is not allowed for llava_tiny: videos are modelled for Qwen2-VL and Qwen2\.5-VL"),
    (["model=internvl_tiny", "data.images_per_sample=0", "data.videos_per_sample=2", "data.video_frames=4"],
     r"^data\.videos_per_sample=2 is not allowed for internvl_tiny: videos are modelled for Qwen2-VL and Qwen2\.5-VL"),
    (["model=qwen3_vl_tiny", "data.videos_per_sample=1", "data.video_frames=4"],
     r"^data\.videos_per_sample=1 is not allowed for qwen3_vl_tiny: its processor writes every frame's timestamp"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=1"],
     r"^data\.video_frames=None is not allowed with data\.videos_per_sample=1: give the frames"),
    (["model=qwen2_vl_tiny", "data.images_per_sample=0"],
     r"^data\.images_per_sample=0 is not allowed without videos"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=-1"],
     r"^data\.videos_per_sample=-1 is not allowed: it must be 0 or a positive integer$"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=1", "data.video_frames=0"],
     r"^data\.video_frames=0 is not allowed: it must be a positive integer or null$"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=1", "data.video_frames=4", "data.video_max_pixels=700"],
     r"^data\.video_max_pixels=700 is not allowed for qwen2_vl_tiny: a frame is at least one 28 x 28 px block"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=1", "data.video_frames=4", "data.video_min_pixels=700000",
      "data.video_max_pixels=602112", "data.video_processor=qwen_vl_utils"],
     r"^data\.video_max_pixels=602112 is not allowed for qwen2_vl_tiny with data\.video_processor=qwen_vl_utils: it "
     r"must be at least video_min_pixels=700000 \(qwen-vl-utils' smart_resize asserts"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=1", "data.video_frames=4", "data.video_processor=decord"],
     r"^data\.video_processor='decord' is not allowed: use one of transformers, qwen_vl_utils$"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=1", "data.video_frames=4", "data.video_size=20"],
     r"^data\.video_size=20 is not allowed for qwen2_vl_tiny: a side must be at least 28 px"),
    (["model=qwen2_vl_tiny", "data.videos_per_sample=1", "data.video_frames=16", "data.video_size=448",
      "data.images_per_sample=0", "data.lm_max_length=100"],
     r"^data\.lm_max_length=100 is too short for qwen2_vl_tiny: the videos take 2048 tokens plus 2 vision markers "
     r"each, so it must be at least 2051$"),
])
def test_bad_video_settings_are_refused_in_one_line(plan_points, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_points(overrides)


def test_model_hf_takes_the_video_bounds_where_transformers_video_processor_loader_finds_them(compose, tmp_path):
    # transformers 5.24's BaseVideoProcessor.get_video_processor_dict: video_preprocessor_config.json, else
    # preprocessor_config.json (the image processor's file, bounds and all), else the class defaults
    import json
    import shutil

    from vlmprobe.point.build import build_spec

    shutil.copy(TESTS_DATA / "qwen2_vl_tiny" / "config.json", tmp_path / "config.json")

    def bounds():
        spec = build_spec(compose(["model=hf", f"model.config={tmp_path}"]).model)
        return spec.video_min_pixels, spec.video_max_pixels

    assert bounds() == (VIDEO_MIN, VIDEO_MAX)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    assert bounds() == (3136, 12845056)
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 4096, "longest_edge": 65536}}))
    assert bounds() == (4096, 65536)
