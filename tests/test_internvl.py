"""InternVL: exact sizes from the config, the tiles against the real image processor (GotOcr2ImageProcessorPil with
InternVL's crop_to_patches, built offline) and the model's own image features, consistent inputs. (Estimate vs cpu
and the knobs: test_families.py.)"""

import json

import pytest
import torch

from conftest import TESTS
from hand_counts import qk_norm_lm_params, qwen2_params
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params

CPU = torch.device("cpu")


def internvit_params(v: dict) -> int:
    """Hand count of InternViT: class token, Conv2d patch embedding with bias, a position embedding per patch and
    the class token; per layer q/k/v/o with bias, two MLP Linears with bias, two LayerNorms and two layer scales."""
    d, f, side = v["hidden_size"], v["intermediate_size"], v["image_size"][0] // v["patch_size"][0]
    embeddings = d + v["num_channels"] * v["patch_size"][0] ** 2 * d + d + (side**2 + 1) * d
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d + 2 * d
    return embeddings + v["num_hidden_layers"] * layer


def test_internvl3_2b_on_meta_has_the_hand_counted_parameters(spec):
    # 2,088,957,440: the Hub shows "2.09B" for OpenGVLab/InternVL3-2B-hf (recalled, no hub access here; no exact
    # published figure was at hand), equal to the hand count of its parts below
    internvl = spec("internvl3_2b")
    model = internvl.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (2_088_957_440, 2_088_957_440)
    assert count_params(model.model.vision_tower)[0] == internvit_params(internvl.vision)
    assert count_params(model.model.language_model)[0] == qwen2_params(internvl.text)
    d_in, d = internvl.vision["hidden_size"] * 4, internvl.text["hidden_size"]  # 2 x 2 pixel shuffle
    assert count_params(model.model.multi_modal_projector)[0] == 2 * d_in + (d_in * d + d) + (d * d + d)
    assert count_params(model.lm_head)[0] == internvl.text["vocab_size"] * d  # untied


@pytest.mark.parametrize("size,tiles", [(3, 1), (448, 1), (633, 1), (634, 5), (950, 5), (951, 10), (3000, 10)])
def test_tiles_are_what_the_real_image_processor_makes(spec, size, tiles):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    from transformers import GotOcr2ImageProcessorPil

    # OpenGVLab/InternVL3-2B-hf's preprocessor_config.json: 448 px tiles, 1 to 12 of them, with a thumbnail
    processor = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1,
                                         max_patches=12)
    real = processor(images=[image.fromarray(np.zeros((size, size, 3), dtype=np.uint8))], return_tensors="pt")
    internvl = spec("internvl3_2b")
    data = DataShape(batch_size=1, lm_max_length=4096, image_size=size)
    assert internvl.tiles(data) == real["num_patches"][0] == tiles
    ours = internvl.batch(data, CPU)
    assert ours["pixel_values"].shape == real["pixel_values"].shape and ours["pixel_values"].dtype == real["pixel_values"].dtype


def test_image_tokens_are_what_the_models_image_features_have(spec):
    tiny = spec("internvl_tiny")
    model = tiny.build("cpu", torch.float32)
    data = DataShape(batch_size=1, lm_max_length=64, image_size=112)
    with torch.no_grad():
        features = model.model.get_image_features(tiny.batch(data, CPU)["pixel_values"], vision_feature_layer=-1,
                                                  vision_feature_select_strategy="default").pooler_output
    assert features.shape[0] * features.shape[1] == tiny.image_tokens(data) == 5 * 4  # 2 x 2 tiles + thumbnail


def test_batch_inputs_are_consistent_with_each_other(spec):
    tiny = spec("internvl_tiny")
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=64, images_per_sample=2, image_size=112), CPU)
    ids, labels = batch["input_ids"], batch["labels"]
    image = ids == tiny.image_token_id
    assert ids.shape == labels.shape == (3, 64) and (image.sum(dim=1) == 40).all()
    prompt = 2 * (1 + 20 + 1)  # per image <img>, 5 tiles x 4 tokens, </img>
    assert (labels[:, :prompt] == IGNORE_INDEX).all() and torch.equal(labels[:, prompt:], ids[:, prompt:])
    assert not image[:, prompt:].any() and batch["pixel_values"].shape == (30, 3, 56, 56)


# -- internvl_chat: the InternVL repository's own config.json format, built as the native model --------------------

