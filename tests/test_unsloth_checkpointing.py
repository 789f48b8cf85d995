"""Unsloth's gradient checkpointing as knobs (vlmprobe.knobs): train.grad_ckpt.offload keeps the checkpointed
layers' inputs on the host as unsloth_zoo 2026.10.9's UnslothCheckpointFunction does, with its device staging
buffers and host slots; train.grad_ckpt.vision=unsloth checkpoints Mllama's vision encoder layers as Unsloth's
patch of them does. Sizes are hand counts from the tiny configs and Unsloth's constants; the estimate is held to
the cpu backend to the byte.

Unsloth offloads only inputs of more than 2 MiB (MINIMUM_SIZE), which no tiny model has: the tests that exercise
the copies lower that cut to 0 (monkeypatch); one test keeps it and sees nothing leave the device.
"""

import functools

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF
from vlmprobe import knobs
from vlmprobe.config.plan import plan
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.point.measure import measure

QWEN = ["model=qwen2_vl_tiny", "data.batch_size=2", "data.lm_max_length=64", "measure.backend=estimate"]
MLLAMA = ["model=mllama_tiny", "data.batch_size=2", "data.lm_max_length=48", "measure.backend=estimate"]
REENTRANT_LM = ["train.grad_ckpt.lm=true", "train.grad_ckpt_reentrant=true"]
OFFLOAD = ["train.grad_ckpt.offload=true"]
BYTE_COLUMNS = ("peak_allocated_bytes", "last_step_peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes",
                "optimizer_peak_bytes", "after_load_bytes", "after_step_bytes", "activations_bytes", "grads_bytes",
                "optimizer_state_bytes", "params_bytes", "peak_reserved_bytes", "peak_host_bytes",
                "after_step_host_bytes")
TRAINING_STATE = ("params_bytes", "grads_bytes", "optimizer_state_bytes")
# qwen2_vl_tiny's LM layer input at batch 2 x 64 tokens: hidden 64, float32 (fp32 weights, bf16 autocast keeps the
# residual stream in float32), a multiple of 512 so its block is its size
LAYER_INPUT = 2 * 64 * 64 * 4
# Unsloth's device staging buffers: two of INITIAL_GPU_BUFFER_SIZE (2 x 256 x 2048) elements of the load dtype
STAGING = 2 * (2 * 256 * 2048) * 4
# its host slots: INITIAL_CPU_BUFFER_COUNT (200) of INITIAL_CPU_BUFFER_SIZE (128 x 1024) elements, float32 here
HOST_SLOTS = 200 * 128 * 1024 * 4


@pytest.fixture(scope="module")
def rows():
    """rows(cut, *overrides) -> the outputs of one point measured with Unsloth's offload cut (bytes) at `cut`,
    measured once for the module: several tests read the same points, and a point without offload, which never
    reads the cut, once for any cut."""

    def measured(cut: int, *overrides: str) -> dict:
        return cached(cut if "train.grad_ckpt.offload=true" in overrides else UNSLOTHS, *overrides)

    @functools.lru_cache(maxsize=None)
    def cached(cut: int, *overrides: str) -> dict:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            composed = lambda o: hydra_compose(config_name="config", overrides=list(o))  # noqa: E731
            (planned,) = plan(composed, list(overrides), OmegaConf.to_container(composed(overrides), resolve=True))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(knobs, "UNSLOTH_MINIMUM_BYTES", cut)
            return measure(planned.config)

    return measured


@pytest.fixture
def copies_every_input(monkeypatch):
    monkeypatch.setattr(knobs, "UNSLOTH_MINIMUM_BYTES", ALL)


ALL = 0  # a cut that lets every input go (module doc)
UNSLOTHS = knobs.UNSLOTH_MINIMUM_BYTES  # 2 MiB


def built(composed, overrides) -> tuple:
    """(spec, model on the meta device with the knobs of `overrides` applied)."""
    cfg = composed(overrides)
    spec = instantiate(cfg.model, _convert_="all")
    model = spec.build("meta", torch.float32, init=False)
    knobs.apply_knobs(spec, model, OmegaConf.to_container(cfg.train, resolve=True))
    return spec, model


