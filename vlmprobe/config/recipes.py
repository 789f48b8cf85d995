"""A framework's defaults (`recipe=NAME`, conf/recipe/) and a person's own training file (`recipe.file=PATH`) as
overrides that stand under the command line.

The rule: the recipe's settings, then the file's keys (vlmprobe.recipes reads them), then the command line, the
later winning; a key a sweep sweeps is the sweep's. They are written in front of the command line's overrides and the
whole is composed by Hydra again, so a recipe is what the same overrides typed by hand would be (`--cfg job` shows
it). A file alone brings its framework's recipe (a LLaMA-Factory YAML: recipe=llamafactory). Where the command line
sets a key the recipe or file also sets to another value, the command line wins and a notice says so. Every mapped
key is listed on stderr, with the keys the file holds that vlmprobe leaves aside and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from vlmprobe.config.grid import flatten_axes, flatten_cases, format_value
from vlmprobe.config.overrides import compose_command, with_hub_ids
from vlmprobe.errors import ConfigError
from vlmprobe.hub import HUB_NAME
from vlmprobe.recipes import mapping_lines, read_recipe_file

__all__ = ["Applied", "apply_recipe"]

NONE = "none"


@dataclass
class Applied:
    cfg: object  # the composed config (DictConfig) with the recipe applied
    argv: list[str]  # the overrides that compose it: the recipe's, then the command line's
    lines: list[str] = field(default_factory=list)  # what stderr gets: the file's mapping, the notices


def flat(settings, prefix: str = "") -> dict[str, object]:
    """{"train": {"lora_r": 8}} -> {"train.lora_r": 8}; a list or a scalar is a leaf."""
    out: dict[str, object] = {}
    for key, value in (settings or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def set_on_command_line(argv: list[str]) -> dict[str, str]:
    """The keys the command line sets (group choices included), with the text of their values."""
    found = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep:
            found[key.lstrip("+~")] = value
    return found


def swept(cfg) -> set[str]:
    sweep = OmegaConf.to_container(cfg.sweep, resolve=False) or {}
    keys = set(flatten_axes(sweep.get("axes") or {}))
    return keys | {k for case in flatten_cases(sweep.get("cases")) for k in case}


def model_overrides(value) -> list[str]:
    """A file's model: a Hub id as the command line takes it, or a local checkpoint folder through model=hf."""
    text = str(value)
    if HUB_NAME.match(text) and not Path(text).exists():
        return with_hub_ids([f"model={text}"])
    return ["model=hf", f"model.config={text}"]


def recipe_node(compose, argv: list[str], name: str) -> dict:
    """conf/recipe/NAME.yaml as composed (a --config-dir may hold the person's own)."""
    keep = [a for a in argv if not a.startswith(("recipe=", "+recipe="))]
    return OmegaConf.to_container(compose([*keep, f"recipe={name}"]).recipe, resolve=True)


def apply_recipe(compose, argv: list[str]) -> Applied:
    """The command line's config with its recipe and recipe file applied under it (see the module's rule)."""
    cfg = compose_command(compose, argv)
    recipe = OmegaConf.to_container(cfg.recipe, resolve=True)
    path = recipe.get("file")
    if recipe["name"] == NONE and not path:
        return Applied(cfg, argv)
    lines: list[str] = []
    wanted = {f"{group}": option for group, option in (recipe.get("groups") or {}).items()}
    wanted.update(flat(recipe.get("settings")))
    source = f"recipe {recipe['name']}"
    if path:
        read = read_recipe_file(path)
        if recipe["name"] == NONE and read.recipe != NONE:  # a file alone brings its framework's defaults
            recipe = recipe_node(compose, argv, read.recipe)
            wanted = {**dict(recipe.get("groups") or {}), **flat(recipe.get("settings"))}
        wanted.update(read.overrides())
        source = f"recipe {recipe['name']} with {path}"
        lines += [f"vlmprobe: {path} read as {read.kind} (their key: value -> vlmprobe setting):",
                  *(f"  {line}" for line in mapping_lines(read))]
    given, sweeps = set_on_command_line(argv), swept(cfg)
    front: list[str] = []
    for key, value in wanted.items():
        if key in sweeps:
            continue
        if key in given:
            if given[key] != format_value(value):
                lines.append(f"vlmprobe: notice: {key}={given[key]} on the command line wins over {source}'s "
                             f"{format_value(value)}")
            continue
        front += model_overrides(value) if key == "model" else [f"{key}={format_value(value)}"]
    if path and recipe["name"] != cfg.recipe.name:
        front.insert(0, f"recipe={recipe['name']}")
    try:
        return Applied(compose_command(compose, [*front, *argv]), [*front, *argv], lines)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None

