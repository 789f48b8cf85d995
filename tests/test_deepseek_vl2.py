"""DeepSeek-VL2: the published models' sizes on meta against hand counts and the Hub's figures, the image tokens by
hand from the processor's rule (processing_deepseek_vl_v2.py: select_best_resolution, h (w + 1) + 1 + (th h)(tw w +
1)), the batch's inputs against each other and against the rows the model itself lays out, the MLA LM through the
estimate and cpu backends to the byte, a deepseek_vl_v2 config.json through model=hf, and what cannot be built
refused in one line. (The toy through every knob, estimate == cpu: test_families.py.)"""

import json

import pytest
import torch

from hand_counts import siglip_params
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params
from vlmprobe.models.deepseek_vl2 import best_resolution
from vlmprobe.point.measure import measure

CPU = torch.device("cpu")
BYTE_COLUMNS = ("peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
                "after_load_bytes", "activations_bytes", "grads_bytes", "optimizer_state_bytes", "params_bytes")


def pooling_head_params(v: dict) -> int:
    """SigLIP's attention-pooling head (timm's AttentionPoolLatent has as many): a probe, the attention's packed
    q/k/v and output Linears with bias, a LayerNorm, the MLP."""
    d, f = v["hidden_size"], v["intermediate_size"]
    return d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)


def deepseek_lm_params(t: dict) -> int:
    """A DeepSeek-V2 LM with its untied head: per layer the attention (multi-head q/k/v/o without bias, or MLA:
    q_proj, kv_a_proj_with_mqa, the latent's RMSNorm, kv_b_proj, o_proj) and two RMSNorms; a SwiGLU MLP in the first
    first_k_dense_replace layers, then routed experts, the shared experts' SwiGLU (n_shared x moe width) and the
    router's weight; the final norm."""
    d, heads, vocab = t["hidden_size"], t["num_attention_heads"], t["vocab_size"]
    if t["kv_lora_rank"] is None:
        attention = 4 * d * d
    else:
        rank, nope, rope, v = t["kv_lora_rank"], t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
        attention = d * heads * (nope + rope) + d * (rank + rope) + rank + rank * heads * (nope + v) + heads * v * d
    moe, experts = t["moe_intermediate_size"], t["n_routed_experts"]
    routed = experts * 3 * d * moe + 3 * d * moe * t["n_shared_experts"] + experts * d
    dense = t["first_k_dense_replace"]
    layers = t["num_hidden_layers"] * (attention + 2 * d) + dense * 3 * d * t["intermediate_size"]
    return 2 * vocab * d + layers + (t["num_hidden_layers"] - dense) * routed + d


# The Hub shows "3.37B params" for deepseek-vl2-tiny (its safetensors, e.g. huggingface.co/FriendliAI/deepseek-vl2-tiny
# and mlx-community/deepseek-vl2-tiny-bf16) and a 6.74 GB bf16 file; "16B" for deepseek-vl2-small, whose four bf16
# shards are 8.59 GB x 3 + 6.52 GB. Without the unused pooling head the tiny model would be 3.355B (6.71 GB).
@pytest.mark.parametrize("name,total,hub,file_gb", [
    ("deepseek_vl2_tiny", 3_370_501_440, "3.37", 6.74),
    ("deepseek_vl2_small", 16_148_349_504, "16.1", 8.59 * 3 + 6.52),
])
def test_the_published_models_on_meta_match_the_hand_count_and_the_hubs_figures(spec, name, total, hub, file_gb):
    vl2 = spec(name)
    model = vl2.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (total, total)
    d = vl2.text["hidden_size"]
    parts = (count_params(model.model.vision)[0], count_params(model.model.projector)[0],
             model.model.image_newline.numel() + model.model.view_seperator.numel(),
             count_params(model.model.language)[0])
    unshuffled = 4 * vl2.vision["hidden_size"]  # a 2 x 2 block of patches
    assert parts == (siglip_params(vl2.vision) + pooling_head_params(vl2.vision), (unshuffled * d + d) + (d * d + d),
                     2 * d, deepseek_lm_params(vl2.text))
    assert sum(parts) == total
    assert f"{total / 1e9:.3g}" == hub and abs(2 * total / 1e9 - file_gb) < 0.02


