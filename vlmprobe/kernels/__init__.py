"""Fused training kernels that frameworks switch on for a model, modelled where their own code cannot run here.

liger.py: train.liger_kernel, Liger-Kernel's kernels patched into the built model as the Trainer's
`use_liger_kernel` patches it; liger_ops.py: autograd Functions that allocate and save what Liger's Triton kernels
allocate and save, in plain torch ops (every backend). The rules and their limits: docs/kernels.md.
"""

__all__: list[str] = []