CHAT = TESTS / "data" / "hf"
# tests/data/hf/InternVL3-1B/config.json: OpenGVLab/InternVL3-1B's config as `print(model.config)` of the downloaded
# model shows it, with the model's module tree, in shivangjhalani/multicoco InternVL3-1B_data.md (no hub access
# here). tests/data/hf/InternVL2-8B/config.json: OpenGVLab/InternVL2-8B's config.json as a public copy in a serving
# project's ModelConfig.get_config_json (the valora package) has it, Python literals written as JSON; its model card
# (huggingface.co/OpenGVLab/InternVL2-8B) says "InternViT-300M-448px, an MLP projector, and internlm2_5-7b-chat" and
# "Model Size 8.1B". InternVL2_5-8B's card names the same parts (InternViT-300M-448px-V2_5, internlm2_5-7b-chat): the
# same shapes; its own file was not found in the stored copies.


def chat_config(name: str) -> dict:
    return json.loads((CHAT / name / "config.json").read_text())


def chat_internvit_params(v: dict) -> int:
    """Hand count of the chat code's InternVisionModel (modeling_intern_vit.py) from its vision_config: class
    embedding, Conv2d(3, width) patch embedding with bias, a position per patch and the class token; per layer a
    fused qkv Linear (bias if qkv_bias), proj with bias, q/k RMSNorms of the width if qk_normalization, fc1 / fc2
    with bias, two norms (LayerNorm: weight and bias; RMSNorm: weight), ls1 / ls2; no final norm."""
    d, f, side = v["hidden_size"], v["intermediate_size"], v["image_size"] // v["patch_size"]
    embeddings = d + 3 * v["patch_size"] ** 2 * d + d + (side**2 + 1) * d
    norm = 2 * d if v["norm_type"] == "layer_norm" else d
    layer = (3 * d * d + (3 * d if v["qkv_bias"] else 0)) + (d * d + d) + (2 * d if v["qk_normalization"] else 0)
    layer += (d * f + f) + (f * d + d) + 2 * norm + 2 * d
    return embeddings + v["num_hidden_layers"] * layer


def internlm2_params(t: dict) -> int:
    """Hand count of the chat code's InternLM2 (internlm2/modeling_internlm2.py) without its `output` head:
    tok_embeddings; per layer wqkv ((heads + 2 kv heads) x head_dim rows) and wo, with bias if `bias`, w1 / w3 / w2
    without bias, two RMSNorms; the final norm."""
    d, f, heads, kv = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    head = d // heads
    qkv, o = (heads + 2 * kv) * head, heads * head
    layer = d * qkv + o * d + (qkv + d if t["bias"] else 0) + 3 * d * f + 2 * d
    return t["vocab_size"] * d + t["num_hidden_layers"] * layer + d


def projector_params(vision_width: int, ratio: float, lm_width: int) -> int:
    """The chat code's mlp1: LayerNorm, Linear, GELU, Linear over width x (1 / ratio)^2 shuffled features."""
    d_in = vision_width * int(1 / ratio) ** 2
    return 2 * d_in + (d_in * lm_width + lm_width) + (lm_width * lm_width + lm_width)


def chat_lm_params(llm: dict) -> int:
    kind = llm["architectures"][0]
    if kind == "InternLM2ForCausalLM":
        return internlm2_params(llm)
    if kind == "Qwen3ForCausalLM":
        return qk_norm_lm_params(llm, 2)
    return qwen2_params(llm)


def chat_hand_count(raw: dict) -> int:
    vit, llm = raw["vision_config"], raw["llm_config"]
    head = 0 if llm.get("tie_word_embeddings") else llm["vocab_size"] * llm["hidden_size"]
    return (chat_internvit_params(vit) + projector_params(vit["hidden_size"], raw["downsample_ratio"],
                                                         llm["hidden_size"]) + chat_lm_params(llm) + head)