def tiny_tokens(across: int, down: int) -> int:
    """The processor's count for DeepSeek-VL2's 384 px tiles of 14 px patches, downsampled by 2:
    h = w = ceil(27 / 2) = 14; the global view 14 x 15, the separator, the grid (14 down) x (14 across + 1)."""
    return 14 * 15 + 1 + (14 * down) * (14 * across + 1)


# (px per side, images in the sample) -> tokens
SIZES = {(384, 1): 421,        # one tile: 210 + 1 + 14 x 15
         (200, 1): 421,        # smaller than a tile: still the 384 x 384 candidate (least waste)
         (385, 1): 1023,       # just above: 2 x 2 tiles show all of it, 210 + 1 + 28 x 29
         (768, 1): 1023,
         (769, 1): 2017,       # 3 x 3 tiles: 210 + 1 + 42 x 43
         (3000, 1): 2017,      # the largest square candidate
         (768, 2): 2 * 1023,   # two images in a sample are still tiled
         (768, 3): 3 * 421}    # three or more are not: one tile each


def test_image_tokens_follow_the_processors_rule(spec):
    vl2 = spec("deepseek_vl2_tiny")
    for (side, images), tokens in SIZES.items():
        data = DataShape(batch_size=1, lm_max_length=8192, image_size=side, images_per_sample=images)
        tiles = {421: 1, 1023: 2, 2017: 3}[tokens // images]
        assert vl2.image_tokens(data) == tokens == images * tiny_tokens(tiles, tiles), (side, images)
        assert vl2.grid(data) == (tiles, tiles)


def test_the_best_resolution_keeps_the_most_of_the_image_then_wastes_the_least():
    tiny = [(384 * m, 384 * n) for m, n in [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2), (3, 3)]]
    assert best_resolution(768, 384, tiny) == (768, 384)   # [width, height]: wide image, two tiles across
    assert best_resolution(384, 768, tiny) == (384, 768)
    assert best_resolution(1000, 300, tiny) == (1152, 384)  # shown whole (as on 1152 x 1152), the least area empty
    assert best_resolution(100, 100, tiny) == (384, 384)    # every candidate shows it all: the least waste


def test_batch_inputs_are_consistent_with_each_other(spec):
    toy = spec("deepseek_vl2_toy")  # 84 px, two images: 2 x 2 tiles each, 2 x 3 + 1 + 4 x 5 = 27 tokens each
    data = DataShape(batch_size=3, lm_max_length=80, image_size=84, images_per_sample=2)
    batch = toy.batch(data, CPU)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["images_seq_mask"]
    assert ids.shape == labels.shape == mask.shape == (3, 80) and mask.dtype == torch.bool
    assert toy.image_tokens(data) == 54 and mask.sum(dim=1).tolist() == [54] * 3
    assert mask[:, 1:55].all() and not mask[:, 0].any() and not mask[:, 55:].any()
    assert ((ids == toy.image_token_id) == mask).all() and (ids[:, 0] == toy.text["bos_token_id"]).all()
    assert (labels[:, :55] == IGNORE_INDEX).all() and (labels[:, 55:] == ids[:, 55:]).all()
    assert (ids[:, 55:] < toy.image_token_id).all()
    assert batch["images"].shape == (3, 2 * 5, 3, 42, 42) and batch["images"].dtype == torch.float32
    assert batch["images_spatial_crop"].tolist() == [[[2, 2], [2, 2]]] * 3


