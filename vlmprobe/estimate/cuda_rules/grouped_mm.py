"""CUDA's grouped matrix multiply (`torch._grouped_mm`: a mixture-of-experts layer's experts) for fake tensors.

transformers runs MoE experts (`experts_implementation="grouped_mm"`) through aten `_grouped_mm`, whose meta kernel
differs from CUDA's `_grouped_mm_cuda` (GroupedBlas.cpp, GroupedMMUtils.h) in what the estimate allocates: it takes
bf16 only, where CUDA also runs fp32 and fp16 (a loop of `mm_out`: fp32 experts under bf16 autocast run in fp32), and
it pads the output's last stride to 16 bytes only where torch was built with CUDA. While `cuda_grouped_mm()` is
active the meta kernel is CUDA's rules: its input checks, the output dtype (`mat_a`'s) and the padded layout. Not
counted: the fast path's transient buffers and the fallback's host copy of the offsets. The cpu backend runs torch's
CPU kernel, unpadded: estimate and cpu agree where the widths are aligned. The details: docs/estimate.md.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.library import Library

__all__ = ["cuda_grouped_mm"]

TMA_ALIGNMENT = 16  # bytes: the output's strides but the last are multiples (create_grouped_gemm_output_tensor)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # _grouped_mm_validate_inputs


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """check_valid_strides_and_return_transposed: one of the last two dimensions contiguous, the other's stride a
    multiple of 16 bytes."""
    strides, sizes = mat.stride(), mat.shape
    alignment = TMA_ALIGNMENT // mat.element_size()
    if strides[-2] == 1 and strides[-1] >= max(1, sizes[-2]):
        aligned = strides[-1] % alignment == 0
    elif strides[-1] == 1 and strides[-2] >= max(1, sizes[-1]):
        aligned = strides[-2] % alignment == 0
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes")
    if not aligned:
        raise RuntimeError(f"{name}: strides should be multiple of 16 bytes")


def output_layout(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(sizes, strides) of CUDA's output (create_grouped_gemm_output_tensor, CUDA build): the last dimension's
    stride padded to a multiple of 16 bytes of `mat_a`'s dtype."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_2d and b_2d:
        sizes = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a_2d:
        sizes = [mat_a.shape[0], mat_b.shape[-1]]
    elif b_2d:
        sizes = [mat_a.shape[1], mat_b.shape[1]]
    else:
        sizes = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    alignment = TMA_ALIGNMENT // mat_a.element_size()
    padded = -(-sizes[-1] // alignment) * alignment
    strides = [padded, 1] if a_2d != b_2d else [sizes[1] * padded, padded, 1]
    return sizes, strides


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """CUDA's _grouped_mm_cuda on meta tensors: its checks, and an empty output of its dtype and layout."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
        if mat.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    if mat_a.dtype != mat_b.dtype:  # the fast path takes bf16 x bf16; the fallback's mm_out one dtype
        raise RuntimeError(f"expected mat_a and mat_b to have the same dtype, but got: {mat_a.dtype} != {mat_b.dtype}")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a_2d and b_2d) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    if (offs is not None) != (a_2d or b_2d):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise RuntimeError("offs has to be 1D" if offs.dim() != 1 else "Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if (out_dtype or mat_a.dtype) != mat_a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a_2d and not b_2d and offs.shape[0] != mat_b.shape[0] or not a_2d and b_2d and offs.shape[0] != mat_a.shape[0]:
        raise RuntimeError("matrix batch sizes have to match")
    if not (a_2d or b_2d) and mat_a.shape[0] != mat_b.shape[0]:
        raise RuntimeError("batched dimension has to match")
    sizes, strides = output_layout(mat_a, mat_b, offs)
    return torch.empty_strided(sizes, strides, dtype=mat_a.dtype, device=mat_a.device)


@contextlib.contextmanager
def cuda_grouped_mm():
    """While active, fake tensors' `_grouped_mm` is CUDA's (see the module's docstring); torch's meta kernel
    is back on exit."""
    lib = Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": torch's own meta kernel, back when lib is destroyed
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            # allow_override: torch 2.11 registers that meta kernel from Python (_meta_registrations), and until
            # torch 2.13 (pytorch#182293) Library.impl refused to override a Python kernel unless asked to: every
            # estimate on the GPU image (torch 2.11) failed here, MoE or not
            lib.impl("_grouped_mm", _grouped_mm_meta, "Meta", allow_override=True)
        yield
    finally:
        lib._destroy()
