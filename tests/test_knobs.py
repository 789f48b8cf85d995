"""Each training knob changes what it should and nothing else, on the tiny nanoVLM with the estimate
backend; expected sizes are hand computations from the parameter counts."""

import pytest
import torch
from hydra.utils import instantiate

from vlmprobe.models.base import count_params
from vlmprobe.point.measure import measure

BASE = ["model=nanovlm_tiny", "data.batch_size=2", "data.lm_max_length=64", "measure.backend=estimate"]
MODEL = ("params_bytes",)
TRAINING_STATE = ("params_bytes", "grads_bytes", "optimizer_state_bytes")


@pytest.fixture
def run(plan_points):
    """run(*overrides) -> (inputs, outputs) of one point."""

    def _run(*extra):
        (planned,) = plan_points(BASE + list(extra))
        return planned.inputs, measure(planned.config)

    return _run


def parameter_counts(compose, model_name: str) -> dict[str, int]:
    """Parameters of the model (all), of each of its towers (as the knobs see them: spec.towers) and its tensors."""
    spec = instantiate(compose([f"model={model_name}"]).model, _convert_="all")
    model = spec.build("meta", torch.float32, init=False)
    towers = {tower: sum(count_params(m)[0] for m in modules) for tower, modules in spec.towers(model).items()}
    return {"all": count_params(model)[0], **towers, "tensors": len(list(model.parameters()))}


@pytest.fixture
def tower_params(compose):
    return parameter_counts(compose, "nanovlm_tiny")


def same(a, b, keys):
    return {k: a[k] for k in keys} == {k: b[k] for k in keys}


@pytest.mark.parametrize("tower", ["lm", "vision"])
def test_checkpointing_a_tower_saves_activations_and_changes_no_training_state(run, tower):
    _, base = run()
    inputs, ckpt = run(f"train.grad_ckpt.{tower}=true")
    assert ckpt["activations_bytes"] < base["activations_bytes"]
    assert same(ckpt, base, TRAINING_STATE) and inputs[f"grad_ckpt_{tower}"] is True


@pytest.mark.parametrize("tower", ["lm", "vision"])
def test_freezing_a_tower_drops_its_grads_and_optimizer_state(run, tower_params, tower):
    inputs, frozen = run(f"train.freeze_{tower}=true")
    trainable = tower_params["all"] - tower_params[tower]
    assert inputs["trainable_params"] == trainable
    assert frozen["grads_bytes"] == 4 * trainable  # fp32 grads
    assert frozen["optimizer_state_bytes"] == 2 * 4 * trainable  # AdamW: two fp32 moments
    assert frozen["params_bytes"] == 4 * tower_params["all"]  # the frozen weights are still there


def test_lora_trains_adapters_on_the_lm_and_leaves_the_vision_tower_trainable(run, tower_params):
    inputs, lora = run("train.lora_r=4", "train.lora_target_modules=[q_proj,v_proj]")
    # tiny LM: 2 layers, hidden 32, 4 heads x 8 = q out 32, 2 kv heads x 8 = v out 16
    # adapters per layer: q: 4 x (32 + 32), v: 4 x (32 + 16)
    adapters = 2 * (4 * (32 + 32) + 4 * (32 + 16))
    projector = tower_params["all"] - tower_params["vision"] - tower_params["lm"]
    assert inputs["trainable_params"] == tower_params["vision"] + projector + adapters
    assert inputs["params"] == tower_params["all"] + adapters
    assert lora["grads_bytes"] == 4 * inputs["trainable_params"]


def test_default_lora_targets_adapt_all_four_attention_projections_of_nanovlms_lm(run, tower_params):
    # nanoVLM names the output projection out_proj, transformers' LMs o_proj: the default names both
    inputs, _ = run("train.lora_r=4")
    # tiny LM: 2 layers, hidden 32; q and out_proj 32 -> 32, k and v 32 -> 16 (2 kv heads x 8); r (in + out) each
    adapters = 2 * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32))
    projector = tower_params["all"] - tower_params["vision"] - tower_params["lm"]
    assert inputs["trainable_params"] == tower_params["vision"] + projector + adapters