@pytest.mark.parametrize("position", ["head", "tail"])
def test_the_model_lays_out_each_image_where_the_processor_puts_its_tokens(spec, monkeypatch, position):
    toy = spec("deepseek_vl2_toy", f"model.global_view_pos={position}")
    torch.manual_seed(0)
    model = toy.build("cpu", torch.float32)
    batch = toy.batch(DataShape(batch_size=2, lm_max_length=40, image_size=84), CPU)  # 27 tokens at 1..27
    scattered, scatter = [], torch.Tensor.masked_scatter_

    def counted(self, mask, source):
        scattered.append(source.shape[0])
        return scatter(self, mask, source)

    monkeypatch.setattr(torch.Tensor, "masked_scatter_", counted)
    with torch.no_grad():
        embeds = model.model.inputs_embeds(batch["input_ids"], batch["images"], batch["images_seq_mask"],
                                           batch["images_spatial_crop"])
    assert scattered == [27, 27]  # one sample's rows each, exactly the tokens its mask has
    newline, separator = model.model.image_newline, model.model.view_seperator
    # head: global rows [x x \n] x 2 (1-6), the separator (7), the grid's 4 rows [x x x x \n] (8-27); tail: the grid
    # (1-20), the separator (21), the global view (22-27)
    grid_first = 8 if position == "head" else 1
    newlines = ([3, 6] if position == "head" else [24, 27]) + [grid_first + 5 * r + 4 for r in range(4)]
    for sample in embeds:
        assert all(torch.equal(sample[i], newline) for i in newlines)
        assert torch.equal(sample[7 if position == "head" else 21], separator)
        others = [i for i in range(1, 28) if i not in newlines and i != (7 if position == "head" else 21)]
        assert not any(torch.equal(sample[i], newline) or torch.equal(sample[i], separator) for i in others)


@pytest.mark.slow  # about 8 s: a point on each backend (the multi-head toy runs in test_families.py's fast suite)
def test_an_mla_lm_estimate_equals_the_cpu_backend_to_the_byte(plan_points):
    mla = ["model=deepseek_vl2_toy", "model.text.kv_lora_rank=32", "model.text.qk_nope_head_dim=16",
           "model.text.qk_rope_head_dim=8", "model.text.v_head_dim=16", "data.batch_size=2", "data.lm_max_length=48",
           "train.param_dtype=bfloat16", "train.autocast_dtype=null"]
    rows = {}
    for backend in ("estimate", "cpu"):
        (planned,) = plan_points(mla + [f"measure.backend={backend}"])
        rows[backend] = measure(planned.config)
        assert rows[backend]["status"] == "ok", rows[backend].get("error")
    assert {k: rows["estimate"][k] for k in BYTE_COLUMNS} == {k: rows["cpu"][k] for k in BYTE_COLUMNS}


# deepseek-ai/deepseek-vl2-tiny's config.json in its own layout, the keys DeepSeek's classes read (the yaml's sources)
TINY_JSON = {
    "model_type": "deepseek_vl_v2", "architectures": ["DeepseekVLV2ForCausalLM"], "tile_tag": "2D",
    "global_view_pos": "head",
    "candidate_resolutions": [[384 * m, 384 * n] for m, n in [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (4, 1),
                                                            (2, 2), (1, 5), (5, 1), (1, 6), (6, 1), (2, 3), (3, 2),
                                                            (1, 7), (7, 1), (1, 8), (8, 1), (2, 4), (4, 2), (1, 9),
                                                            (9, 1), (3, 3)]],
    "vision_config": {"model_type": "vision", "model_name": "siglip_so400m_patch14_384", "image_size": 384,
                      "patch_size": 14, "width": 1152, "layers": 27, "mlp_ratio": 3.7362},
    "projector_config": {"model_type": "mlp_projector", "projector_type": "downsample_mlp_gelu", "input_dim": 1152,
                         "n_embed": 1280, "depth": 2, "mlp_ratio": 1, "downsample_ratio": 2},
    "language_config": {"model_type": "deepseek_v2", "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1,
                        "hidden_size": 1280, "intermediate_size": 6848, "kv_lora_rank": None, "lm_head": True,
                        "max_position_embeddings": 4096, "moe_intermediate_size": 896, "n_group": 1,
                        "n_routed_experts": 64, "n_shared_experts": 2, "num_attention_heads": 10,
                        "num_experts_per_tok": 6, "num_hidden_layers": 12, "num_key_value_heads": 10,
                        "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "rm_head": False,
                        "topk_group": 1, "topk_method": "greedy", "use_mla": False, "v_head_dim": 0,
                        "vocab_size": 129280}}


