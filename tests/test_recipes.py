"""recipe=NAME and recipe.file=PATH applied under the command line (vlmprobe.config.recipes): the point a person's
training file describes, read back against the file's own values; the command line and a sweep's axes win; every
recipe composes as a point; bad input is one line."""

import shlex

import pytest
import yaml

from conftest import REPO
from vlmprobe.config.recipes import apply_recipe

FILES = REPO / "tests" / "data" / "recipes"
RECIPES = sorted(p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml"))


def test_a_llamafactory_file_is_the_point_its_keys_say_over_llamafactorys_defaults(compose):
    path = FILES / "llamafactory_qwen2_5vl_lora_sft.yaml"
    theirs = yaml.safe_load(path.read_text())
    applied = apply_recipe(compose, [f"recipe.file={path}"])
    cfg = applied.cfg
    assert cfg.recipe.name == "llamafactory" and cfg.model.name == "qwen2_5_vl_7b"  # their model_name_or_path
    assert (cfg.data.batch_size, cfg.data.lm_max_length, cfg.data.max_pixels) == (
        theirs["per_device_train_batch_size"], theirs["cutoff_len"], theirs["image_max_pixels"])
    assert (cfg.train.lora_r, cfg.train.grad_accum_steps) == (theirs["lora_rank"], theirs["gradient_accumulation_steps"])
    assert cfg.dist.name == "zero3" and cfg.dist.deepspeed_config.endswith(theirs["deepspeed"])
    assert cfg.train.grad_ckpt_reentrant is True  # not in the file: LLaMA-Factory's own default (use_reentrant_gc)
    assert applied.lines[0].startswith(f"vlmprobe: {path} read as llamafactory")
    assert any(line.strip().startswith("cutoff_len: 2048 -> data.lm_max_length=2048") for line in applied.lines)


def test_an_ms_swift_command_line_is_the_point_it_launches(compose):
    path = FILES / "swift_sft_qwen2_5vl.sh"
    words = shlex.split(path.read_text().replace("\\\n", " "), comments=True)
    flag = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--")}
    cfg = apply_recipe(compose, [f"recipe.file={path}"]).cfg
    assert cfg.recipe.name == "ms_swift" and cfg.model.name == "qwen2_5_vl_7b"
    assert (cfg.data.batch_size, cfg.data.lm_max_length, cfg.train.grad_accum_steps, cfg.train.lora_r) == (
        int(flag["--per_device_train_batch_size"]), int(flag["--max_length"]),
        int(flag["--gradient_accumulation_steps"]), int(flag["--lora_rank"]))
    assert cfg.dist.name == flag["--deepspeed"] and cfg.dist.world_size == 2  # NPROC_PER_NODE=2
    assert cfg.data.max_pixels == 1003520  # MAX_PIXELS=1003520


@pytest.mark.parametrize("name, step", [("trl_sft_qwen2_5vl.yaml", "sft"), ("trl_grpo_qwen2_5vl.yaml", "grpo")])
def test_a_trl_config_is_the_point_it_trains(compose, name, step):
    theirs = yaml.safe_load((FILES / name).read_text())
    cfg = apply_recipe(compose, [f"recipe.file={FILES / name}"]).cfg
    assert cfg.step.name == step and cfg.recipe.name == f"trl_{step}"
    assert cfg.data.batch_size == theirs["per_device_train_batch_size"]
    assert cfg.train.grad_accum_steps == theirs["gradient_accumulation_steps"]
    assert cfg.train.grad_ckpt.lm is theirs["gradient_checkpointing"]
    if step == "grpo":
        assert cfg.step.num_generations == theirs["num_generations"]


def test_the_command_line_wins_over_the_recipe_with_a_notice_and_a_swept_key_is_the_sweeps(compose):
    applied = apply_recipe(compose, ["recipe=llamafactory", "train.lora_r=32"])
    assert applied.cfg.train.lora_r == 32 and applied.cfg.train.freeze_vision is True  # the rest is the recipe's
    assert "vlmprobe: notice: train.lora_r=32 on the command line wins over recipe llamafactory's 8" in applied.lines
    swept = apply_recipe(compose, ["recipe=llamafactory", "+sweep.axes.train.lora_r=[4,64]"])
    assert not [a for a in swept.argv if a.startswith("train.lora_r=")] and not swept.lines


def test_no_recipe_leaves_the_command_line_as_it_is(compose):
    applied = apply_recipe(compose, ["data.batch_size=2"])
    assert applied.argv == ["data.batch_size=2"] and not applied.lines


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_with_its_settings_in_the_config(compose, recipe):
    applied = apply_recipe(compose, [f"recipe={recipe}"])
    settings = yaml.safe_load((REPO / "conf" / "recipe" / f"{recipe}.yaml").read_text())["settings"]
    for group, values in settings.items():
        for key, value in values.items():
            if not isinstance(value, dict):
                assert applied.cfg[group][key] == value, (group, key)


@pytest.mark.slow  # ~5-20 s a recipe: each planned and validated as a point
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "none"])
def test_every_recipe_plans_as_a_valid_point(plan_points, compose, recipe):
    applied = apply_recipe(compose, [f"recipe={recipe}", "model=qwen2_vl_tiny", "data.lm_max_length=256",
                                     "data.batch_size=8"])  # GRPO: a multiple of TRL's 8 generations
    (point,) = plan_points(applied.argv)  # validated as any point is
    assert point.config["recipe"]["name"] == recipe


def test_a_missing_file_and_a_bad_value_are_one_line(cli, tmp_path):
    code, err = cli([f"recipe.file={tmp_path / 'nope.yaml'}", "dry_run=true"])
    assert code == 2 and len(err) == 1 and "nope.yaml" in err[0], err
    bad = tmp_path / "lf.yaml"
    bad.write_text("model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct\nstage: sft\nfinetuning_type: lora\n"
                   "cutoff_len: many\n")
    code, err = cli([f"recipe.file={bad}", "dry_run=true"])
    assert code == 2 and err[-1].startswith("vlmprobe: ") and "cutoff_len" in err[-1], err


def test_what_a_recipe_does_unmodelled_is_in_each_rows_notes(cli, tmp_path):
    import pandas as pd

    code, err = cli(["recipe=llamafactory", "model=qwen2_vl_tiny", "data.batch_size=1", "data.lm_max_length=128",
                     "measure.backend=estimate", "launcher=local"])
    assert code == 0, err
    (table,) = (tmp_path / "r").glob("single/*/results.csv")
    notes = pd.read_csv(table)["notes"][0]
    unmodelled = yaml.safe_load((REPO / "conf" / "recipe" / "llamafactory.yaml").read_text())["not_modelled"]
    assert all(f"recipe llamafactory does, not modelled here: {item}" in notes for item in unmodelled)
