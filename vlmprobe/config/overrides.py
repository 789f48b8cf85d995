"""Command-line overrides composed by Hydra, with every refusal as one line naming the override.

Hydra's own errors are several lines, and the remedy (`+key=...` for a new axis) sits in the middle of
them; here each becomes a ConfigError that names the override, says what the config has there, and how to
say it instead. Composition is Hydra's (`compose(overrides) -> DictConfig`); nothing is re-implemented.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
from pathlib import Path

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from vlmprobe.errors import ConfigError, first_line
from vlmprobe.hub import HUB_NAME, shipped_option
from vlmprobe.paths import CONF

__all__ = ["OPEN_NODES", "check_additions", "check_group_choices", "compose_checked", "compose_command", "composing",
           "resolved", "with_hub_ids", "with_config_dirs"]

_NOT_THERE = re.compile(r"Could not override '([^']+)'")
_ALREADY = re.compile(r"An item is already at '([^']+)'")
# Nodes whose keys are open: a sweep's axes and cases, and submitit's own parameters (passed to it as they are).
OPEN_NODES = ("sweep", "launcher.parameters")
# Keys a command line may remove (~key): a named sweep's axes and cases. Every other key is read by
# vlmprobe, so removing it is refused (set a value instead).
REMOVABLE = ("sweep.axes.", "sweep.cases")


@contextlib.contextmanager
def composing():
    """Hydra initialised on conf/ for the block; yields `compose(overrides) -> DictConfig`, which composes each
    distinct list of overrides once (a single point is the command line itself)."""
    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        @functools.lru_cache(maxsize=None)
        def composed(extra: tuple):
            return hydra.compose(config_name="config", overrides=list(extra))

        yield lambda extra: composed(tuple(extra))


def compose_command(compose, argv: list[str]):
    """The command line's config: each argument checked (syntax, group options, what a `+` adds) before Hydra
    composes it, and Hydra's refusal named in one line."""
    check_syntax(argv)
    check_group_choices(argv)
    cfg = compose_checked(compose, argv)
    check_additions(compose, argv)
    return cfg


def check_additions(compose, argv: list[str]) -> None:
    """A `+key=value` that adds a key vlmprobe would never read is refused in one line, with the key meant where
    one is close (`+model.text.hidden_sise=4096` would be ignored, the model built without it). A key may be added
    where something takes any key: under a node with a `_target_` (its constructor checks it: optimizer, model,
    device), under OPEN_NODES, and a group chosen with + (+sweep=NAME)."""
    added = [a for a in argv if a.startswith("+") and not a.startswith("++") and "=" in a]
    if not added:
        return
    others = [a for a in argv if a not in added]
    for arg in added:
        key = arg[1:].split("=", 1)[0]
        parent, _, leaf = key.rpartition(".")
        if (not parent and (CONF / key).is_dir()) or any(f"{key}.".startswith(f"{o}.") for o in OPEN_NODES):
            continue
        node = _node(compose, others, parent)
        if not isinstance(node, dict) or "_target_" in node or not node:
            continue
        known = sorted(k for k in node if not k.startswith("_"))
        close = difflib.get_close_matches(leaf, known, n=1)
        meant = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
        where = f"{parent} has no key {leaf!r}" if parent else f"{leaf!r} is not a config key"
        raise ConfigError(f"{arg} is not allowed: {where}, and vlmprobe would never read it{meant} (keys there: "
                          f"{', '.join(known)})")


def resolved(cfg, point: str | None = None) -> dict:
    """`cfg` as plain data with every interpolation resolved (Hydra's own node dropped); an interpolation that does
    not resolve (${oc.env:UNSET}, a key that is not there) is one line naming its key (and the point it is in)."""
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # omegaconf's InterpolationResolutionError and kin; full_key names the config key
        key = getattr(exc, "full_key", None) or "the config"
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        where = f"{key}={raw}" if isinstance(raw, str) else key
        in_point = f" in point {point}" if point else ""
        raise ConfigError(f"{where} is not allowed{in_point}: it does not resolve ({first_line(exc)})") from None
    data.pop("hydra", None)
    return data


