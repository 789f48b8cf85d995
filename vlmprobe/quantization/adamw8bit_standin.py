"""optimizer=adamw_8bit on the estimate: bitsandbytes' AdamW8bit as it allocates on CUDA, without bitsandbytes.

Read from bitsandbytes 0.50 (optim/optimizer.py Optimizer2State.init_state, optim/adamw.py AdamW8bit): on its first
step, parameter by parameter in order, a tensor of fewer than min_8bit_size (4096) elements gets both moments in
float32; a larger one gets both in uint8 (zeros_like) and one float32 absolute maximum per block of 256 elements
for each, and the first such tensor moves the signed and unsigned quantization maps (256 float32 each, made on the
host) to the device, shared by every parameter's state. The update is bitsandbytes' fused CUDA kernel, in place:
it allocates nothing. Paged states (PagedAdamW8bit, is_paged) live outside the caching allocator: not modelled.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "MAP_ENTRIES", "TARGETS", "AdamW8bit"]

BLOCK = 256  # elements per absolute maximum (bitsandbytes 0.50's blockwise 8-bit states)
MAP_ENTRIES = 256  # float32 values of each quantization map (create_dynamic_map)
TARGETS = {"bitsandbytes.optim.AdamW8bit": f"{__name__}.AdamW8bit"}  # what the estimate runs in their place


class AdamW8bit(torch.optim.Optimizer):
    """bitsandbytes.optim.AdamW8bit's arguments and checks, and its state's allocations."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        if amsgrad:
            raise ValueError("AdamW8bit does not support amsgrad=True")
        if optim_bits != 32:
            raise ValueError("AdamW8bit only supports optim_bits=32 (default value for compatibility)")
        if is_paged:
            raise ValueError("paged 8-bit states live outside the caching allocator; the estimate does not model them")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.min_8bit_size = min_8bit_size
        self.maps: tuple[torch.Tensor, torch.Tensor] | None = None  # on the device from the first 8-bit state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self.init_state(p, state)
                state["step"] += 1  # the fused kernel updates p and the states in place: nothing allocated
        return loss

    def init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        if self.maps is None:
            self.maps = tuple(torch.empty(MAP_ENTRIES, dtype=torch.float32, device=p.device) for _ in range(2))
        blocks = -(-p.numel() // BLOCK)
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap1"] = self.maps[0]
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap2"] = self.maps[1]
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

