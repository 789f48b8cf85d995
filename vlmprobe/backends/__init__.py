"""Backends: where a point's training step runs and how its memory is read.

| name     | runs on                  | memory figures                                   | isolation          |
|----------|--------------------------|--------------------------------------------------|--------------------|
| cuda     | the GPU, real tensors    | torch.cuda allocator stats + NVML (measurements) | fresh process/point |
| cpu      | the CPU, real tensors    | live-bytes tracker, CUDA's choices (a proxy)    | in-process          |
| estimate | fake CPU tensors         | live-bytes tracker, CUDA's choices (estimates)   | in-process          |

`auto` picks cuda when a GPU is visible and estimate otherwise.
"""

from __future__ import annotations

from vlmprobe.backends import cuda, estimate
from vlmprobe.backends.base import Backend
from vlmprobe.errors import ConfigError

__all__ = ["NAMES", "get", "resolve"]

NAMES = ("auto", "cuda", "cpu", "estimate")
BACKENDS = {"cuda": cuda.BACKEND, "cpu": estimate.CPU, "estimate": estimate.ESTIMATE}


def resolve(name: str) -> tuple[str, str | None]:
    """(backend to use, a line to tell the user or None). Raises ConfigError for a name not allowed."""
    if name not in NAMES:
        raise ConfigError(f"measure.backend={name!r} is not allowed: use one of {', '.join(NAMES)}")
    if name not in ("auto", "cuda"):
        return name, None
    reason = cuda.unusable_reason()
    if name == "auto":
        if reason is None:
            return "cuda", None
        return "estimate", f"No CUDA GPU found: estimating with the 'estimate' backend (fake tensors, no GPU); {reason}."
    if reason is not None:
        raise ConfigError(f"measure.backend=cuda is not allowed here: {reason}; use auto, cpu or estimate")
    return name, None


def get(name: str) -> Backend:
    """The backend instance for a resolved name (cuda, cpu or estimate)."""
    return BACKENDS[name]
