"""Where vlmprobe's own files are: the checkout it runs from and its Hydra configs (conf/ beside the package)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONF", "REPO"]

REPO = Path(__file__).resolve().parent.parent  # the checkout (an editable install runs from it)
CONF = REPO / "conf"  # the Hydra config tree: one folder per config group
