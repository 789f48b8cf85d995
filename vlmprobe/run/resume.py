"""Resuming a sweep (resume=DIR): the folder must hold the same sweep, so that its rows and the new ones belong to
one table; and the line an interrupted command leaves, naming the rows kept and the command that resumes them."""

from __future__ import annotations

import copy
import shlex
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from vlmprobe.errors import ConfigError
from vlmprobe.results.table import read_table

__all__ = ["NOT_DECIDING", "check_resume", "deciding", "differences", "interrupted_line"]

# Keys that do not decide the rows: a resumed dir may be given them differently.
NOT_DECIDING = ("results_dir", "resume", "dry_run", "sweep.max_points", "launcher")


def deciding(config: dict) -> dict:
    """The config without the keys that do not decide the rows (NOT_DECIDING, dotted)."""
    config = copy.deepcopy(config)
    for dotted in NOT_DECIDING:
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return config


def differences(before, now, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs."""
    if isinstance(before, dict) and isinstance(now, dict):
        return [d for k in sorted(set(before) | set(now), key=str)
                for d in differences(before.get(k), now.get(k), f"{prefix}{k}.")]
    return [] if before == now else [prefix.rstrip(".")]


def check_resume(out_dir: Path, base: dict) -> None:
    """A resumed dir must hold the same sweep; only what decides the rows is compared (not where they are
    written)."""
    saved = out_dir / "config.yaml"
    if not saved.exists():
        raise ConfigError(f"resume={out_dir} is not allowed: it has no config.yaml (not a vlmprobe results dir)")
    try:
        before = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    except Exception as exc:
        raise ConfigError(f"resume={out_dir} is not allowed: its config.yaml cannot be read ({exc})") from None
    changed = differences(deciding(before), deciding(base))
    if changed:
        raise ConfigError(f"resume={out_dir} is not allowed: it was run with a different config "
                          f"(differs in: {', '.join(changed)}); run the same command with resume=DIR")


def interrupted_line(argv: list[str], out_dir: Path | None) -> str:
    """What an interrupted command leaves, and the command that continues it."""
    if out_dir is not None and {p.name for p in out_dir.iterdir()} <= {"config.yaml.partial"}:
        # made a moment ago, before its config was whole: nothing in it to resume
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir = None
    if out_dir is None:  # a resumed command interrupted at start-up, before it read its dir: its rows are there
        given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "resume" and "=" in a]
        if given and (Path(given[-1]) / "config.yaml").is_file():
            out_dir = Path(given[-1])
    if out_dir is None:
        return "vlmprobe: interrupted before any point ran; nothing was written"
    csv = out_dir / "results.csv"
    try:
        rows = len(read_table(csv)) if csv.exists() else 0
    except Exception:  # a CSV cut mid-header: no row is kept
        rows = 0
    again = [a for a in argv if a.split("=", 1)[0].lstrip("+") != "resume"]
    command = shlex.join(["python", "-m", "vlmprobe", *again, f"resume={out_dir}"])
    return f"vlmprobe: interrupted: {rows} rows kept in {csv}; resume with: {command}"
