"""plan.Composer composes each distinct set of group choices once and applies the rest with Hydra's own code: every
point's config must be exactly what composing its whole command line gives (the independent reference here)."""

import time

import pytest
from omegaconf import OmegaConf

from vlmprobe.config.plan import Composer, grid_points
from vlmprobe.errors import ConfigError

SWEEPS = {
    # cases that choose a group option (optimizer=...), set a value inside a group (model.attn_implementation), set
    # several values at once, and an empty case; a group choice and values on the command line
    # (16 points, ~9 s: slow)
    "knobs": pytest.param(["+sweep=knobs", "model=nanovlm_tiny", "data.lm_max_length=100", "measure.backend=estimate"],
                          marks=pytest.mark.slow),
    # a group axis crossed with value axes (lists included); axes set on the command line
    "group axis": ["+sweep=smoke", "sweep.axes.data.batch_size=[3]", "sweep.axes.data.lm_max_length=[64]",
                   "+sweep.axes.model=[nanovlm_tiny,qwen2_vl_tiny]", "+sweep.axes.train.lora_r=[0,4]",
                   "+sweep.axes.train.lora_target_modules=[[q_proj],[q_proj,v_proj]]", "optimizer=sgd_momentum"],
}


@pytest.mark.parametrize("overrides", SWEEPS.values(), ids=list(SWEEPS))
def test_each_point_is_composed_exactly_as_hydra_composes_its_whole_command_line(compose, overrides):
    base = OmegaConf.to_container(compose(overrides), resolve=True)
    points = grid_points(overrides, base)
    composer = Composer(compose, overrides)
    for point in points:
        reference = OmegaConf.to_container(compose(overrides + point.overrides), resolve=True)
        assert composer(point) == reference, point.id
    distinct_groups = {tuple(o for o in p.overrides if o.split("=")[0] in ("model", "optimizer")) for p in points}
    assert len(composer._composed) == len(distinct_groups) < len(points)


def test_a_point_hydra_refuses_is_named_as_before(compose):
    overrides = ["+sweep=smoke", "+sweep.axes.data.nope=[1]"]
    (point, *_) = grid_points(overrides, {"sweep": {"axes": {"data": {"nope": [1]}}}, "data": {"nope": None}})
    with pytest.raises(ConfigError, match=r"data.nope=1 is not allowed: data has no key 'nope'"):
        Composer(compose, overrides[:1])(point)


def test_composing_a_100_point_grid_takes_the_time_of_its_few_group_choices(compose):
    overrides = ["+sweep=grid100"]
    points = grid_points(overrides, OmegaConf.to_container(compose(overrides), resolve=True))
    composer = Composer(compose, overrides)
    started = time.perf_counter()
    configs = [composer(p) for p in points]
    took = time.perf_counter() - started
    assert len(configs) == 100 and len(composer._composed) == 1
    assert {(c["data"]["batch_size"], c["data"]["lm_max_length"]) for c in configs} == {
        (b, length) for b in (1, 4, 16, 64, 128) for length in (128, 256, 512, 1024, 2048)}
    assert took < 15, f"{took:.1f} s for 100 points (whole compositions took ~30 s)"
