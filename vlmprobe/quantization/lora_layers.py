"""peft's LoRA layers for the stand-ins: peft wraps a real bitsandbytes layer in its own lora.bnb.Linear4bit /
Linear8bitLt (peft 0.21 tuners/lora/bnb.py), whose forward differs from the plain lora.Linear in what it
allocates: the 4-bit one clones the base output ("defensively", per its comment), and both cast the adapter's
output back to the base output's dtype before the add when autocast is off (lora.Linear adds first and casts
the sum). Those classes exist only where bitsandbytes is installed, so the stand-ins get this copy of their
forward (the vanilla-LoRA branch; no merging, mixed batches or variants: vlmprobe uses none)."""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear

from vlmprobe.quantization import bnb_standin

__all__ = ["STANDIN_LORA"]


class LoraLinear8bitLt(Linear):
    clone_result = False  # peft's Linear8bitLt.forward does not clone

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return result
        if self.clone_result:
            result = result.clone()
        for active_adapter in self.active_adapters:
            if active_adapter not in self.lora_A.keys():
                continue
            lora_A, lora_B = self.lora_A[active_adapter], self.lora_B[active_adapter]
            requires_conversion = not torch.is_autocast_enabled()
            if requires_conversion:
                expected_dtype = result.dtype
                x = self._cast_input_dtype(x, lora_A.weight.dtype)
            output = lora_B(lora_A(self.lora_dropout[active_adapter](x))) * self.scaling[active_adapter]
            if requires_conversion:
                output = output.to(expected_dtype)
            result = result + output
        return result


class LoraLinear4bit(LoraLinear8bitLt):
    clone_result = True  # peft's Linear4bit.forward: result = result.clone()


STANDIN_LORA = {bnb_standin.Linear4bit: LoraLinear4bit, bnb_standin.Linear8bitLt: LoraLinear8bitLt}