def with_hub_ids(args: list[str]) -> list[str]:
    """`model=ORG/NAME` (a Hugging Face Hub id) as the command means it: the shipped config of that model where
    vlmprobe has one (vlmprobe.hub), else `model=hf model.config=ORG/NAME`, its config.json from the
    local Hugging Face cache (vlmprobe.models.hf: refused in one line, saying how to get it, where it is not there)."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if key == "model" and sep and HUB_NAME.match(value) and value not in group_options(args, "model"):
            option = shipped_option(value)
            out += [f"model={option}"] if option else ["model=hf", f"model.config={value}"]
        else:
            out.append(arg)
    return out


SEARCHPATH = "hydra.searchpath"


def with_config_dirs(args: list[str]) -> list[str]:
    """`--config-dir DIR` (Hydra's flag, any number of times): the person's own configs (DIR/model/*.yaml,
    DIR/sweep/*.yaml, ...) beside vlmprobe's, as one hydra.searchpath override; a folder that does not exist is
    refused in one line."""
    dirs, rest, i = [], [], 0
    while i < len(args):
        if args[i] in ("--config-dir", "-cd"):
            if i + 1 == len(args):
                raise ConfigError(f"{args[i]} is not allowed without a folder: write {args[i]} PATH")
            folder = Path(args[i + 1]).expanduser().resolve()
            if not folder.is_dir():
                raise ConfigError(f"--config-dir {args[i + 1]} is not allowed: no such folder (give a folder holding "
                                  f"config groups, e.g. PATH/model/my_model.yaml)")
            dirs.append(folder)
            i += 2
        else:
            rest.append(args[i])
            i += 1
    return ([f"{SEARCHPATH}=[{','.join(f'file://{d}' for d in dirs)}]"] if dirs else []) + rest


def config_dirs(args: list[str]) -> list[Path]:
    """vlmprobe's conf/ and the folders a hydra.searchpath override adds (with_config_dirs)."""
    extra = [a.split("=", 1)[1].strip("[]") for a in args if a.startswith(f"{SEARCHPATH}=")]
    return [CONF, *(Path(p.removeprefix("file://")) for value in extra for p in value.split(",") if p)]


def group_options(args: list[str], group: str) -> list[str]:
    """The options of a config group across the config folders."""
    return sorted({p.stem for d in config_dirs(args) for p in (d / group).glob("*.yaml")})


def check_group_choices(args: list[str]) -> None:
    """Name an unknown group option (model=..., +sweep=...) and the allowed ones, before Hydra's longer error."""
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~")
        if not sep or "." in group or not (CONF / group).is_dir():
            continue
        options = group_options(args, group)
        if value not in options:
            raise ConfigError(f"{group}={value!r} is not allowed: use one of {', '.join(options)}")
        if group == "sweep" and not key.startswith("+"):
            raise ConfigError(f"{arg} is not allowed: a sweep is added to the config, write +sweep={value}")


def check_syntax(args: list[str]) -> None:
    """Each argument is an override Hydra can parse, and removes nothing vlmprobe reads."""
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-"):
            raise ConfigError(f"{arg} is not allowed: vlmprobe takes only overrides (key=value, +key=value for a "
                              f"new key or axis); see README.md")
        try:
            parser.parse_overrides([arg])
        except Exception as exc:  # Hydra's grammar errors: say which argument
            raise ConfigError(f"{arg} is not allowed: Hydra cannot parse it ({first_line(exc)}); "
                              f"write key=value, quoting lists: 'key=[1,2]'") from None
        if arg.startswith("~") and not arg[1:].split("=")[0].startswith(REMOVABLE):
            raise ConfigError(f"{arg} is not allowed: vlmprobe reads every config key; set a value instead "
                              f"(only sweep axes and cases can be removed)")


def compose_checked(compose, overrides: list[str]):
    """compose(overrides), or a ConfigError naming the override Hydra refused and what to write instead."""
    try:
        return compose(overrides)
    except Exception as exc:
        error = exc
    # The first override whose addition makes composition fail is the one to name.
    for i, arg in enumerate(overrides):
        try:
            compose(overrides[: i + 1])
        except Exception as exc:
            raise explain(compose, overrides[:i], arg, exc) from None
    raise ConfigError(f"{' '.join(overrides)} is not allowed: Hydra refuses it: {first_line(error)}")


def explain(compose, before: list[str], arg: str, exc: Exception) -> ConfigError:
    """One line for Hydra's refusal of `arg` (composed after `before`)."""
    message = str(exc)
    missing = _NOT_THERE.search(message)
    if missing:
        key = _added_key(compose, before, arg, missing.group(1)) or missing.group(1)
        if key.startswith("sweep.axes."):
            return ConfigError(f"{arg} is not allowed: {key[len('sweep.axes.'):]} is not an axis of this sweep; "
                               f"add it as a new axis with +{arg}")
        parent, _, leaf = key.rpartition(".")
        node = _node(compose, before, parent)
        if not isinstance(node, dict):
            return ConfigError(f"{arg} is not allowed: {parent or 'the config'} has no key {leaf!r}")
        keys = ", ".join(sorted(k for k in node if k != "_target_" and not k.startswith("_")))
        where = f"{parent} has no key {leaf!r}" if parent else f"{leaf!r} is not a config key"
        target = node.get("_target_")
        hint = f"; to pass it to {target}, add it: +{arg}" if target else ""
        return ConfigError(f"{arg} is not allowed: {where} (keys there: {keys}){hint}")
    already = _ALREADY.search(message)
    if already:
        return ConfigError(f"{arg} is not allowed: {already.group(1)} is already a config key; set it without "
                           f"the +: {arg.lstrip('+')}")
    return ConfigError(f"{arg} is not allowed: Hydra refuses it: {first_line(exc)}")


def _added_key(compose, before: list[str], arg: str, key: str) -> str | None:
    """Where `arg` sets `key` to a dict (key={a:1}): the first dotted key that the dict adds below `key`, the one
    Hydra refused (it names `key` itself, which is there); None for any other value."""
    value = OverridesParser.create().parse_overrides([arg])[0].value()

    def first_added(value, node, prefix: str) -> str | None:
        if not isinstance(value, dict) or not isinstance(node, dict):
            return None
        for k, v in value.items():
            found = f"{prefix}.{k}" if k not in node else first_added(v, node[k], f"{prefix}.{k}")
            if found:
                return found
        return None

    return first_added(value, _node(compose, before, key), key)


def _node(compose, before: list[str], dotted: str):
    """The plain-data node at `dotted` of the config composed from `before` (None where there is none)."""
    try:
        node = OmegaConf.to_container(compose(before), resolve=False)
    except Exception:
        return None
    for part in filter(None, dotted.split(".")):
        node = node.get(part) if isinstance(node, dict) else None
    return node