@pytest.mark.parametrize("folder,params", [("InternVL3-1B", 938_193_024), ("InternVL2-8B", 8_075_365_376)])
def test_a_published_internvl_chat_config_builds_the_hand_counted_native_model(spec, folder, params):
    raw = chat_config(folder)
    internvl = spec("hf", f"model.config={CHAT / folder}")
    model = internvl.build("meta", torch.bfloat16, init=False)
    assert type(model).__name__ == "InternVLForConditionalGeneration"
    assert count_params(model) == (params, params) and params == chat_hand_count(raw)
    assert count_params(model.model.vision_tower)[0] == chat_internvit_params(raw["vision_config"])
    assert count_params(model.model.language_model)[0] == chat_lm_params(raw["llm_config"])
    assert model.lm_head.weight is not model.model.language_model.embed_tokens.weight  # llm_config: untied
    # 448 px tiles of 14 px patches, 2 x 2 shuffled: 256 tokens; 1 to 12 tiles and a thumbnail
    assert (internvl.tile, internvl.image_seq_length, internvl.min_patches, internvl.max_patches) == (448, 256, 1, 12)


def test_internvl3_1b_has_the_module_shapes_its_published_module_tree_prints():
    # the `print(model)` of OpenGVLab/InternVL3-1B beside its config (see CHAT above), module by module
    from vlmprobe.models.internvl import InternVLSpec

    internvl = InternVLSpec.from_hf_config(chat_config("InternVL3-1B"), name="InternVL3-1B", attn_implementation="sdpa",
                                           preprocessor=None)
    model = internvl.build("meta", torch.bfloat16, init=False)
    tower, lm, projector = model.model.vision_tower, model.model.language_model, model.model.multi_modal_projector
    layer, block = tower.encoder.layer[0], lm.layers[0]
    attention = layer.attention
    assert len(tower.encoder.layer) == 24 and len(lm.layers) == 24
    assert tower.embeddings.patch_embeddings.projection.weight.shape == (1024, 3, 14, 14)
    assert sum(p.weight.shape[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj)) == 3072
    assert all(p.bias is not None for p in (attention.q_proj, attention.projection_layer))  # qkv / proj bias
    assert (layer.mlp.fc1.weight.shape, layer.mlp.fc2.weight.shape) == ((4096, 1024), (1024, 4096))
    assert type(layer.layernorm_before).__name__ == "LayerNorm" and isinstance(attention.q_norm, torch.nn.Identity)
    assert type(tower.layernorm).__name__ == "Identity"  # no norm after the encoder
    assert (block.self_attn.q_proj.weight.shape, block.self_attn.k_proj.weight.shape) == ((896, 896), (128, 896))
    assert block.self_attn.o_proj.bias is None and block.mlp.gate_proj.weight.shape == (4864, 896)
    assert lm.embed_tokens.weight.shape == (151674, 896) and model.lm_head.weight.shape == (151674, 896)
    assert (projector.layer_norm.weight.shape, projector.linear_1.weight.shape, projector.linear_2.weight.shape) == (
        (4096,), (896, 4096), (896, 896))


# variations of tests/data/hf/internvl_chat_tiny/config.json: a value per key path ("llm_config.bias": ...)
INTERNLM2_TINY = {"llm_config": {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
                                 "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "bias": False,
                                 "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1000000,
                                 "attn_implementation": "flash_attention_2"}}
QWEN3_TINY = {"llm_config": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
                             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 32,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}}


def tiny_chat(tmp_path, changes: dict | None = None, **top) -> str:
    """A folder holding the tiny internvl_chat config.json with `changes` ({section: {key: value}}: a whole
    llm_config where it names architectures; a None value drops the key) and top-level keys `top` (None drops the
    key); its model.config override."""
    raw = chat_config("internvl_chat_tiny")
    for section, values in (changes or {}).items():
        merged = values if section == "llm_config" and "architectures" in values else {**raw[section], **values}
        raw[section] = {k: v for k, v in merged.items() if v is not None}
    raw = {k: v for k, v in {**raw, **top}.items() if v is not None}
    folder = tmp_path / "chat"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return f"model.config={folder}"


