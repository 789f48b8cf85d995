"""QLoRA's base loaded as from_pretrained loads it under a BitsAndBytesConfig (transformers 5.25): the 16-bit model
is never whole on the device.

from_pretrained makes the model on the meta device, puts bitsandbytes layers in place of the linear layers
(replace_with_bnb_linear), then loads the checkpoint one tensor at a time, in the order of its sorted names
(core_model_loading.convert_and_load_state_dict_in_model, dot_natural_key; no thread pool when it quantizes on the
fly): each tensor is made on the device in its dtype, and a quantized layer's weight is quantized there and the
16-bit tensor freed before the next one loads. Buffers no checkpoint holds follow
(_move_missing_keys_from_meta_to_device), then the tied weights are tied. So the load peaks at the quantized model
plus one 16-bit weight and its quantization's buffers, and the allocator keeps those freed blocks cached.
Limits: the order is that of the model's own names (a checkpoint saved under older names sorts a little
differently, which moves where blocks land, not what they hold); the host side of the load is not charged.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["load"]


def load(model: nn.Module, device: torch.device, quantized: list[str], quantize) -> nn.Module:
    """`model` as ModelSpec.build_empty made it, loaded on `device` as from_pretrained loads a checkpoint of it
    (module doc), random weights in their own dtype; each layer named in `quantized` replaced by `quantize(linear,
    maps)` once its weight is loaded."""
    # transformers' own sort key of checkpoint names; imported here, as vlmprobe.quantization is imported by every
    # point and a nanoVLM point never imports transformers' modeling code (tests/test_nanovlm.py)
    from transformers.core_model_loading import dot_natural_key

    layers = set(quantized)
    maps: dict = {}  # the device maps bitsandbytes makes once a process (the stand-in's; real bitsandbytes keeps its own)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})  # tied copies: not in a checkpoint
    entries = sorted(model.state_dict(keep_vars=True).items(), key=lambda item: dot_natural_key(item[0]))
    for key, empty in entries:
        if key in tied:
            continue
        owner_name, _, attr = key.rpartition(".")
        owner = model.get_submodule(owner_name)
        if owner_name in layers and attr == "weight":  # Bnb4bitQuantize / Bnb8bitQuantize
            owner.weight = nn.Parameter(loaded(empty, device), requires_grad=False)
            model.set_submodule(owner_name, quantize(owner, maps))  # the 16-bit tensor goes with `owner`
        else:
            place(owner, attr, loaded(empty, device))
        del owner
    persistent = {key for key, _ in entries}
    for key, buffer in list(model.named_buffers()):
        if key not in persistent:  # made by construction, as transformers' init remakes them on the device
            owner_name, _, attr = key.rpartition(".")
            place(model.get_submodule(owner_name), attr, loaded(buffer, device))
    model.tie_weights()
    if "dynamic" in maps:
        model.bnb_dynamic_map = maps["dynamic"]  # held by bitsandbytes for the process; here for the point
    return model


def loaded(empty: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One checkpoint tensor made on the device in its dtype: a parameter with random values (the build's fill),
    a buffer with the values construction gave it (copied where the tensors are real)."""
    tensor = torch.empty(empty.shape, dtype=empty.dtype, device=device)
    if isinstance(empty, nn.Parameter):
        if tensor.is_floating_point():
            with torch.no_grad():
                tensor.normal_(0.0, 0.02)
    elif not isinstance(tensor, torch._subclasses.FakeTensor):
        tensor.copy_(empty)
    return tensor


def place(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in `module` where its meta parameter or host buffer was (set_param_for_module)."""
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=module._parameters[name].requires_grad)
    else:
        module._buffers[name] = tensor
