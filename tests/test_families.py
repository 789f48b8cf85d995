"""What every model family must do, checked on the tiny variant of each family added after nanoVLM and
Qwen2-VL (those two have their own tests): the estimate equals the cpu backend to the byte, and the knobs
(freezing, checkpointing, LoRA) act on the towers the family names, with sizes counted independently from
the built model's own modules."""

import pytest
import torch
from hydra.utils import instantiate

from conftest import real_run_that_agrees
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape, count_params
from vlmprobe.point.measure import measure

FAMILIES = {  # tiny config -> data that fits it (the images take 16 tokens in each, 20 in
    # idefics3_tiny and internvl_tiny, one per image in mllama_tiny)
    "qwen2_5_vl_tiny": ["data.batch_size=2", "data.lm_max_length=64"],
    "qwen3_vl_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "qwen3_vl_moe_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "llava_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "llava_next_tiny": ["data.batch_size=2", "data.lm_max_length=48"],  # 36 image tokens: base tile + 2 tiles
    "idefics3_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "gemma3_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "mllama_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "internvl_tiny": ["data.batch_size=2", "data.lm_max_length=48", "data.image_size=112"],  # 2 x 2 tiles + thumbnail
    "paligemma_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "llava_onevision_tiny": ["data.batch_size=2", "data.lm_max_length=48"],  # 36 image tokens: base tile + 1 tile
    "mistral3_tiny": ["data.batch_size=2", "data.lm_max_length=48"],  # 6 image tokens: 2 rows of 2 and a break
    "glm4v_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "glm4v_moe_tiny": ["data.batch_size=2", "data.lm_max_length=48"],
    "llava_pixtral_tiny": ["data.batch_size=2", "data.lm_max_length=48"],  # 6 image tokens: 2 rows of 2 and a break
    "deepseek_vl2_toy": ["data.batch_size=2", "data.lm_max_length=48"],  # 13 image tokens: view, separator, tile
}
# the projector of each family where it is a module of its own (Qwen's merger, and Qwen3-VL's DeepStack
# projectors, live inside its vision tower, frozen with it)
PROJECTORS = {"qwen2_5_vl_tiny": set(), "qwen3_vl_tiny": set(), "qwen3_vl_moe_tiny": set(), "llava_tiny": {"multi_modal_projector"},
              "llava_next_tiny": {"multi_modal_projector", "image_newline"}, "idefics3_tiny": {"connector"},
              "gemma3_tiny": {"multi_modal_projector"}, "mllama_tiny": {"multi_modal_projector"},
              "internvl_tiny": {"multi_modal_projector"}, "paligemma_tiny": {"multi_modal_projector"},
              "llava_onevision_tiny": {"multi_modal_projector", "image_newline"},
              "mistral3_tiny": {"multi_modal_projector"}, "glm4v_tiny": set(), "glm4v_moe_tiny": set(),
              "llava_pixtral_tiny": {"multi_modal_projector"},
              "deepseek_vl2_toy": {"projector", "image_newline", "view_seperator"}}
BYTE_COLUMNS = ("peak_allocated_bytes", "last_step_peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes",
                "optimizer_peak_bytes", "after_load_bytes", "activations_bytes", "grads_bytes", "optimizer_state_bytes",
                "params_bytes")
TRAINING_STATE = ("params_bytes", "grads_bytes", "optimizer_state_bytes")
SETTINGS = {
    "fp32": ["train.autocast_dtype=null"],
    "fp32+bf16_autocast": ["train.autocast_dtype=bfloat16"],
    "bf16_weights_3_samples_2_images": ["train.param_dtype=bfloat16", "train.autocast_dtype=null", "data.batch_size=3",
                                        "data.images_per_sample=2", "data.lm_max_length=80"],
    "checkpointing_lora_frozen_vision": ["train.grad_ckpt.lm=true", "train.grad_ckpt.vision=true", "train.lora_r=4",
                                         "train.freeze_vision=true"],
}


# towers transformers does not checkpoint (no GradientCheckpointingLayer): checkpointing them is refused
NOT_CHECKPOINTED = {("mllama_tiny", "vision")}


def base(family, *extra):
    """A point's overrides; a checkpointing knob the family refuses is left out of a setting."""
    kept = [o for o in extra if not any(o == f"train.grad_ckpt.{t}=true" for f, t in NOT_CHECKPOINTED if f == family)]
    return [f"model={family}", *FAMILIES[family], "measure.backend=estimate", *kept]


@pytest.fixture
def run(plan_points):
    """run(overrides) -> (inputs, outputs) of one point."""

    def _run(overrides):
        (planned,) = plan_points(overrides)
        return planned.inputs, measure(planned.config)

    return _run


