"""The real bitsandbytes layers (backends cuda and cpu), built as transformers' replace_with_bnb_linear builds
them (integrations/bitsandbytes.py) and quantized from the random weight where it lies, as loading a checkpoint
quantizes each weight (Params4bit._quantize / Int8Params._quantize on `.to(device)`).

transformers' own replace_with_bnb_linear makes meta modules that its weight loader fills from a checkpoint;
a model built from its config with random weights has no checkpoint, so each layer is made here with the same
arguments and the weight it already has.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["replace"]

THRESHOLD = 6.0  # BitsAndBytesConfig.llm_int8_threshold default


def replace(linear: nn.Linear, train: dict) -> nn.Module:
    import bitsandbytes as bnb

    weight, device = linear.weight.data, linear.weight.device
    if train["quantization"] == "int8":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, linear.bias is not None,
                                    has_fp16_weights=False, threshold=THRESHOLD, device="meta")
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)._quantize(device)
    else:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, linear.bias is not None,
                                  compute_dtype=getattr(torch, train["quantization_compute_dtype"]),
                                  compress_statistics=train["quantization_double_quant"], quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=train["quantization_double_quant"],
                                         quant_type="nf4", quant_storage=torch.uint8, module=layer)._quantize(device)
    if linear.bias is not None:
        layer.bias = linear.bias
    layer.requires_grad_(False)  # replace_with_bnb_linear: new_module.requires_grad_(False)
    return layer
