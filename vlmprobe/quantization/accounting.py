"""Hand counts and one-layer measurements for QLoRA's checks (tests/test_quantization.py,
scripts/check_qlora.py): what bitsandbytes 0.50.2 keeps per quantized layer, from its code's formulas
(functional.quantize_4bit, Int8Params._quantize), and a layer's bytes through a forward and a backward on a
backend's meter."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["block", "kept_bytes", "layer_bytes"]

BLOCK = 512  # the caching allocator's block size: every tensor takes a multiple of it


def block(nbytes: int) -> int:
    return -(nbytes // -BLOCK) * BLOCK


def kept_bytes(out_features: int, in_features: int, kind: str, double_quant: bool = True) -> int:
    """Device bytes bitsandbytes keeps for a quantized [out, in] weight (its bias not included).
    nf4: the packed codes (two a byte), the 16-value fp32 code table, the absmax per 64 values -- fp32, or with
    double quantization uint8 plus the nested state: an fp32 absmax per 256 blocks, the 256-value fp32 dynamic
    code and the fp32 offset. int8: the int8 weight and an fp32 scale per row."""
    n = out_features * in_features
    if kind == "int8":
        return block(n) + block(4 * out_features)
    blocks = math.ceil(n / 64)
    absmax = block(blocks) + block(4 * math.ceil(blocks / 256)) + block(1024) + block(4) if double_quant else block(4 * blocks)
    return block((n + 1) // 2) + block(4 * 16) + absmax


def layer_bytes(backend, train: dict, replace, shape: tuple[int, int], rows: int) -> dict:
    """On `backend` (a vlmprobe backend): the bytes a bf16 Linear(in, out) with bias becomes when `replace`d, the
    peak above the loaded layer while it is quantized, and the peaks above the start of a forward over `rows` rows
    (two samples) and of its backward."""
    out_features, in_features = shape
    with backend.session(None) as meter:
        linear = nn.Linear(in_features, out_features, dtype=torch.bfloat16)
        start = meter.current()
        meter.reset_peak()
        maps: dict = {}  # the device maps made once a process: not the layer's
        layer = replace(linear, train, maps).train()
        quantizing = meter.peaks()["allocated"] - start
        del linear, maps
        kept = meter.current() - start
        x = torch.zeros(2, rows // 2, in_features, dtype=torch.bfloat16, requires_grad=True)
        meter.reset_peak()
        before = meter.current()
        y = layer(x)
        forward = meter.peaks()["allocated"] - before
        meter.reset_peak()
        before = meter.current()
        y.sum().backward()
        backward = meter.peaks()["allocated"] - before
    return {"kept": kept, "quantizing": quantizing, "forward": forward, "backward": backward}
