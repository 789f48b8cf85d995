"""What CUDA does that the CPU would not, applied to the estimate's step: autocast's op lists, the SDPA kernel a
card picks and its buffers, flash-attn's entry points, MoE's grouped matmul, and the buffers kernels make for
themselves (contiguous copies, reduction staging, the embedding backward's sort, in-place gradient sums)."""