@pytest.mark.parametrize("target", ["blocks.1.q_proj", "1.q_proj"])
def test_lora_on_a_module_path_adapts_that_one_module(run, tower_params, target):
    # as peft matches a name (the module's path in the LM, or its end after a dot): tiny LM layer 1's q, 32 -> 32
    inputs, _ = run("train.lora_r=4", f"train.lora_target_modules=[{target}]")
    assert inputs["params"] == tower_params["all"] + 4 * (32 + 32)


def test_lora_on_the_vision_tower_too_freezes_its_base_and_trains_adapters_on_both_towers(plan_points, compose):
    # peft's target_modules match names anywhere in a model: SmolVLM's fine-tuning notebook names q_proj and v_proj,
    # which its SigLIP tower has too. idefics3_tiny: LM 2 layers, hidden 64, q 64 -> 64 (4 heads x 16), v 64 -> 32
    # (2 kv heads x 16); tower 2 layers, hidden 32, q and v 32 -> 32; r (in + out) each
    lm_adapters = 2 * (4 * (64 + 64) + 4 * (64 + 32))
    vision_adapters = 2 * (4 * (32 + 32) + 4 * (32 + 32))
    towers = parameter_counts(compose, "idefics3_tiny")
    connector = towers["all"] - towers["vision"] - towers["lm"]
    lora = ["model=idefics3_tiny", "measure.backend=estimate", "train.lora_r=4",
            "train.lora_target_modules=[q_proj,v_proj]"]
    (lm_only,) = plan_points(lora)
    (both,) = plan_points(lora + ["train.lora_towers=[lm,vision]"])
    assert lm_only.inputs["trainable_params"] == towers["vision"] + connector + lm_adapters
    assert both.inputs["trainable_params"] == connector + lm_adapters + vision_adapters
    assert both.inputs["params"] == towers["all"] + lm_adapters + vision_adapters


def test_lora_on_a_tower_without_a_layer_so_named_is_one_line(plan_points):
    from vlmprobe.errors import ConfigError

    # SigLIP's MLP is fc1 / fc2: an LM-only name adapts nothing in the tower
    with pytest.raises(ConfigError, match=r"^train\.lora_target_modules=\['gate_proj'\] is not allowed: no linear "
                                          r"layer of the vision tower is named so"):
        plan_points(["model=idefics3_tiny", "measure.backend=estimate", "train.lora_r=4",
                     "train.lora_target_modules=[gate_proj]", "train.lora_towers=[lm,vision]"])


def test_lora_on_a_module_path_the_lm_does_not_have_is_one_line(plan_points):
    from vlmprobe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.lora_target_modules=\['blocks\.2\.q_proj'\] is not allowed: no "
                                          r"linear layer of the language model is named so"):
        plan_points(BASE + ["train.lora_r=4", "train.lora_target_modules=[blocks.2.q_proj]"])


def test_reentrant_checkpointing_drops_what_int8_matmuls_keep_outside_save_for_backward(plan_points):
    # bitsandbytes' MatMul8bitLt keeps its input on ctx (ctx.tensors), which non-reentrant checkpointing's saved-
    # tensor hooks never see: every int8 layer inside a checkpointed layer keeps its input until backward. The
    # reentrant variant runs those layers under no_grad in forward, so they keep nothing. idefics3_tiny, int8
    # everywhere but lm_head, both towers checkpointed, inputs 2 x 64 LM tokens and 2 x 5 tiles x 16 patches:
    # per LM layer q/k/v's input (the norm's fp32 output, shared), o_proj's (bf16 attention output), gate/up's
    # (fp32, shared), down_proj's (fp32, 128 wide); per vision layer the same four with fc1 / fc2 (fp32, 64 wide)
    lm = 2 * 64 * (64 * 4 + 64 * 2 + 64 * 4 + 128 * 4)
    vision = 2 * 5 * 16 * (32 * 4 + 32 * 2 + 32 * 4 + 64 * 4)
    base = ["model=idefics3_tiny", "measure.backend=estimate", "data.batch_size=2", "data.lm_max_length=64",
            "train.lora_r=4", "train.quantization=int8", "train.grad_ckpt.lm=true", "train.grad_ckpt.vision=true",
            "measure.steps=1"]  # one step: a plain loop keeps the last step's graph (and so ctx) into the next forward
    kept = {}
    for reentrant in (False, True):
        (planned,) = plan_points(base + [f"train.grad_ckpt_reentrant={str(reentrant).lower()}"])
        kept[reentrant] = measure(planned.config)["activations_bytes"]
    assert kept[False] - kept[True] == 2 * lm + 2 * vision  # two layers a tower


