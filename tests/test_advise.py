"""+advise=fit: each knob on top of the person's point, ranked by what it saves on the card, and a same-training
set that fits, which holds when that point is run against the card's capacity as an ordinary point; bad input
refused in one line."""

import pandas as pd
import pytest

from conftest import run_cli
from vlmprobe.errors import ConfigError
from vlmprobe.sizes import margin_bytes

POINT = ["model=qwen2_vl_tiny", "data.batch_size=4", "data.lm_max_length=256", "measure.backend=estimate",
         "launcher=local"]
CAPACITY = 24 * 2**20  # a card too small for the point as given (bytes)


def test_the_advisor_ranks_knobs_and_its_same_training_set_fits_when_run_against_the_capacity(tmp_path):
    advised = run_cli(["+advise=fit", *POINT, f"measure.device_memory={CAPACITY}", "advise.margin=0",
                       f"results_dir={tmp_path}"], cwd=tmp_path)
    assert advised.returncode == 0, advised.stderr
    out = advised.stdout.splitlines()
    assert out[0].startswith("vlmprobe: +advise=fit on the capacity given (estimate;")
    (folder,) = tmp_path.glob("single/*")
    table = pd.read_csv(folder / "advise.csv")
    assert table["knob"][0] == "(your point)" and not table["fits"][0]
    savings = table["saves_bytes"][1:].dropna()
    assert list(savings) == sorted(savings, reverse=True)  # ranked
    rows = pd.read_csv(folder / "results.csv").set_index("point_id")
    base = rows.loc["default", "predicted_device_bytes"] if "predicted_device_bytes" in rows else None
    assert base is None or pd.isna(base)  # no card profile: the figure is the peak reserved
    for knob in table.itertuples():
        if knob.knob != "(your point)":
            point_id = ",".join(knob.knob.split(" "))
            assert knob.saves_bytes == rows.loc["default", "peak_reserved_bytes"] - rows.loc[point_id, "peak_reserved_bytes"]
    said = out[-1]
    assert said.startswith("advise: fits with the same training: "), said
    chosen = said.split(": ", 2)[2].split(" -> ")[0].replace(" + ", " ").split()
    # the independent check: the point with those knobs, run as an ordinary point against the capacity
    run = run_cli([*POINT, *chosen, f"measure.device_memory={CAPACITY}", f"results_dir={tmp_path}/check"], cwd=tmp_path)
    assert run.returncode == 0 and "default: fits in the capacity given" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("value,message", [
    (0.7, "advise.margin=0.7 is not allowed: give a fraction of the memory in [0, 0.5)"),
    ("30GiB", "advise.margin='30GiB' is not allowed: give a size below the 25,769,803,776 B it is kept from"),
])
def test_a_margin_out_of_range_is_refused_in_one_line(value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        margin_bytes(value, 24 * 2**30, "advise.margin")


def test_advice_without_a_card_or_on_a_card_smaller_than_the_4_bit_weights_is_refused(tmp_path):
    none = run_cli(["+advise=fit", *POINT, "dry_run=true"], cwd=tmp_path)
    assert none.returncode == 2 and none.stderr.strip().endswith("name the card (device=rtx4090, ...) or its memory "
                                                                  "(measure.device_memory=24GiB)")
    small = run_cli(["+advise=fit", "model=qwen2_vl_7b", "device=rtx3090", "measure.device_memory=3GiB", "dry_run=true"],
                    cwd=tmp_path)
    assert small.returncode == 2 and "even in 4 bits, more than the" in small.stderr


@pytest.mark.parametrize("engine, accum, expected", [
    ("ddp", 2, {"dist=zero2 dist.world_size=2", "dist=zero3 dist.world_size=2", "dist=fsdp2 dist.world_size=2"}),
    ("zero2", 4, {"dist=zero3 dist.world_size=2", "dist.offload_optimizer=cpu",
                  "dist.world_size=4 train.grad_accum_steps=2"}),
    ("zero3", 1, {"dist.offload_optimizer=cpu", "dist.offload_param=cpu", "dist.world_size=4"}),
])
def test_with_an_engine_the_advisor_offers_more_sharding_offload_and_more_gpus(compose, engine, accum, expected):
    from omegaconf import OmegaConf

    from vlmprobe.run.advise import engine_knobs

    cfg = compose([f"dist={engine}", "dist.world_size=2"])
    offered = {k.name: k for k in engine_knobs(OmegaConf.to_container(cfg.dist), accum)}
    assert set(offered) == expected
    # the same training where the effective batch (GPUs x micro batch x accumulation) stays: an independent count
    for name, knob in offered.items():
        gpus = int(name.split("dist.world_size=")[1].split()[0]) if "world_size" in name else 2
        steps = int(name.split("train.grad_accum_steps=")[1]) if "grad_accum_steps" in name else accum
        assert knob.same_training == (gpus * steps == 2 * accum), name


@pytest.mark.slow  # ~40 s: DeepSpeed's checks of every planned point
def test_every_engine_knob_composes_as_a_point(compose):
    from omegaconf import OmegaConf

    from vlmprobe.run.advise import Advisor

    point = [*POINT[:-1], "dist=zero2", "dist.world_size=2", "train.grad_accum_steps=4", "measure.device_memory=1GiB",
             "+advise=fit"]
    advisor = Advisor(compose, point, OmegaConf.to_container(compose(point), resolve=True))
    assert {"dist=zero3 dist.world_size=2", "dist.offload_optimizer=cpu",
            "dist.world_size=4 train.grad_accum_steps=2"} <= {k.name for k in advisor.knobs}, advisor.left_out