@pytest.mark.parametrize("changes", [
    {},
    {"vision_config": {"qkv_bias": False, "qk_normalization": True, "norm_type": "rms_norm"}},
    {"vision_config": {"qkv_bias": None, "qk_normalization": None, "norm_type": None}},  # the chat classes' defaults
    INTERNLM2_TINY,
    {"llm_config": {**INTERNLM2_TINY["llm_config"], "bias": None}},  # InternLM2Config's default: bias true
    QWEN3_TINY,
], ids=["qwen2", "qk-norm-rms", "vit-defaults", "internlm2", "internlm2-bias", "qwen3-tied"])
def test_a_chat_config_of_each_kind_builds_its_hand_count(spec, tmp_path, changes):
    override = tiny_chat(tmp_path, changes)
    raw = json.loads((tmp_path / "chat" / "config.json").read_text())
    defaults = {"qkv_bias": False, "qk_normalization": True, "norm_type": "rms_norm"}  # InternVisionConfig's
    raw["vision_config"] = {**defaults, **raw["vision_config"]}
    raw["llm_config"] = {"bias": True, **raw["llm_config"]}
    model = spec("hf", override).build("meta", torch.float32, init=False)
    assert count_params(model)[0] == chat_hand_count(raw)
    tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert tied == bool(raw["llm_config"].get("tie_word_embeddings"))


def chat_rule_tiles(side: int, tile: int, lowest: int, highest: int, thumbnail: bool, dynamic: bool) -> int:
    """Tiles of a square image of `side` px as the InternVL repository's dynamic_preprocess makes them (written from
    its rule): every (columns, rows) grid of lowest to highest tiles in order of size; the one whose aspect ratio is
    closest to the image's, a later grid of the same closeness winning while the image's area is more than half
    the grid's; a thumbnail beside a grid of more than one tile if asked. Without dynamic_image_size: one tile."""
    if not dynamic:
        return 1
    grids = sorted({(c, r) for c in range(1, highest + 1) for r in range(1, highest + 1) if lowest <= c * r <= highest},
                   key=lambda grid: grid[0] * grid[1])
    best, closest = (1, 1), float("inf")
    for columns, rows in grids:
        distance = abs(1 - columns / rows)
        if distance < closest or (distance == closest and side * side > tile * tile * columns * rows / 2):
            best, closest = (columns, rows), min(distance, closest)
    count = best[0] * best[1]
    return count + 1 if thumbnail and count > 1 else count


@pytest.mark.parametrize("top", [
    {},
    {"use_thumbnail": False},
    {"dynamic_image_size": False},
    {"min_dynamic_patch": 2, "max_dynamic_patch": 6},
    {"max_dynamic_patch": 4, "use_thumbnail": None, "dynamic_image_size": None},  # the chat defaults: off
    {"force_image_size": 84},  # 84 px tiles, the tower's position table of 56 px interpolated
    {"downsample_ratio": 0.25},
    {"select_layer": -2},
], ids=["published-like", "no-thumbnail", "not-dynamic", "min-2-max-6", "defaults", "force-84", "ratio-0.25",
        "layer--2"])
