"""step=grpo on the tiny Qwen2.5-VL, in-process: the estimate against a real run of the same program on the
cpu backend, the fast rollout against the token-by-token one, each knob's effect on the phases, the KV cache
against its hand-computed size. scripts/check_trl.py checks the step against TRL's own GRPOTrainer."""

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF, ZERO3_SMALL_BUCKETS, ranks_of, real_run_that_agrees, tiny_qwen_rows
from vlmprobe.config.plan import plan_overrides
from vlmprobe.point.measure import measure

TINY = ["model=qwen2_5_vl_tiny", "step=grpo", "data.lm_max_length=40", "data.batch_size=4",
        "step.max_completion_length=16", "measure.steps=1"]
PHASES = ("generate", "reference", "forward", "backward", "optimizer")


def phases(row):
    return {p: row[f"{p}_peak_bytes"] for p in PHASES}


def config_of(overrides):
    """The validated config of a single-point command line."""
    (planned,) = plan_overrides(overrides)
    return planned.config


@pytest.fixture(scope="module")
def cpu_row():
    return measure(config_of(TINY + ["measure.backend=cpu", "measure.steps=2"]))


@pytest.mark.slow
def test_estimate_matches_a_real_run_of_the_same_program(cpu_row):
    fake = measure(config_of(TINY + ["measure.backend=estimate", "measure.steps=2"]))
    assert cpu_row["status"] == fake["status"] == "ok"
    real, estimated = phases(cpu_row), phases(fake)
    # every phase to the byte but generation: transformers' generate reads a few flags from data (is the
    # prompt padded, ...) and computes what it reads; fake tensors take a few scalar-sized other paths there
    # (1,536 B of 2.8 MB measured; vlmprobe/estimate/fake_patches.py answers the mask decision that mattered)
    assert {p: estimated[p] for p in PHASES[1:]} == {p: real[p] for p in PHASES[1:]}
    assert abs(estimated["generate"] - real["generate"]) <= 2048
    assert fake["peak_phase"] == cpu_row["peak_phase"]


@pytest.mark.slow
def test_fast_rollout_has_the_token_by_token_peak(cpu_row):
    full = measure(config_of(TINY + ["measure.backend=cpu", "measure.steps=2", "step.rollout=full"]))
    assert phases(full) == phases(cpu_row)


@pytest.mark.slow
def test_the_kv_cache_grows_the_generation_peak_as_computed_by_hand():
    def generate_peak(completion):
        return measure(config_of(TINY + ["measure.backend=estimate", f"step.max_completion_length={completion}",
                                         "step.beta=0"]))["generate_peak_bytes"]

    # long enough for the last decode step to hold the phase's peak (the prefill's vision tower holds it below)
    grown = generate_peak(4000) - generate_peak(3000)
    # K and V of 2 layers x 4 rows x 2 KV heads x head_dim 16 in bf16 (CUDA autocast: the projections are
    # bf16) per token, 1,000 tokens more. generate's own per-token int64 bookkeeping grows too (ids, its
    # attention mask, the 4-row M-RoPE positions, token types: 56 B per row and token, some with a copy
    # during their cat) and the cat of one layer's K / V: at this toy size (2 layers) it is of the KV cache's
    # order (measured 2,689 B per token against the cache's 1,024); at 28 layers the cache dominates
    kv = 2 * 2 * 4 * 2 * 16 * 2 * 1000
    assert kv <= grown <= 3 * kv


@pytest.mark.slow
def test_beta_zero_has_no_reference_model_and_no_reference_phase(cpu_row):
    row = measure(config_of(TINY + ["measure.backend=cpu", "measure.steps=2", "step.beta=0"]))
    assert row["reference_peak_bytes"] is None and cpu_row["reference_peak_bytes"] > 0
    # the reference copy: float32 weights of the 220,320 parameters and the rotary buffers, each tensor
    # rounded up to 512 B
    spec = instantiate(OmegaConf.load(CONF / "model" / "qwen2_5_vl_tiny.yaml"), _convert_="all")
    model = spec.build(torch.device("meta"), torch.float32, init=False)
    assert cpu_row["after_load_bytes"] - row["after_load_bytes"] == sum(
        -(-t.numel() * 4 // 512) * 512 for t in [*model.parameters(), *model.buffers()])  # + rotary inv_freq


def test_vllm_moves_generation_off_this_gpu():
    row = measure(config_of(TINY + ["measure.backend=estimate", "step.use_vllm=true"]))
    assert row["status"] == "ok" and row["generate_peak_bytes"] is None
    assert "vLLM" in row["notes"]


@pytest.mark.slow
def test_lora_policy_is_its_own_reference():
    lora = measure(config_of(TINY + ["measure.backend=estimate", "train.lora_r=4"]))
    frozen_copy = measure(config_of(TINY + ["measure.backend=estimate", "train.lora_r=4", "step.beta=0"]))
    assert lora["reference_peak_bytes"] > 0
    assert lora["after_load_bytes"] == frozen_copy["after_load_bytes"]  # no second model was loaded


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["step.logits=logits_to_keep"], ["step.logits=full_sequence"], ["train.grad_accum_steps=2"],
                                   ["train.grad_ckpt.lm=true", "train.grad_ckpt.vision=true"],
                                   ["step.compact=false"]])