def test_reentrant_checkpointing_is_refused_where_transformers_does_not_checkpoint(plan_points):
    from vlmprobe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.grad_ckpt_reentrant=true is not allowed for nanovlm_tiny"):
        plan_points(BASE + ["train.grad_ckpt.lm=true", "train.grad_ckpt_reentrant=true"])


@pytest.mark.parametrize("option,label,moments", [
    ("adamw", "AdamW(foreach)", 2), ("adamw_fused", "AdamW(fused)", 2),
    ("adamw_single_tensor", "AdamW(single_tensor)", 2), ("sgd_momentum", "SGD(foreach)", 1),
])
def test_optimizer_state_is_its_number_of_moments_times_the_weights(run, tower_params, option, label, moments):
    inputs, row = run(f"optimizer={option}")
    assert inputs["optimizer"] == label
    assert row["optimizer_state_bytes"] == moments * 4 * tower_params["all"]
    assert row["optimizer_state_dtype"] == "float32"


def test_between_steps_the_loop_carries_the_weights_grads_and_optimizer_state_it_loaded_plus_nothing_else(run, tower_params):
    """after_step - after_load = the grads (not zeroed until the next step) and AdamW's two moments, each a
    hand count of the fp32 weights: 4 B x (1 + 2) per trainable parameter; the batch and weights were there at
    load. The allocator rounds each tensor up to 512 B, at most 511 B per tensor over the hand count."""
    _, row = run("optimizer=adamw_fused", "measure.steps=2")
    carried = row["after_step_bytes"] - row["after_load_bytes"]
    assert 0 <= carried - 4 * 3 * tower_params["all"] < 511 * 3 * tower_params["tensors"]


def test_foreach_adamw_needs_a_params_sized_temporary_that_fused_and_single_tensor_do_not(run, tower_params):
    peaks = {o: run(f"optimizer={o}")[1]["optimizer_peak_bytes"] for o in ("adamw", "adamw_fused", "adamw_single_tensor")}
    assert peaks["adamw"] - peaks["adamw_fused"] >= 4 * tower_params["all"] * 0.9  # the sqrt(v) list
    assert peaks["adamw_single_tensor"] < peaks["adamw"]


def test_adafactor_keeps_factored_state_far_smaller_than_adamw(run, tower_params):
    _, row = run("optimizer=adafactor")
    assert row["status"] == "ok" and row["optimizer_state_bytes"] < 4 * tower_params["all"] / 2


def test_an_optimizer_whose_package_is_missing_is_skipped_with_the_reason(plan_points):
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed")
    (planned,) = plan_points([*BASE[:-1], "measure.backend=cpu", "optimizer=adamw_8bit"])  # the cpu backend runs it
    assert planned.skip.startswith("bitsandbytes.optim.AdamW8bit cannot be imported here (No module named 'bitsandbytes')")


