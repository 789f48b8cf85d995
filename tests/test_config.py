"""Every option of every config group composes, and every model instantiates (tiny ones for real, the
published ones on the meta device)."""

import importlib.util

import pytest
import torch
from hydra.utils import instantiate

from conftest import CONF, TESTS
from vlmprobe.models.base import count_params

MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
# grid100 plans 100 points (Hydra composes each: about 40 s on 2 cores): checked among the slow tests
# the largest plans (100 points; several big models, each described on the meta device) run with the slow tests
SLOW_PLANS = {"grid100", "families", "qwen3_vl_moe_expert_lora", "preset_mistral_small_vision_80gb"}
SWEEPS = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_PLANS else name
          for name in sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))]
# model=hf builds from a config.json: here a tiny one in the Hub's layout (tests/data/hf, see test_hf.py)
HF_TINY = TESTS / "data" / "hf" / "qwen2_5_vl_tiny"
NEEDS = {"hf": [f"model.config={HF_TINY}"]}
GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml"))
          for g in ("data", "train", "measure", "optimizer", "dist", "device", "launcher", "step")}


@pytest.mark.parametrize("model", MODELS)
def test_every_model_config_composes_and_builds(compose, model):
    cfg = compose([f"model={model}", *NEEDS.get(model, [])])
    spec = instantiate(cfg.model, _convert_="all")
    built = spec.build(torch.device("meta"), torch.float32, init=False)
    if count_params(built)[0] < 50_000_000:  # a test-sized model (not DeepSeek-VL2-Tiny's 3.4B) is built for real too
        built = spec.build(torch.device("cpu"), torch.float32, init=True)
    params, trainable = count_params(built)
    assert params > 0 and trainable == params
    assert spec.name == (HF_TINY.name if model == "hf" else model)


@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_sweep_composes_and_plans(plan_points, sweep):
    planned = plan_points([f"+sweep={sweep}"])
    assert len(planned) >= 1
    assert len({p.point.id for p in planned}) == len(planned)
    assert all(p.inputs["sweep"] == sweep for p in planned)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes_and_instantiates(compose, group, option):
    cfg = compose([f"{group}={option}"])
    assert cfg[group] is not None
    if group == "device":  # through its _target_, as a point builds it; the file's name is the row's `device`
        from omegaconf import OmegaConf

        from vlmprobe.gpu import device_profile

        card = device_profile.from_config(OmegaConf.to_container(cfg.device, resolve=True))
        assert card is None if option == "none" else (card.key == option and card.total_memory > 0)
    if group == "launcher":  # plain data, checked as the command checks it; the file's name is its `name`
        from omegaconf import OmegaConf

        from vlmprobe.run import launchers

        launcher = OmegaConf.to_container(cfg.launcher, resolve=True)
        if option == "submitit":  # its default cluster, slurm, is refused off a SLURM cluster (test_bad_input)
            launcher["cluster"] = "local"
        launchers.check(launcher, "estimate")
        assert launcher["name"] == option and (option == "local" or launchers.jobs(launcher) >= 1)
    if group == "step":  # plain data, validated as a point validates it (grpo: 4 rows, one prompt's generations)
        from omegaconf import OmegaConf

        from vlmprobe.models.base import DataShape
        from vlmprobe.config.checks import check_step

        point = OmegaConf.to_container(compose([f"step={option}", "model=qwen2_5_vl_tiny", "data.batch_size=4"]),
                                       resolve=True)
        spec = instantiate(point["model"], _convert_="all")
        settings = check_step(point, DataShape.from_config(point["data"]), spec)
        assert point["step"]["name"] == option and (settings is None) == (option == "sft")
    if group == "optimizer":
        if option == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
            pytest.skip("bitsandbytes is not installed (its rows say `skipped`, see test_knobs)")
        weight = torch.nn.Parameter(torch.ones(4, 4))
        optimizer = instantiate(cfg.optimizer, _convert_="all")([weight])
        weight.grad = torch.ones(4, 4)
        optimizer.step()
        assert optimizer.state[weight] and not torch.equal(weight.detach(), torch.ones(4, 4))


def test_published_parameter_count_of_nanovlm_222m(compose):
    # FACTS.md section 3: 222,083,328 (SigLIP-B/16 without head + SmolLM2-135M with 3 added tokens + projector)
    spec = instantiate(compose(["model=nanovlm_222m"]).model, _convert_="all")
    model = spec.build(torch.device("meta"), torch.float32, init=False)
    assert count_params(model) == (222_083_328, 222_083_328)
    assert sum(p.numel() for p in model.projector.parameters()) == 768 * 4 * 576
    assert model.lm.head.weight is model.lm.embed.weight  # tied


def test_the_families_sweep_has_every_published_model():
    from omegaconf import OmegaConf

    axis = OmegaConf.load(CONF / "sweep" / "families.yaml").sweep.axes.model
    # test variants end in _tiny, or _toy where the published model is itself "tiny" (deepseek_vl2_tiny)
    published = [m for m in MODELS if m != "hf" and not m.endswith("_toy")
                 and (not m.endswith("_tiny") or m == "deepseek_vl2_tiny")]
    assert sorted(axis) == published
