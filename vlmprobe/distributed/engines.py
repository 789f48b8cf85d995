"""The one place that picks a point's engine from its `dist.name` (conf/dist/): none, ddp, fsdp2, zero1-3."""

from __future__ import annotations

import torch

from vlmprobe.distributed.base import Engine
from vlmprobe.distributed.deepspeed_engine import DeepSpeedEngine
from vlmprobe.distributed.torch_engines import DDPEngine, FSDP2Engine

__all__ = ["ENGINES", "make"]

ENGINES = {"none": Engine, "ddp": DDPEngine, "fsdp2": FSDP2Engine,
           "zero1": DeepSpeedEngine, "zero2": DeepSpeedEngine, "zero3": DeepSpeedEngine}


def make(point: dict, device: torch.device) -> Engine:
    """The engine of a point's `dist.name`, for its rank on `device`."""
    return ENGINES[point["dist"]["name"]](point, device)
