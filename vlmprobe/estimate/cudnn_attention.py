"""What cuDNN attention allocates beside what flash attention keeps, on a card that runs it first (Hopper's sm90).

torch tries cuDNN's SDPA first on sm90 (conf/device/h200.yaml, `sdpa.default: cudnn`) for fp16/bf16 inputs whose head
dims it takes (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, check_cudnn_tensor_shapes: multiples of 8, at
most 256 on sm90 with cuDNN 9.10 or later, 128 elsewhere; a key/value length above 1). It keeps what flash keeps for
backward (output and softmax statistics, which the estimate's fused kernel keeps too), and besides:
- forward: a random seed and offset, one int64 each on the device, made before the output
  (_scaled_dot_product_cudnn_attention_cuda) and saved for backward; and the cuDNN graph's workspace, allocated
  through the caching allocator after the output and freed as the op returns (MHA.cpp, run_cudnn_SDP_fprop);
- backward: the backward graph's workspace, after dQ, dK and dV, freed as the op returns. The cuDNN frontend
  accumulates dQ in fp32 there (SDPABackwardNode's dQ_accum: batch x query heads x query length x head dim x 4 B,
  the default from cuDNN 9); the engine's own part was one fp32 a query row and 256 B more.

The sizes of the two engine parts are the recorded run's, not derived from a source: the H200 run of nanoVLM-222M
(torch 2.11, cuDNN 9.19; results/gpu_check/nvidia-h200/20261128-163858/allocator_requests.csv) asked for 256 B each
forward and 4 x batch x heads x length x (head dim + 1) + 256 B each backward, for the LM (9 heads, 512 tokens) and the
ViT (12 heads, 196 patches) at batch 1 and 8 alike. Other cuDNN versions may ask for other sizes; grouped KV heads
(fewer key heads than query heads) were not in that run, and newer frontends add full-head dK/dV buffers for them
there, not counted here.
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
FORWARD_WORKSPACE = 256  # bytes the forward graph asked for in the recorded run
ENGINE_EXTRA = 256  # bytes the backward engine asked for beyond one fp32 a query row, in the recorded run


def runs(device, dtype: torch.dtype, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         dropout_p: float) -> bool:
    """torch runs cuDNN attention for this call on `device` (a DeviceProfile, or None: no card, no cuDNN first)."""
    if device is None or device.sdpa["default"] != "cudnn" or dtype not in LOW_PRECISION:
        return False
    head_dim_limit = 256 if device.compute_capability == (9, 0) else 128
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_qk > head_dim_limit or d_v > head_dim_limit or d_qk % 8 or d_v % 8:
        return False
    return key.shape[-2] != 1 and not (query.shape[-2] == 1 and dropout_p)


def backward_workspace(query: torch.Tensor) -> int:
    """Bytes of the backward graph's workspace for a (batch, heads, length, head dim) query."""
    batch, heads, length, head_dim = query.shape
    rows = batch * heads * length
    return 4 * rows * head_dim + 4 * rows + ENGINE_EXTRA  # dQ in fp32, then the engine's part


def call(attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """`attention(query, key, value, **kwargs)` (a fused kernel keeping what cuDNN keeps), with cuDNN's own
    allocations around it: the seed and offset before, the forward workspace after, and a hook on the backward node
    that makes the backward workspace once dQ, dK and dV exist, then lets the seed and offset go with the node's
    saved tensors. `query`, `key` and `value` are the kernel's inputs, already in its dtype."""
    device = query.device
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    offset = torch.zeros(1, dtype=torch.int64, device=device)
    out = attention(query, key, value, **kwargs)
    torch.empty(FORWARD_WORKSPACE, dtype=torch.uint8, device=device)  # made after the output, dropped at once
    node = out.grad_fn
    if node is None:
        return out  # no backward: the seed and offset die with the call
    saved = [seed, offset]
    size = backward_workspace(query)

    def after_backward(grad_inputs, grad_outputs):
        torch.empty(size, dtype=torch.uint8, device=device)  # made after dQ, dK and dV, dropped at once
        # then the seed and offset: CUDA frees them with the node's other saved tensors, just after these here (the
        # order differs among 512 B blocks only)
        saved.clear()

    node.register_hook(after_backward)
    return out

