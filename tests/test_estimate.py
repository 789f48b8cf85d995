"""The estimate backend runs the same program as the cpu backend on fake tensors: the byte counts must be
identical, which proves the fake bookkeeping (the accuracy against CUDA is scripts/check_estimate.py's)."""

import pytest

from vlmprobe.point.measure import measure

BYTE_COLUMNS = ("peak_allocated_bytes", "last_step_peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes",
                "optimizer_peak_bytes", "after_load_bytes", "after_step_bytes", "activations_bytes", "grads_bytes", "optimizer_state_bytes",
                "params_bytes", "peak_reserved_bytes", "last_step_peak_reserved_bytes", "peak_active_bytes")
SETTINGS = {
    "fp32": ["train.autocast_dtype=null"],
    "fp32+bf16_autocast": ["train.autocast_dtype=bfloat16"],
    "fp32+fp16_autocast": ["train.autocast_dtype=float16"],
    "bf16_weights": ["train.param_dtype=bfloat16", "train.autocast_dtype=null"],
    "3_steps_2_images": ["measure.steps=3", "data.images_per_sample=2"],
    "expandable_segments": ["measure.alloc_conf=expandable_segments:True"],
    "a_card_with_cublas_workspaces": ["device=rtx3090"],  # 8.1 MiB each, in segments other blocks share
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_estimate_equals_the_cpu_backend_to_the_byte(point, setting):
    base = ["model=nanovlm_tiny", "data.batch_size=2", "data.lm_max_length=48", *SETTINGS[setting]]
    cpu = measure(point(base + ["measure.backend=cpu"]))
    estimate = measure(point(base + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok"
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}
    assert estimate["backend"] == "estimate" and cpu["backend"] == "cpu"


@pytest.mark.parametrize("reentrant", ["false", "true"])
def test_lora_on_both_towers_under_checkpointing_estimates_the_cpu_backend_to_the_byte(point, reentrant):
    # reentrant checkpointing runs a second backward inside each checkpointed layer's backward, and LoRA on the
    # vision tower sends gradients back through it: the fake bookkeeping must follow both as real tensors do
    base = ["model=idefics3_tiny", "data.batch_size=2", "data.lm_max_length=64", "train.lora_r=4",
            "train.lora_towers=[lm,vision]", "train.lora_target_modules=[q_proj,v_proj]", "train.grad_ckpt.lm=true",
            "train.grad_ckpt.vision=true", f"train.grad_ckpt_reentrant={reentrant}"]
    cpu = measure(point(base + ["measure.backend=cpu"]))
    estimate = measure(point(base + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok"
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


def test_estimate_leaves_what_it_cannot_know_empty_not_zero(point):
    row = measure(point(["model=nanovlm_tiny", "data.lm_max_length=32", "measure.backend=estimate"]))
    for column in ("nvml_used_bytes", "nvml_process_bytes"):
        assert row.get(column) is None, column
    # the allocator model's figures: reserved holds every block; one stream, so active is allocated
    assert row["peak_reserved_bytes"] >= row["peak_allocated_bytes"] > 0
    assert row["peak_active_bytes"] == row["peak_allocated_bytes"]
    assert (row["num_alloc_retries"], row["num_ooms"]) == (0, 0)


def test_a_longer_sequence_costs_more_activation_memory_and_the_same_weights(point):
    short, long = (measure(point(["model=nanovlm_tiny", f"data.lm_max_length={n}", "measure.backend=estimate"]))
                   for n in (32, 128))
    assert long["activations_bytes"] > short["activations_bytes"]
    assert long["params_bytes"] == short["params_bytes"] and long["optimizer_state_bytes"] == short["optimizer_state_bytes"]


def test_breakdown_matches_a_hand_computation_for_adamw(point, compose):
    from hydra.utils import instantiate

    from vlmprobe.models.base import count_params

    row = measure(point(["model=nanovlm_tiny", "data.lm_max_length=32", "measure.backend=estimate"]))
    spec = instantiate(compose(["model=nanovlm_tiny"]).model, _convert_="all")
    params, _ = count_params(spec.build("meta", __import__("torch").float32, init=False))
    assert row["params_bytes"] == 4 * params  # fp32 weights
    assert row["grads_bytes"] == 4 * params  # one fp32 grad per weight
    assert row["optimizer_state_bytes"] == 2 * 4 * params  # AdamW: exp_avg + exp_avg_sq


def test_a_qwen2_vl_7b_estimate_runs_and_reports_the_published_parameter_count(plan_points):
    # FACTS.md section 4: 8,291,375,616 parameters; bf16 weights, batch 1, 448 px (256 image tokens)
    (planned,) = plan_points(["model=qwen2_vl_7b", "train.param_dtype=bfloat16", "train.autocast_dtype=null",
                              "data.lm_max_length=512", "measure.backend=estimate"])
    row = measure(planned.config)
    assert planned.inputs["params"] == 8_291_375_616 and planned.inputs["image_tokens"] == 256
    assert row["status"] == "ok" and row["params_bytes"] == 2 * 8_291_375_616
    # AdamW keeps two moments in the weights' dtype: the step's peak holds weights, grads and both moments
    assert row["peak_allocated_bytes"] > 4 * 2 * 8_291_375_616


def test_pure_bf16_nanovlm_runs_with_a_mask_cuda_accepts(point):
    # nanoVLM's additive mask used to be fp32 beside bf16 queries: CUDA's memory-efficient kernel refuses it
    row = measure(point(["model=nanovlm_tiny", "data.lm_max_length=32", "measure.backend=estimate",
                         "train.param_dtype=bfloat16", "train.autocast_dtype=null"]))
    assert row["status"] == "ok"


def test_held_outputs_count_in_the_activations_of_every_step(point):
    # the logits a loop keeps in `_` are live from the forward on: bf16 (autocast) B x L x vocab, 512 B blocks
    base = ["model=nanovlm_tiny", "data.batch_size=2", "data.lm_max_length=64", "measure.backend=estimate"]
    rows = {(steps, hold): measure(point(base + [f"measure.steps={steps}", f"measure.hold_outputs={hold}"]))
            for steps in (1, 3) for hold in ("true", "false")}
    logits = 2 * 64 * 512 * 2
    for steps in (1, 3):  # activations_bytes is the last step's: after the first, the held outputs are replaced
        assert rows[steps, "true"]["activations_bytes"] - rows[steps, "false"]["activations_bytes"] == logits
