"""Qwen2.5-VL: exact sizes from the configs, the window-attention index against transformers' own, and the
model fed the precomputed index computing what it computes by itself. (Processor arithmetic, batch layout
and M-RoPE are Qwen2-VL's, tested in test_qwen2_vl.py; estimate vs cpu and the knobs in test_families.py.)"""

import pytest
import torch

from vlmprobe.models.base import DataShape, count_params
from vlmprobe.models.qwen2_5_vl import window_index

CPU = torch.device("cpu")


def vision_params(v: dict) -> int:
    """Hand count of a Qwen2.5-VL vision tower from its config (no transformers): Conv3d patch embedding
    without bias; per block two RMSNorms, qkv and proj with bias, a gated MLP with bias; the merger's
    RMSNorm and its two Linears (4 * width -> 4 * width -> out_hidden_size)."""
    d, f, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * d
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * (d * f + f) + (f * d + d)
    merged = d * v["spatial_merge_size"] ** 2
    merger = d + (merged * merged + merged) + (merged * out + out)
    return patch + v["depth"] * block + merger


def lm_params(t: dict) -> int:
    """Hand count of a Qwen2 LM (no head): embedding, per layer q/k/v with bias, o without, SwiGLU MLP, two
    RMSNorms; the final norm."""
    d, f, heads, kv = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = d // heads
    layer = (d * d + d) + 2 * (d * kv * head_dim + kv * head_dim) + d * d + 3 * d * f + 2 * d
    return t["vocab_size"] * d + t["num_hidden_layers"] * layer + d


def _split(model):
    visual = sum(p.numel() for p in model.model.visual.parameters())
    lm = sum(p.numel() for p in model.model.language_model.parameters())
    return visual, lm, model.lm_head.weight.numel()


# Published: the Hub's safetensors parameter counts of Qwen/Qwen2.5-VL-{3B,7B,72B}-Instruct ("3.75B", "8.29B",
# "73.4B" on the model pages; the exact figures below are recalled, not re-read here: no hub access). Each is
# also checked against the hand count from the YAML's hyperparameters, so the figure is pinned by arithmetic.
@pytest.mark.parametrize("name,total,split", [
    ("qwen2_5_vl_3b", 3_754_622_976, (668_684_288, 3_085_938_688, 311_164_928)),  # lm_head tied: counted once
    ("qwen2_5_vl_7b", 8_292_166_656, (676_550_144, 7_070_619_136, 544_997_376)),
    ("qwen2_5_vl_72b", 73_410_777_344, (704_573_696, 71_460_495_360, 1_245_708_288)),
])
def test_published_sizes_on_meta_match_the_hand_count_of_the_config(spec, name, total, split):
    qwen = spec(name)
    model = qwen.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (total, total)
    assert _split(model) == split
    head = 0 if qwen.tie_word_embeddings else qwen.text["vocab_size"] * qwen.text["hidden_size"]
    assert total == vision_params(qwen.vision) + lm_params(qwen.text) + head
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == qwen.tie_word_embeddings


def test_the_7b_differs_from_qwen2_vl_7b_only_in_its_vision_tower(spec):
    new, old = (spec(n).build("meta", torch.bfloat16, init=False) for n in ("qwen2_5_vl_7b", "qwen2_vl_7b"))
    assert _split(new)[1:] == _split(old)[1:]
    assert _split(new)[0] - _split(old)[0] == 676_550_144 - 675_759_104


@pytest.mark.parametrize("grids,window_size", [
    ([(32, 32)], 112),                    # 448 px: 16 x 16 merged tokens, exactly 4 x 4 windows (+ an empty padded row)
    ([(36, 36)], 112),                    # 504 px: 18 x 18, windows cut at the edge
    ([(8, 8), (36, 20), (4, 4)], 112),    # several images of different sizes
    ([(8, 8), (8, 8)], 56),               # the tiny config's windows
    ([(6, 10)], 28),                      # windows of one merged token
])
def test_window_index_is_the_one_transformers_computes(grids, window_size):
    vision_utils = pytest.importorskip("transformers.vision_utils")
    grid_thw = torch.tensor([[1, rows, cols] for rows, cols in grids])
    expected_index, expected_bounds = vision_utils.get_vision_window_index(grid_thw, 2, window_size, 14)
    order, bounds = window_index(grids, 2, window_size, 14)
    assert order == expected_index.tolist()
    assert bounds == expected_bounds.tolist()


def test_the_batch_carries_the_window_index_of_each_image(spec):
    tiny = spec("qwen2_5_vl_tiny")  # 112 px -> 8 x 8 patches -> 4 x 4 merged tokens in 2 x 2 windows of 2 x 2
    batch = tiny.batch(DataShape(batch_size=2, lm_max_length=60, images_per_sample=2), CPU)
    index, bounds = batch["image_window_index"], batch["image_cu_window_seqlens"]
    assert index.dtype == torch.long and bounds.dtype == torch.int32
    assert sorted(index.tolist()) == list(range(4 * 16))  # a permutation of every merged token
    assert index[:4].tolist() == [0, 1, 4, 5]  # the first window: the top-left 2 x 2 merged tokens
    assert bounds.tolist() == list(range(0, 4 * 64 + 1, 16))  # 4 windows per image, 4 merged tokens = 16 patches each


def test_the_model_given_the_precomputed_window_index_computes_what_it_computes_itself(spec):
    tiny = spec("qwen2_5_vl_tiny")
    torch.manual_seed(0)
    model = tiny.build("cpu", torch.float32)
    batch = tiny.batch(DataShape(batch_size=2, lm_max_length=80, images_per_sample=2, image_size=150), CPU)
    own = {k: v for k, v in batch.items() if k not in ("image_window_index", "image_cu_window_seqlens")}
    patches, n_images = batch["pixel_values"].shape[0], 4
    whole = {**own, "image_window_index": torch.arange(patches // 2**2),  # merged tokens in order, and
             "image_cu_window_seqlens": torch.arange(0, patches + 1, patches // n_images, dtype=torch.int32)}  # one window per image
    with torch.no_grad():
        given, computed, unwindowed = (tiny.loss(model, b)[1].logits for b in (batch, own, whole))
    torch.testing.assert_close(given, computed, rtol=0, atol=0)
    assert not torch.allclose(given, unwindowed)  # and the model does use what it is given


def test_window_and_full_attention_blocks_are_as_the_config_says(spec):
    model = spec("qwen2_5_vl_7b").build("meta", torch.bfloat16, init=False)
    visual = model.model.visual
    assert list(visual.fullatt_block_indexes) == [7, 15, 23, 31] and visual.window_size == 112
    assert type(visual.blocks[0].norm1).__name__ == "Qwen2_5_VLRMSNorm"
    assert visual.blocks[0].mlp.gate_proj.bias is not None  # gated MLP with bias
    assert visual.merger.mlp[2].out_features == 3584


@pytest.mark.parametrize("size", [1, 3, 27])
def test_an_image_side_below_one_28_px_block_is_refused(plan_points, size):
    from vlmprobe.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"data.image_size={size} is not allowed for qwen2_5_vl_tiny: a side must "
                                          rf"be at least 28 px"):
        plan_points(["model=qwen2_5_vl_tiny", f"data.image_size={size}"])


def test_the_native_448_px_image_is_256_tokens_of_the_7b(plan_points):
    (point,) = plan_points(["model=qwen2_5_vl_7b", "data.lm_max_length=1024"])
    assert point.inputs["image_tokens"] == 256 and point.inputs["params"] == 8_292_166_656
