"""The recipe files (conf/recipe/*.yaml) keep the schema an integrator applies: name, framework, file, groups,
settings, not_modelled, in that order; every group option is a file of conf/<group>/; every key under settings is a
key of the config Hydra composes with the recipe's groups chosen, with a value of the kind that key holds; and every
setting and group line cites where it was read (a comment naming a source file). Reads and composes configs only
(no model, no point): about a second."""

import re

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import CONF, REPO

RECIPES = sorted((CONF / "recipe").glob("*.yaml"))
NAMES = ["hf_trainer", "internvl", "llamafactory", "llava", "ms_swift", "none", "qwen_vl", "trl_dpo", "trl_grpo",
         "trl_sft", "unsloth"]
SCHEMA = ["name", "framework", "file", "groups", "settings", "not_modelled"]
# a citation names the file it was read from: a path ending in a source, script, config or notebook suffix
CITATION = re.compile(r"#.*?[\w./-]+\.(?:py|sh|json|yaml|md|ipynb|toml|txt)\b")


def load(path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def leaves(mapping, prefix=()):
    """(path, value) for every value under a nested mapping that is not itself a mapping."""
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def block_lines(text: str, key: str) -> list[str]:
    """The raw lines of a top-level block (`key:` and the indented lines under it)."""
    lines = text.splitlines()
    start = lines.index(f"{key}:")
    block = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        block.append(line)
    return block


def test_the_recipe_group_holds_one_file_per_framework_and_none():
    assert [p.stem for p in RECIPES] == NAMES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_has_the_schema_keys_in_order_with_their_kinds(path):
    recipe = load(path)
    assert list(recipe) == SCHEMA
    assert recipe["name"] == path.stem
    assert recipe["file"] is None  # recipe.file=PATH is the user's
    assert isinstance(recipe["groups"], dict) and all(isinstance(v, str) for v in recipe["groups"].values())
    assert isinstance(recipe["settings"], dict)
    assert isinstance(recipe["not_modelled"], list) and all(isinstance(r, str) and r for r in recipe["not_modelled"])
    if path.stem == "none":
        assert recipe == {"name": "none", "framework": None, "file": None, "groups": {}, "settings": {},
                          "not_modelled": []}
    else:
        # what was read, pinned: a version number or a commit
        assert re.search(r"\d+\.\d+|@[0-9a-f]{7,40}", recipe["framework"]), recipe["framework"]
        assert recipe["settings"] and recipe["not_modelled"]
        assert recipe["groups"].get("step") in ("sft", "grpo", "dpo")
        # the first line says what the file is: a comment
        assert path.read_text(encoding="utf-8").startswith("# ")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_group_option_is_a_file_of_that_config_group(path):
    groups = load(path)["groups"]
    defaults = [next(iter(entry)) for entry in load(CONF / "config.yaml")["defaults"] if isinstance(entry, dict)]
    for group, option in groups.items():
        assert group in defaults, f"{group} is not a config group of conf/config.yaml"
        assert (CONF / group / f"{option}.yaml").is_file(), f"no conf/{group}/{option}.yaml"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_setting_is_a_key_of_the_composed_config_with_a_value_of_its_kind(path, compose):
    recipe = load(path)
    config = OmegaConf.to_container(compose([f"{g}={o}" for g, o in recipe["groups"].items()]), resolve=True)
    for keys, value in leaves(recipe["settings"]):
        node = config
        for key in keys:
            assert isinstance(node, dict) and key in node, f"{'.'.join(keys)} is not a key of the composed config"
            node = node[key]
        default = node
        if value is None or default is None:
            continue  # a nullable key: null on one side
        if isinstance(default, bool) or isinstance(value, bool):
            # grad_ckpt.vision also takes the string unsloth
            assert isinstance(value, bool) or keys[-1] == "vision", f"{'.'.join(keys)}={value!r}"
        elif isinstance(default, (int, float)):
            assert isinstance(value, (int, float)), f"{'.'.join(keys)}={value!r}"
        else:
            assert type(value) is type(default), f"{'.'.join(keys)}={value!r} (default {default!r})"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_setting_and_group_line_carries_a_citation_comment(path):
    text = path.read_text(encoding="utf-8")
    for key in ("groups", "settings"):
        if load(path)[key] == {}:
            assert re.search(rf"^{key}: \{{\}}", text, flags=re.M)
            continue
        for line in block_lines(text, key):
            body = line.split("#")[0].rstrip()
            if body.endswith(":") or not body.strip():
                continue  # a mapping's header or an empty line: no value to cite
            assert CITATION.search(line), f"{path.name}: no citation on {line.strip()!r}"


def test_the_citation_check_tells_a_cited_line_from_a_bare_one():
    assert CITATION.search("    lora_r: 8   # hparams/finetuning_args.py: lora_rank default 8")
    assert not CITATION.search("    lora_r: 8   # the default")
    assert not CITATION.search("    lora_r: 8")


def test_the_recipes_page_sets_every_recipe_side_by_side_as_its_file_says():
    lines = (REPO / "docs" / "recipes.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| setting |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    columns = rows[0][1:]
    assert columns == [n for n in NAMES if n != "none"]
    table = {row[0]: dict(zip(columns, row[1:])) for row in rows[2:]}
    for name in columns:
        recipe = load(CONF / "recipe" / f"{name}.yaml")
        for group, option in recipe["groups"].items():
            assert table[f"{group}="][name] == option
        for keys, value in leaves(recipe["settings"]):
            cell = table[".".join(keys)][name]  # every setting has its row
            if isinstance(value, bool) or value is None:
                assert cell == {True: "true", False: "false", None: "null"}[value], (name, keys)
            elif isinstance(value, (int, float, str)):
                assert cell == (f"{value:.0e}".replace("e+0", "e") if isinstance(value, int) and value >= 10**8
                                else str(value)), (name, keys)