@pytest.fixture
def built(compose):
    """built(family) -> (spec, model on the meta device)."""

    def _built(family):
        spec = instantiate(compose([f"model={family}"]).model, _convert_="all")
        return spec, spec.build("meta", torch.float32, init=False)

    return _built


def tower_params(spec, model, tower) -> int:
    """Parameters of a tower, a weight shared by two of its modules (Gemma's tied head) counted once."""
    unique = {id(p): p for m in spec.towers(model)[tower] for p in m.parameters()}
    return sum(p.numel() for p in unique.values())


# The default training setting (bf16 autocast) with every knob, and bf16 weights with several images, cover
# each family's code paths; the fp32 settings run with the slow tests, keeping the suite's time as families grow
SLOW_SETTINGS = {"fp32", "fp32+bf16_autocast"}


# Every family keeps one setting (every knob at once) in the non-slow suite, within its time budget; the others run
# with the slow tests
FAST_SETTING = "checkpointing_lora_frozen_vision"


@pytest.mark.parametrize("family,setting", [
    pytest.param(f, s, marks=pytest.mark.slow)
    if s in SLOW_SETTINGS or s != FAST_SETTING else (f, s)
    for f in FAMILIES for s in SETTINGS])
def test_estimate_equals_the_cpu_backend_to_the_byte(run, family, setting):
    overrides = base(family, *SETTINGS[setting])
    _, estimate = run(overrides)
    _, cpu = run(overrides + ["measure.backend=cpu"])
    assert cpu["status"] == estimate["status"] == "ok", (cpu.get("error"), estimate.get("error"))
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


# parameters a real step leaves without a gradient: LLaVA's vision_feature_layer -2 leaves the last CLIP layer and
# post_layernorm running but feeding nothing (as in real LLaVA training)
UNUSED = {"llava_tiny": ("model.vision_tower.encoder.layers.1.", "model.vision_tower.post_layernorm.")}
UNUSED["llava_next_tiny"] = UNUSED["llava_tiny"]
# LLaVA-OneVision's vision_feature_layer -1 is the last layer's output before SigLIP's post_layernorm
UNUSED["llava_onevision_tiny"] = ("model.vision_tower.post_layernorm.",)
# DeepSeek-VL2's tower keeps the attention-pooling head timm's global_pool="map" builds, and never runs it
UNUSED["deepseek_vl2_toy"] = ("model.vision.head.",)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_real_step_trains_every_parameter_the_forward_uses(compose, family):
    from vlmprobe.models.base import DataShape

    spec = instantiate(compose([f"model={family}"]).model, _convert_="all")
    model = spec.build("cpu", torch.float32)
    loss, outputs = spec.loss(model, spec.batch(DataShape(batch_size=2, lm_max_length=48), torch.device("cpu")))
    loss.backward()
    assert torch.isfinite(loss) and outputs.logits.shape == (2, 48, spec.text["vocab_size"])
    no_grad = {name for name, p in model.named_parameters() if p.grad is None}
    assert no_grad == {n for n, _ in model.named_parameters() if n.startswith(UNUSED.get(family, ("-",)))}


# families whose get_image_features takes the pixels alone: tiny side px -> one feature row per image token
@pytest.mark.parametrize("family,side,tokens", [("gemma3_tiny", 64, 16), ("paligemma_tiny", 32, 16)])
def test_image_tokens_are_what_the_models_image_features_have(compose, family, side, tokens):
    spec = instantiate(compose([f"model={family}"]).model, _convert_="all")
    model = spec.build("cpu", torch.float32)
    with torch.no_grad():
        features = model.model.get_image_features(torch.randn(2, 3, side, side)).pooler_output
    assert features.shape[:2] == (2, spec.image_tokens(DataShape(1, 64))) == (2, tokens)
    assert spec.image_tokens(DataShape(1, 64, images_per_sample=2)) == 2 * tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_the_towers_cover_every_parameter_but_the_projector(built, family):
    spec, model = built(family)
    towers = spec.towers(model)
    in_towers = {id(p) for modules in towers.values() for m in modules for p in m.parameters()}
    outside = {name.split(".")[1] for name, p in model.named_parameters() if id(p) not in in_towers}
    assert outside == PROJECTORS[family]


