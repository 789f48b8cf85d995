"""The real bitsandbytes layers (backends cuda and cpu), made as transformers 5.25 makes them under a
BitsAndBytesConfig: the layer as replace_with_bnb_linear makes it (integrations/bitsandbytes.py), its weight
quantized from the tensor just loaded as Bnb4bitQuantize / Bnb8bitQuantize do (Params4bit(...).to(device);
Int8Params of a host copy, .to(device)). The loading order is vlmprobe.quantization.loading's.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["replace"]

THRESHOLD = 6.0  # BitsAndBytesConfig.llm_int8_threshold default


def replace(linear: nn.Linear, train: dict, maps: dict) -> nn.Module:
    """The bitsandbytes layer in `linear`'s place, quantized from its weight (`maps`: unused, bitsandbytes keeps
    its own device maps)."""
    import bitsandbytes as bnb

    weight, device = linear.weight.data, linear.weight.device
    if train["quantization"] == "int8":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, linear.bias is not None,
                                    has_fp16_weights=False, threshold=THRESHOLD, device="meta")
        layer.weight = bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, has_fp16_weights=False).to(device)
    else:
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, linear.bias is not None,
                                  compute_dtype=getattr(torch, train["quantization_compute_dtype"]),
                                  compress_statistics=train["quantization_double_quant"], quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=train["quantization_double_quant"],
                                         quant_type="nf4", quant_storage=torch.uint8, module=layer).to(device)
    if linear.bias is not None:
        layer.bias = linear.bias
    layer.requires_grad_(False)  # replace_with_bnb_linear: new_module.requires_grad_(False)
    return layer
