"""env.json: what the figures of a results dir were taken on, and with what."""

from __future__ import annotations

import datetime
import json
import platform
import socket
import subprocess
import sys
from pathlib import Path

from vlmprobe.paths import REPO
from vlmprobe.results.table import replacing

__all__ = ["environment", "write_env"]


def git_commit() -> str | None:
    """HEAD of the checkout vlmprobe runs from, with '-dirty' when it has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment(backend_info: dict, config: dict) -> dict:
    import importlib.metadata

    import torch

    return {
        **backend_info,
        "allocator_conf": config["measure"].get("alloc_conf"),
        "torch": torch.__version__,
        # the installed version, read without importing transformers (a sweep of our own models never does)
        "transformers": importlib.metadata.version("transformers"),
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "git_commit": git_commit(),
        "command": " ".join(["python -m vlmprobe", *sys.argv[1:]]),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_env(path: Path, info: dict) -> None:
    with replacing(path) as partial:
        partial.write_text(json.dumps(info, indent=2, default=str) + "\n")
