"""Backends: where a point's training step runs and how its memory is read.

| name     | runs on                  | memory figures                                   | isolation          |
|----------|--------------------------|--------------------------------------------------|--------------------|
| cuda     | the GPU, real tensors    | torch.cuda allocator stats + NVML (measurements) | fresh process/point |
| cpu      | the CPU, real tensors    | live-bytes tracker, CUDA's choices (a proxy)    | in-process          |
| estimate | fake CPU tensors         | live-bytes tracker, CUDA's choices (estimates)   | in-process          |

`auto` picks cuda when a GPU is visible and estimate otherwise.
"""

from __future__ import annotations

import importlib

from vlmprobe.backends.base import Backend
from vlmprobe.errors import ConfigError

NAMES = ("auto", "cuda", "cpu", "estimate")
_MODULES = {"cuda": "vlmprobe.backends.cuda", "cpu": "vlmprobe.backends.cpu", "estimate": "vlmprobe.backends.estimate"}


def gpu_available() -> bool:
    from vlmprobe.backends.cuda import available

    return available()


def resolve(name: str) -> tuple[str, str | None]:
    """(backend to use, a line to tell the user or None). Raises ConfigError for a name not allowed."""
    if name not in NAMES:
        raise ConfigError(f"measure.backend={name!r} is not allowed: use one of {', '.join(NAMES)}")
    if name == "auto":
        if gpu_available():
            return "cuda", None
        return "estimate", "No CUDA GPU found: estimating with the 'estimate' backend (fake tensors, no GPU)."
    if name == "cuda" and not gpu_available():
        raise ConfigError("measure.backend=cuda is not allowed here: no CUDA GPU is visible (use auto, cpu or estimate)")
    return name, None


def get(name: str) -> Backend:
    """The backend instance for a resolved name (cuda, cpu or estimate)."""
    return importlib.import_module(_MODULES[name]).BACKEND