def test_8bit_adamw_on_the_estimate_keeps_uint8_moments_and_a_float32_maximum_per_256_elements(run, compose):
    # by hand, from the trainable tensors' sizes and bitsandbytes 0.50's rule: under 4096 elements two float32
    # moments; else two uint8 moments, a float32 maximum per block of 256 for each, and the two 256-entry float32
    # quantization maps, which every such tensor's state holds (and the row counts where held, as CUDA's would)
    spec = instantiate(compose(["model=nanovlm_tiny"]).model, _convert_="all")
    sizes = [p.numel() for p in spec.build("meta", torch.float32, init=False).parameters()]
    hand = sum(8 * n if n < 4096 else 2 * n + 2 * 4 * -(-n // 256) + 2 * 4 * 256 for n in sizes)
    inputs, row = run("optimizer=adamw_8bit")
    assert row["status"] == "ok" and inputs["optimizer"] == "AdamW8bit"
    assert row["optimizer_state_bytes"] == hand and row["optimizer_state_dtype"] == "float32,uint8"
    assert any(n >= 4096 for n in sizes) and any(n < 4096 for n in sizes)  # both rules are met
    assert "AdamW8bit modelled by a stand-in" in row["notes"]
    _, adamw = run()
    assert row["optimizer_state_bytes"] < adamw["optimizer_state_bytes"]
    assert row["peak_allocated_bytes"] < adamw["peak_allocated_bytes"]


def test_grad_accumulation_keeps_the_micro_batch_activations_and_records_the_effective_batch(run):
    _, once = run()
    inputs, twice = run("train.grad_accum_steps=2")
    assert inputs["effective_batch_size"] == 4 and inputs["batch_size"] == 2
    assert twice["activations_bytes"] == once["activations_bytes"]  # per micro batch
    assert same(twice, once, TRAINING_STATE)
    # the second micro step runs its forward with the first one's grads alive
    assert twice["forward_peak_bytes"] >= once["forward_peak_bytes"] + once["grads_bytes"] * 0.9


def test_bf16_weights_halve_the_training_state(run, tower_params):
    inputs, row = run("train.param_dtype=bfloat16", "train.autocast_dtype=null")
    assert row["params_bytes"] == 2 * tower_params["all"] and row["grads_bytes"] == 2 * tower_params["all"]
    assert row["optimizer_state_dtype"] == "bfloat16" and inputs["dtype"] == "bfloat16"


def test_fp16_autocast_runs_and_keeps_fp32_training_state(run, tower_params):
    _, row = run("train.autocast_dtype=float16")
    assert row["status"] == "ok" and row["params_bytes"] == 4 * tower_params["all"]


def test_eager_attention_keeps_the_attention_weights_that_sdpa_does_not(run):
    _, sdpa = run()
    inputs, eager = run("model.attn_implementation=eager")
    # at least the LM's softmax output, 2 layers x B 2 x 4 heads x 64 x 64, in bf16 or wider
    assert eager["activations_bytes"] - sdpa["activations_bytes"] >= 2 * 2 * 4 * 64 * 64 * 2
    assert same(eager, sdpa, TRAINING_STATE) and inputs["attn_implementation"] == "eager"


def test_more_images_per_sample_take_more_tokens_and_activations(run):
    one_inputs, one = run()
    two_inputs, two = run("data.images_per_sample=2")
    assert two_inputs["image_tokens"] == 2 * one_inputs["image_tokens"]
    assert two["activations_bytes"] > one["activations_bytes"] and same(one, two, TRAINING_STATE)


def test_allocator_conf_is_recorded_in_the_row(plan_points):
    (planned,) = plan_points(BASE + ["measure.alloc_conf=expandable_segments:True"])
    assert planned.inputs["alloc_conf"] == "expandable_segments:True"


def test_flash_attention_2_is_skipped_with_the_reason_on_the_cpu_backend_and_estimated(plan_points):
    (planned,) = plan_points(["model=qwen2_vl_tiny", "data.lm_max_length=64", "measure.backend=cpu",
                              "model.attn_implementation=flash_attention_2"])
    assert planned.skip == "flash_attention_2 has no CPU kernel to run on backend cpu; use sdpa or a GPU"
    (estimated,) = plan_points(["model=qwen2_vl_tiny", "data.lm_max_length=64", "measure.backend=estimate",
                                "model.attn_implementation=flash_attention_2"])
    assert estimated.skip is None
    assert planned.inputs["attn_implementation"] == "flash_attention_2"