def test_chat_tiles_and_image_tokens_follow_the_chat_rule_and_the_models_own_features(spec, tmp_path, top):
    settings = {"use_thumbnail": False, "dynamic_image_size": False, "min_dynamic_patch": 1, "max_dynamic_patch": 6,
                "force_image_size": 56, "downsample_ratio": 0.5}  # InternVLChatConfig's defaults (force: the tower's)
    given = {**chat_config("internvl_chat_tiny"), **top}
    settings.update({k: v for k, v in given.items() if k in settings and v is not None})
    tiny = spec("hf", tiny_chat(tmp_path, None, **top))
    tile, ratio = settings["force_image_size"], settings["downsample_ratio"]
    per_tile = int((tile // 14) ** 2 * ratio**2)
    for side in (tile, int(tile * 1.41), int(tile * 1.5), 2 * tile, 3 * tile):
        expected = chat_rule_tiles(side, tile, settings["min_dynamic_patch"], settings["max_dynamic_patch"],
                                   settings["use_thumbnail"], settings["dynamic_image_size"])
        data = DataShape(batch_size=1, lm_max_length=512, image_size=side)
        assert tiny.tiles(data) == expected and tiny.image_tokens(data) == expected * per_tile
    if top and not {"force_image_size", "downsample_ratio", "select_layer"} & top.keys():
        return  # the tile count alone changed: the features per tile are the published-like case's
    data = DataShape(batch_size=1, lm_max_length=512, image_size=2 * tile)
    model = tiny.build("cpu", torch.float32)
    with torch.no_grad():
        features = model.model.get_image_features(tiny.batch(data, CPU)["pixel_values"],
                                                  vision_feature_layer=tiny.vision_feature_layer,
                                                  vision_feature_select_strategy="default").pooler_output
    assert features.shape[0] * features.shape[1] == tiny.image_tokens(data)


def test_chat_image_tokens_equal_the_native_familys_for_the_same_settings(spec):
    chat, native = spec("hf", f"model.config={CHAT / 'internvl_chat_tiny'}"), spec("internvl_tiny")
    for side in (20, 56, 79, 80, 112, 118, 119, 168, 300):
        data = DataShape(batch_size=1, lm_max_length=512, image_size=side, images_per_sample=2)
        assert chat.image_tokens(data) == native.image_tokens(data) and chat.tiles(data) == native.tiles(data)
    assert chat.native_image_size == native.native_image_size == 56


@pytest.mark.parametrize("changes,top,message", [
    ({"llm_config": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}}, {},
     r"llm_config\.architectures\[0\]='Phi3ForCausalLM' in chat's internvl_chat config\.json is not allowed: vlmprobe "
     r"maps the chat format's Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM, InternLM2ForCausalLM language "
     r"models \(InternLM2 as LLaMA, transformers 5\.25 having no InternLM2\)"),
    ({"llm_config": {"architectures": None}}, {}, r"llm_config\.architectures\[0\]=None in chat's .* is not allowed"),
    ({}, {"use_llm_lora": 16}, r"use_llm_lora=16 in chat's internvl_chat config\.json is not allowed: LoRA baked into "
                               r"the model is not mapped; use 0 and vlmprobe's train\.lora_r / train\.lora_towers"),
    ({}, {"use_backbone_lora": 8}, r"use_backbone_lora=8 in chat's .* is not allowed: LoRA baked into the model"),
    ({"vision_config": {"use_moe": True}}, {},
     r"vision_config\.use_moe=True in chat's .* is not allowed: the published InternViT code has no mixture-of-experts "
     r"layers to map; use false"),
    ({"vision_config": {"norm_type": "batch_norm"}}, {},
     r"vision_config\.norm_type='batch_norm' in chat's .* is not allowed: use rms_norm or layer_norm"),
    ({}, {"force_image_size": 70}, r"downsample_ratio=0\.5 in chat's .* is not allowed with 70 px tiles of 14 px "
                                   r"patches: the pixel shuffle needs the tile's patch grid \(5\) to be a multiple of "
                                   r"1 / downsample_ratio"),
    ({}, {"downsample_ratio": 0.4}, r"downsample_ratio=0\.4 in chat's .* is not allowed with 56 px tiles of 14 px "
                                    r"patches: the pixel shuffle needs"),
], ids=["phi3", "no-architectures", "llm-lora", "backbone-lora", "vit-moe", "norm-type", "odd-grid", "ratio-0.4"])
def test_a_chat_config_that_cannot_map_is_refused_in_one_line(plan_points, tmp_path, changes, top, message):
    with pytest.raises(ConfigError, match=f"^{message}") as error:
        plan_points(["model=hf", tiny_chat(tmp_path, changes, **top)])
    assert "\n" not in str(error.value)


def test_the_cli_refuses_a_chat_config_that_cannot_map_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    from vlmprobe.cli import main

    monkeypatch.chdir(tmp_path)
    override = tiny_chat(tmp_path, {"llm_config": {"architectures": ["Phi3ForCausalLM"]}})
    code = main(["model=hf", override, f"results_dir={tmp_path / 'r'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "llm_config.architectures[0]='Phi3ForCausalLM'" in lines[0]
    assert not (tmp_path / "r").exists()


def test_an_internlm2_chat_point_estimate_equals_the_cpu_backend_to_the_byte(plan_points, tmp_path):
    # InternLM2 built as LLaMA runs a training step: the estimate on fake tensors and the real CPU run agree
    from vlmprobe.point.measure import measure

    data = ["data.batch_size=2", "data.lm_max_length=48", "data.image_size=112", "measure.steps=1"]
    rows = {}
    for backend in ("estimate", "cpu"):
        (point,) = plan_points(["model=hf", tiny_chat(tmp_path, INTERNLM2_TINY), *data, f"measure.backend={backend}"])
        rows[backend] = measure(point.config)
    assert point.inputs["image_tokens"] == 5 * 4  # 2 x 2 tiles and the thumbnail, 4 tokens each
    assert rows["cpu"]["status"] == rows["estimate"]["status"] == "ok"
    assert {k: v for k, v in rows["estimate"].items() if k.endswith("_bytes")} == {
        k: v for k, v in rows["cpu"].items() if k.endswith("_bytes")}
