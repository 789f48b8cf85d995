"""The optimizer as CUDA would make it, and its state tensors.

torch picks foreach kernels by default only for CUDA tensors, so every backend (CPU tensors, fake or real) is
given the implementation CUDA would pick: the figures follow the kernels a GPU run executes.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["make_optimizer", "state_tensors"]


def make_optimizer(partial, params) -> tuple[torch.optim.Optimizer, str]:
    """Instantiate the optimizer with the implementation CUDA would pick, and a label for the row.

    torch picks foreach kernels by default only for CUDA tensors; to make every backend run what CUDA runs,
    an optimizer that takes `foreach` and is given neither `foreach` nor `fused` gets foreach=True.
    """
    accepted = inspect.signature(partial.func).parameters
    chosen = {k: partial.keywords.get(k) for k in ("foreach", "fused") if k in accepted}
    if "foreach" in chosen and all(v is None for v in chosen.values()):
        partial.keywords["foreach"] = True
        chosen["foreach"] = True
    impl = next((k for k, v in chosen.items() if v), "single_tensor" if chosen else "")  # foreach=False: one at a time
    name = partial.func.__name__
    return partial(params), f"{name}({impl})" if impl else name


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Optimizer state tensors (not AdamW's scalar `step` counters, which CUDA keeps on the CPU); which of them
    are on the device is the engine's to say (Engine.on_device)."""
    return [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