def written(tmp_path, config: dict) -> str:
    folder = tmp_path / "deepseek-vl2-tiny"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return f"model.config={folder}"


def test_a_published_config_json_builds_what_the_shipped_yaml_builds(spec, tmp_path):
    from_json, from_yaml = spec("hf", written(tmp_path, TINY_JSON)), spec("deepseek_vl2_tiny")
    assert type(from_json) is type(from_yaml) and from_json.name == "deepseek-vl2-tiny"
    assert from_json.config().to_dict() == from_yaml.config().to_dict()
    assert from_json.vision_config().to_dict() == from_yaml.vision_config().to_dict()
    json_model, yaml_model = (s.build("meta", torch.bfloat16, init=False) for s in (from_json, from_yaml))
    assert [(n, p.shape) for n, p in json_model.named_parameters()] == [(n, p.shape) for n, p in
                                                                       yaml_model.named_parameters()]
    data = DataShape(batch_size=1, lm_max_length=4096, image_size=1000)
    assert from_json.image_tokens(data) == from_yaml.image_tokens(data) == 2017


@pytest.mark.parametrize("overrides,message", [
    (["model.text.topk_method=noaux_tc"], r"^model\.text\.topk_method='noaux_tc' is not allowed for deepseek_vl2_toy: "
                                          r"use greedy or group_limited_greedy \(DeepSeek-VL2's gate asserts it is not "
                                          r"training\)$"),
    (["model.candidate_resolutions=[[42,42],[42,100]]"],
     r"^model\.candidate_resolutions=\[\[42, 42\], \[42, 100\]\] is not allowed for deepseek_vl2_toy: give \[width, "
     r"height\] pairs in multiples of the 42 px tile"),
    (["data.image_size=84", "data.lm_max_length=28"],
     r"^data\.lm_max_length=28 is too short for deepseek_vl2_toy at 84 px: the images take 27 tokens plus <bos>, so it "
     r"must be at least 29$"),
])
def test_values_deepseek_vl2_cannot_take_are_one_line(plan_points, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_points(["model=deepseek_vl2_toy", *overrides])


@pytest.mark.parametrize("section,changes,message", [
    (None, {"tile_tag": "1D"}, r"^tile_tag='1D' in deepseek-vl2-tiny's deepseek_vl_v2 config\.json is not allowed: "
                               r"use 2D"),
    ("language_config", {"use_mla": True}, r"^language_config\.kv_lora_rank=None in .* is not allowed: use_mla true "
                                           r"needs a kv_lora_rank$"),
    ("projector_config", {"n_embed": 2048}, r"^projector_config\.n_embed=2048 in .* is not allowed: it must be the "
                                            r"LM's hidden_size \(1280\)$"),
])
def test_a_config_json_that_cannot_map_is_one_line(plan_points, tmp_path, section, changes, message):
    config = json.loads(json.dumps(TINY_JSON))
    (config[section] if section else config).update(changes)
    with pytest.raises(ConfigError, match=message) as error:
        plan_points(["model=hf", written(tmp_path, config)])
    assert "\n" not in str(error.value)


def test_flash_attention_is_offered_as_both_parts_have_a_path_for_it(plan_points):
    (planned,) = plan_points(["model=deepseek_vl2_toy", "model.attn_implementation=flash_attention_2",
                              "measure.backend=estimate"])
    assert planned.config["model"]["attn_implementation"] == "flash_attention_2" and not planned.skip