@pytest.mark.parametrize("tower", ["vision", "lm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_freezing_a_tower_leaves_the_rest_trainable(plan_points, built, family, tower):
    spec, model = built(family)
    (planned,) = plan_points(base(family, f"train.freeze_{tower}=true"))
    assert planned.inputs["params"] == count_params(model)[0]
    assert planned.inputs["trainable_params"] == count_params(model)[0] - tower_params(spec, model, tower)


# Checkpointing goes through transformers' gradient_checkpointing_enable in every transformers family: the non-slow
# suite checks that activations drop on the first two, the slow tests on every family (the estimate == cpu setting
# with checkpointing runs for every family in both)
CHECKPOINTING_FAST = {"qwen2_5_vl_tiny", "llava_tiny"}


@pytest.mark.parametrize("family,tower", [
    (f, t) if f in CHECKPOINTING_FAST else pytest.param(f, t, marks=pytest.mark.slow)
    for f in FAMILIES for t in ("vision", "lm") if (f, t) not in NOT_CHECKPOINTED])
def test_checkpointing_a_tower_saves_activations_and_changes_no_training_state(run, family, tower):
    _, plain = run(base(family))
    inputs, ckpt = run(base(family, f"train.grad_ckpt.{tower}=true"))
    assert ckpt["activations_bytes"] < plain["activations_bytes"]
    assert {k: ckpt[k] for k in TRAINING_STATE} == {k: plain[k] for k in TRAINING_STATE}
    assert inputs[f"grad_ckpt_{tower}"] is True


@pytest.mark.parametrize("family,tower", sorted(NOT_CHECKPOINTED))
def test_a_tower_transformers_does_not_checkpoint_is_refused(plan_points, family, tower):
    with pytest.raises(ConfigError, match=rf"train.grad_ckpt.{tower}=true is not allowed for {family}: its {tower} "
                                          rf"tower has no layers that transformers checkpoints"):
        plan_points([f"model={family}", *FAMILIES[family], f"train.grad_ckpt.{tower}=true"])


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapts_the_lms_attention_and_freezes_only_the_base_lm(plan_points, built, family):
    spec, model = built(family)
    (planned,) = plan_points(base(family, "train.lora_r=4"))
    text = spec.text
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    d, q, kv = text["hidden_size"], text["num_attention_heads"] * head_dim, text["num_key_value_heads"] * head_dim
    adapters = text["num_hidden_layers"] * 4 * ((d + q) + 2 * (d + kv) + (q + d))  # r (in + out): q, k, v, o
    assert planned.inputs["trainable_params"] == count_params(model)[0] - tower_params(spec, model, "lm") + adapters


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_wraps_every_block_of_both_towers(built, family):
    from vlmprobe.distributed.torch_engines import tower_blocks

    spec, model = built(family)
    blocks = tower_blocks(spec, model)
    text, vision = spec.text["num_hidden_layers"], spec.vision.get("depth") or spec.vision["num_hidden_layers"]
    assert len(blocks) == vision + text and len({id(b) for b in blocks}) == len(blocks)


@pytest.mark.slow  # two torchrun jobs of 2 gloo ranks: about 30 s
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_estimate_equals_real_gloo_ranks_to_the_byte(point, family):
    import os

    from vlmprobe.run.ranks import run_ranks

    def ranks(backend):
        cfg = point([f"model={family}", *FAMILIES[family], "dist=fsdp2", "dist.world_size=2", f"measure.backend={backend}"])
        outputs = run_ranks(cfg, dict(os.environ))
        assert outputs["status"] == "ok", outputs.get("error")
        return {r["rank"]: {k: r.get(k) for k in BYTE_COLUMNS} for r in outputs["ranks"]}

    estimate = ranks("estimate")

    def apart(real):
        return {(rank, k): (estimate[rank][k], v) for rank, row in real.items() for k, v in row.items()
                if estimate[rank][k] != v}

    # real gloo ranks may still hold a finished collective's buffer (conftest.real_run_that_agrees): one of a few
    # real runs must agree to the byte, any other be above the estimate
    assert len(real_run_that_agrees(lambda: ranks("cpu"), apart)) == 2


def test_every_transformers_family_imports_the_modules_the_estimate_answers_in_with_its_own():
    # the estimate's answers to transformers' data reads (masks, flash attention) are installed where those
    # modules are imported; a family's module must bring them before any of its models is built
    import subprocess
    import sys

    from vlmprobe.models.hf import FAMILIES

    modules = sorted({f"vlmprobe.models.{path.rpartition('.')[0]}" for path in FAMILIES.values()})
    code = ("import importlib, sys\n"
            "from vlmprobe.models.base import TRANSFORMERS_MODULES\n"
            "for family in sys.argv[1:]:\n"
            "    before = [m for m in TRANSFORMERS_MODULES if m in sys.modules]\n"
            "    importlib.import_module(family)\n"
            "    print(family, before, all(m in sys.modules for m in TRANSFORMERS_MODULES))\n")
    proc = subprocess.run([sys.executable, "-c", code, "vlmprobe.models.nanovlm", *modules], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == len(modules) + 1, proc.stderr
    assert lines[0] == "vlmprobe.models.nanovlm [] False"  # our own modules bring none
    assert all(line.endswith(" True") for line in lines[1:]), lines
