"""Where vlmprobe's own files are: the checkout it runs from and its Hydra configs: conf/ beside the package in a
checkout (an editable install), vlmprobe/conf inside it in an installed wheel (setup.py copies it there)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONF", "REPO"]

REPO = Path(__file__).resolve().parent.parent  # the checkout (an editable install runs from it)
PACKAGED = Path(__file__).resolve().parent / "conf"  # where a wheel has conf/
CONF = PACKAGED if PACKAGED.is_dir() else REPO / "conf"  # the Hydra config tree: one folder per config group