def test_every_knob_runs(extra):
    row = measure(config_of(TINY + ["measure.backend=estimate"] + extra))
    assert row["status"] == "ok" and row["peak_phase"] in PHASES


# --- the GRPO step beside a sharded engine (dist=), as TRL runs it there: each rank generates with the
# engine's parameters as unwrap_model_for_generation leaves them, the reference is prepared as
# GRPOTrainer.__init__ prepares it (prepare_fsdp, prepare_deepspeed), the policy runs through the engine ---

SHARDED = TINY + ["measure.steps=2", "dist.world_size=2"]
ZERO3 = ZERO3_SMALL_BUCKETS + ["step.logits=logits_to_keep"]


def sharded_ranks(overrides):
    return ranks_of(config_of(SHARDED + overrides))


@pytest.mark.slow
@pytest.mark.parametrize("dist", [["dist=fsdp2"], ZERO3, ZERO3_SMALL_BUCKETS, ["dist=ddp", "dist.bucket_cap_mb=0.25"]],
                         ids=["fsdp2", "zero3", "zero3_chunked", "ddp"])
def test_sharded_grpo_estimate_matches_real_gloo_ranks(dist):
    if "dist=zero3" in dist:
        pytest.importorskip("deepspeed")
    estimated = sharded_ranks(dist + ["measure.backend=estimate"])

    def apart(real):  # (rank, phase): (estimate, real); generation within the same 2 KiB as on one GPU (see above)
        return {(rank, p): (phases(estimated[rank])[p], v) for rank, row in real.items() for p, v in phases(row).items()
                if phases(estimated[rank])[p] != v and not (p == "generate" and abs(phases(estimated[rank])[p] - v) <= 2048)}

    real_run_that_agrees(lambda: sharded_ranks(dist + ["measure.backend=cpu"]), apart)


@pytest.mark.slow
def test_zero3_gathers_the_whole_model_for_generation():
    pytest.importorskip("deepspeed")

    def generate_peak(gather):
        return sharded_ranks(ZERO3 + ["measure.backend=estimate", f"step.ds3_gather_for_generation={gather}"])[0][
            "generate_peak_bytes"]

    # gathered, every parameter is whole through generate: at least the other rank's half of all of them
    # more than when ZeRO-3's hooks gather a few modules at a time (max_live 40,000 elements), at most all
    spec = instantiate(OmegaConf.load(CONF / "model" / "qwen2_5_vl_tiny.yaml"), _convert_="all")
    whole = sum(p.numel() * 4 for p in spec.build(torch.device("meta"), torch.float32, init=False).parameters())
    assert whole // 2 <= generate_peak(True) - generate_peak(False) <= whole


def test_a_sharded_points_processes_are_its_ranks_in_the_planner_and_the_worker_alike():
    from vlmprobe.models.base import DataShape
    from vlmprobe.steps.grpo import GRPOSettings

    # 2 rows per rank x 2 ranks = one group of 4 generations: TRL accepts it, though one rank holds half a group
    config = config_of(TINY + ["data.batch_size=2", "dist=fsdp2", "dist.world_size=2", "measure.backend=estimate"])
    spec = instantiate(config["model"], _convert_="all")
    assert GRPOSettings.from_point(config, DataShape.from_config(config["data"]), spec).num_processes == 2


# --- VLM-R1's own logits path (step.logits=full_sequence): its VLMGRPOTrainer._get_per_token_logps ---

def test_vlm_r1_full_sequence_log_probs_equal_trl_0_17s_on_real_tensors():
    from vlmprobe.steps import logprob

    model, batch = tiny_qwen_rows(2, 40, 16)
    with torch.no_grad():
        full, _ = logprob.full_sequence(model, batch, 16)
        kept, _ = logprob.logits_to_keep(model, batch, 16)
    assert full.shape == kept.shape == (2, 16)
    torch.testing.assert_close(full, kept)


@pytest.mark.slow
def test_vlm_r1_full_sequence_keeps_the_prompt_positions_for_backward_as_counted_by_hand():
    def activations(path):
        row = measure(config_of(TINY + ["measure.backend=cpu", f"step.logits={path}"]))
        assert row["status"] == "ok", row.get("error")
        return row["activations_bytes"]

    rows, prompt, vocab, hidden = 4, 40, 512, 64  # TINY's batch and prompt; qwen2_5_vl_tiny's vocab and width
    # beyond TRL 0.17's C + 1 positions, every prompt position but the last: each row's log_softmax output
    # (float32 under CUDA's autocast, saved for backward) and the LM head's input (autocast's bf16 copy, saved)
    extra = rows * (prompt - 1) * (vocab * 4 + hidden * 2)
    assert activations("full_sequence") - activations("logits_to_keep") == extra