def test_offload_keeps_each_checkpointed_layers_input_off_the_device_in_the_first_step(rows):
    # one step: the first pass offloads both LM layers' inputs; the staging buffers are made in its forward
    kept = rows(ALL, *QWEN, *REENTRANT_LM, "measure.steps=1")
    offloaded = rows(ALL, *QWEN, *REENTRANT_LM, *OFFLOAD, "measure.steps=1")
    assert offloaded["activations_bytes"] == kept["activations_bytes"] - 2 * LAYER_INPUT + STAGING
    assert offloaded["backward_peak_bytes"] == kept["backward_peak_bytes"] - 2 * LAYER_INPUT + STAGING
    assert offloaded["peak_host_bytes"] == HOST_SLOTS and kept["peak_host_bytes"] is None
    assert {k: offloaded[k] for k in TRAINING_STATE} == {k: kept[k] for k in TRAINING_STATE}


def test_after_the_first_step_the_last_layer_keeps_its_input_and_the_estimate_equals_the_cpu_backend(rows):
    kept = rows(ALL, *QWEN, *REENTRANT_LM)
    offloaded = rows(ALL, *QWEN, *REENTRANT_LM, *OFFLOAD)
    cpu = rows(ALL, *QWEN, *REENTRANT_LM, *OFFLOAD, "measure.backend=cpu")
    # the second step (the row's) offloads the first of the two layers only (LAST_GC_INDEX); the buffers stay
    assert offloaded["activations_bytes"] == kept["activations_bytes"] - LAYER_INPUT
    assert offloaded["backward_peak_bytes"] == kept["backward_peak_bytes"] - LAYER_INPUT + STAGING
    assert offloaded["after_step_bytes"] == kept["after_step_bytes"] + STAGING
    assert cpu["status"] == offloaded["status"] == "ok"
    assert {k: offloaded[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


def test_a_card_with_under_512_mib_free_drops_the_second_staging_buffer_after_the_first_step(rows):
    roomy = rows(ALL, *QWEN, *REENTRANT_LM, *OFFLOAD)
    small = rows(ALL, *QWEN, *REENTRANT_LM, *OFFLOAD, "measure.device_memory=256MiB")
    assert small["after_step_bytes"] == roomy["after_step_bytes"] - STAGING // 2


def test_inputs_under_unsloths_2_mib_cut_stay_on_the_device_and_only_the_host_slots_are_added(rows):
    kept = rows(UNSLOTHS, *QWEN, *REENTRANT_LM)
    offloaded = rows(UNSLOTHS, *QWEN, *REENTRANT_LM, *OFFLOAD)
    device = [c for c in BYTE_COLUMNS if "host" not in c]
    assert {k: offloaded[k] for k in device} == {k: kept[k] for k in device}
    assert offloaded["peak_host_bytes"] == HOST_SLOTS


@pytest.mark.slow  # two real backward passes, ~5 s
def test_offload_recomputes_the_same_gradients_as_reentrant_checkpointing_for_bf16_weights(compose,
                                                                                        copies_every_input):
    # real tensors outside the backends (as on cuda: no tracker); bfloat16 inputs are stored as they are, so the
    # recomputation sees the very values the forward did (float32 ones Unsloth stores as bfloat16)
    def gradients(overrides):
        cfg = compose(["model=qwen2_vl_tiny", "train.param_dtype=bfloat16", *overrides])
        spec = instantiate(cfg.model, _convert_="all")
        torch.manual_seed(0)
        model = spec.build("cpu", torch.bfloat16)
        knobs.apply_knobs(spec, model, OmegaConf.to_container(cfg.train, resolve=True))
        batch = spec.batch(DataShape(batch_size=2, lm_max_length=48), torch.device("cpu"))
        spec.loss(model.train(), batch)[0].backward()  # the first step: every layer's input offloaded
        return {name: p.grad for name, p in model.named_parameters()}

    both = [*REENTRANT_LM, "train.grad_ckpt.vision=true"]
    kept, offloaded = gradients(both), gradients([*both, *OFFLOAD])
    assert all(kept[name] is not None and torch.equal(kept[name], offloaded[name]) for name in kept)


def test_offload_off_leaves_transformers_checkpoint_function_and_on_replaces_it_in_the_checkpointed_tower(compose):
    _, plain = built(compose, ["model=qwen2_vl_tiny", *REENTRANT_LM])
    _, offloaded = built(compose, ["model=qwen2_vl_tiny", *REENTRANT_LM, *OFFLOAD])
    for model, kind in ((plain, "partial"), (offloaded, "UnslothOffload")):
        functions = {type(m._gradient_checkpointing_func).__name__ for m in model.model.language_model.modules()
                     if hasattr(m, "_gradient_checkpointing_func")}
        assert functions == {kind}
        assert not any(hasattr(m, "_gradient_checkpointing_func") for m in model.model.visual.modules())


def test_mllama_vision_by_unsloth_checkpoints_every_layer_of_both_encoders(compose):
    spec, model = built(compose, ["model=mllama_tiny", "train.grad_ckpt.vision=unsloth"])
    wrapped = sorted(name for name, m in model.model.vision_model.named_modules()
                     if hasattr(vars(m).get("forward"), "__wrapped__"))
    local, global_ = spec.vision["num_hidden_layers"], spec.vision["num_global_layers"]  # 2 and 1
    assert wrapped == sorted([f"transformer.layers.{i}" for i in range(local)]
                             + [f"global_transformer.layers.{i}" for i in range(global_)])


def test_mllama_vision_by_unsloth_drops_the_towers_activations_and_keeps_its_gradients(rows):
    plain = rows(UNSLOTHS, *MLLAMA)
    # reentrant, as Unsloth runs it: the layers' input (a keyword) must reach the checkpoint by position, or the
    # tower would get no gradient
    ckpt = rows(UNSLOTHS, *MLLAMA, "train.grad_ckpt.vision=unsloth", "train.grad_ckpt_reentrant=true")
    assert ckpt["activations_bytes"] < plain["activations_bytes"]
    assert {k: ckpt[k] for k in TRAINING_STATE} == {k: plain[k] for k in TRAINING_STATE}  # grads: every one


@pytest.mark.slow
def test_mllama_with_both_towers_offloaded_estimates_the_cpu_backend_to_the_byte(rows):
    both = [*MLLAMA, "train.grad_ckpt.vision=unsloth", *REENTRANT_LM, *OFFLOAD, "measure.steps=3"]
    estimate = rows(ALL, *both)
    cpu = rows(ALL, *both, "measure.backend=cpu")
    assert cpu["status"] == estimate["status"] == "ok"
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


@pytest.mark.parametrize("overrides,message", [
    (["model=qwen2_vl_tiny", "train.grad_ckpt.offload=true", "train.grad_ckpt_reentrant=true"],
     r"^train\.grad_ckpt\.offload=true is not allowed without checkpointing: "),
    (["model=qwen2_vl_tiny", "train.grad_ckpt.lm=true", "train.grad_ckpt.offload=true"],
     r"^train\.grad_ckpt\.offload=true is not allowed with train\.grad_ckpt_reentrant=false: "),
    (["model=qwen2_vl_tiny", *REENTRANT_LM, *OFFLOAD, "dist=ddp", "dist.world_size=2"],
     r"^train\.grad_ckpt\.offload=true is not allowed with dist=ddp: "),
    (["model=nanovlm_tiny", *REENTRANT_LM, *OFFLOAD],
     r"^train\.grad_ckpt\.offload=true is not allowed for nanovlm_tiny: "),
    (["model=qwen2_vl_tiny", "train.grad_ckpt.vision=unsloth"],
     r"^train\.grad_ckpt\.vision=unsloth is not allowed for qwen2_vl_tiny: Unsloth checkpoints no layer of its "
     r"vision tower that transformers does not"),
    (["model=qwen2_vl_tiny", "train.grad_ckpt.vision=transformers"],
     r"^train\.grad_ckpt\.vision='transformers' is not allowed: use true, false or unsloth"),
    (["model=qwen2_vl_tiny", "train.grad_ckpt.lm=unsloth"],
     r"^train\.grad_ckpt\.lm='unsloth' is not allowed: use true or false"),
])
def test_bad_unsloth_checkpointing_values_are_one_line(plan_points, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_points(overrides)
