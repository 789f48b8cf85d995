"""The staging buffer CUDA's reduction kernel allocates when one reduction spans several thread blocks.

aten's CUDA reductions (aten/src/ATen/native/cuda/Reduce.cuh, gpu_reduce_kernel) pick a launch configuration from the
TensorIterator's shape and strides and the card's multiprocessors (`setReduceConfig`). Where each output has many
inputs and there are few outputs, every output's inputs are split across `ctas_per_output` thread blocks, and the
kernel allocates a staging buffer (`global_memory_size`) and semaphores (`semaphore_size`) after the op's output,
freed (semaphores first) when it returns; in a training step, the gradients of biases and norm weights. Modelled: sum
and mean of a floating tensor into its own dtype or, from fp16/bf16, into fp32 (`gpu_lowp_to_f32`), on a target card.
Not modelled: other reductions, a dtype change that makes CUDA cast the input first, iterators split for 32-bit
indexing, torch versions with a wider float-sum vector. The details, and the trace that checked them: docs/estimate.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Card", "iterator", "REDUCTIONS", "staging"]

aten = torch.ops.aten
_ALL_DIMS = (aten.sum.default, aten.mean.default)
_CONVOLUTION_BACKWARD = aten.convolution_backward.default
REDUCTIONS = frozenset((*_ALL_DIMS, aten.sum.dim_IntList, aten.mean.dim, _CONVOLUTION_BACKWARD))
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_THREADS = 512  # Reduce.cuh, mnt_wrapper<T>::MAX_NUM_THREADS (256 only for complex double, not modelled)
_WARP = 32
_MIN_VALUES_PER_THREAD, _MAX_VALUES_PER_THREAD = 16, 256  # setReduceConfig, CUDA (ROCm's minimum is 128)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Card:
    """What setReduceConfig reads of the card (torch.cuda.get_device_properties)."""
    multiprocessors: int  # multi_processor_count
    max_threads_per_multiprocessor: int


@dataclass
class Iterator:
    """A reduction's TensorIterator after reordering and coalescing: shape, and strides in bytes of the output
    (0 along reduced dimensions) and the input, dimension 0 the fastest."""
    shape: list[int]
    out_strides: list[int]
    in_strides: list[int]

    @property
    def num_reduce_dims(self) -> int:
        return sum(1 for s in self.out_strides if s == 0)

    @property
    def num_outputs(self) -> int:
        return math.prod(size for size, stride in zip(self.shape, self.out_strides) if stride != 0 or size == 0)


def iterator(shape: list[int], out_strides: list[int], in_strides: list[int]) -> Iterator:
    """TensorIterator's order and coalescing for a reduction (TensorIterator.cpp, reorder_dimensions and
    coalesce_dimensions): dimensions sorted fastest first with the reduced ones in front, then each pair merged
    where both operands step through them as one."""
    ndim = len(shape)
    strides = (out_strides, in_strides)

    def should_swap(dim0: int, dim1: int) -> int:
        for arg, stride in enumerate(strides):
            stride0, stride1 = stride[dim0], stride[dim1]
            if arg == 0 and (stride0 == 0) != (stride1 == 0):  # the output: reduced dimensions go first
                return 1 if stride1 == 0 else -1
            if stride0 == 0 or stride1 == 0:
                continue
            if stride0 != stride1:
                return -1 if stride0 < stride1 else 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    it = Iterator([shape[p] for p in perm], [out_strides[p] for p in perm], [in_strides[p] for p in perm])
    if ndim <= 1:
        return it
    operands = (it.out_strides, it.in_strides)
    prev = 0
    for dim in range(1, ndim):
        size0, size1 = it.shape[prev], it.shape[dim]
        if size0 == 1 or size1 == 1 or all(size0 * s[prev] == s[dim] for s in operands):
            if size0 == 1:
                for s in operands:
                    s[prev] = s[dim]
            it.shape[prev] *= size1
        else:
            prev += 1
            if prev != dim:
                for s in operands:
                    s[prev] = s[dim]
                it.shape[prev] = it.shape[dim]
    del it.shape[prev + 1:], it.out_strides[prev + 1:], it.in_strides[prev + 1:]
    return it


def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _output_vec_size(it: Iterator, itemsize: int, offset_elements: int) -> int:
    """get_output_vec_size: 4, halved until the input's address (in elements; blocks are 512-byte aligned, so its
    storage offset), the first output dimension's size and every other input stride divide it."""
    vec = 4
    first_output = it.num_reduce_dims
    values = [offset_elements, it.shape[first_output]]
    values += [s // itemsize for d, s in enumerate(it.in_strides) if d != first_output]
    for n in values:
        while n % vec:
            vec //= 2
    return vec


def staging_bytes(it: Iterator, itemsize: int, acc_size: int, offset_elements: int, card: Card) -> tuple[int, int]:
    """(buffer, semaphores) bytes gpu_reduce_kernel allocates for this iterator on this card, (0, 0) where the
    reduction stays within one block per output: setReduceConfig and ReduceConfig's global_memory_size and
    semaphore_size (Reduce.cuh), for `itemsize`-byte inputs accumulated in `acc_size`-byte values (arg_t)."""
    num_outputs = it.num_outputs
    if num_outputs == 0:
        return 0, 0
    num_inputs = math.prod(it.shape) // num_outputs  # inputs_per_output
    input_vec_size = 8 if itemsize == 2 else 4  # the 16-bit sum and mean kernels load 8 at a time, others vt0 = 4
    output_vec_size = 1
    ndim = len(it.shape)
    if ndim > 0:
        fastest_reduced = it.num_reduce_dims == ndim or it.in_strides[0] < it.in_strides[it.num_reduce_dims]
        if fastest_reduced:
            dim0, dim1, fastest_stride = num_inputs, num_outputs, it.in_strides[0]
        else:
            dim0, dim1, fastest_stride = num_outputs, num_inputs, it.in_strides[it.num_reduce_dims]
    else:
        fastest_reduced, dim0, dim1, fastest_stride = True, 1, 1, itemsize
    if fastest_stride == itemsize:
        if fastest_reduced and dim0 >= 128 and it.num_reduce_dims == 1:
            dim0 //= input_vec_size  # "vectorize along input"
        elif not fastest_reduced:
            output_vec_size = _output_vec_size(it, itemsize, offset_elements)  # "vectorize along output"
            dim0 //= output_vec_size

    # set_block_dimension
    max_threads = _MAX_THREADS // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, _WARP)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height

    step_input = step_output = 1
    block_x_reduce = fastest_reduced  # input split across a warp's lanes
    if fastest_reduced:
        step_input *= block_width
    else:
        step_output *= block_width
    values_per_thread = _div_up(num_inputs, step_input)
    split_across_warps = values_per_thread >= min(block_height * 16, _MAX_VALUES_PER_THREAD)
    if split_across_warps:
        step_input *= block_height
    else:
        step_output *= block_height
    values_per_thread = _div_up(num_inputs, step_input)
    target_grid = card.multiprocessors * (card.max_threads_per_multiprocessor // num_threads)
    grid = _div_up(num_outputs // output_vec_size, step_output)
    if not (split_across_warps and values_per_thread >= _MAX_VALUES_PER_THREAD and grid <= target_grid):
        return 0, 0
    ctas_per_output = max(min(_div_up(target_grid, grid), _div_up(values_per_thread, _MIN_VALUES_PER_THREAD)),
                          _div_up(values_per_thread, _MAX_VALUES_PER_THREAD))
    if ctas_per_output <= 1:
        return 0, 0
    buffer = acc_size * num_outputs * ctas_per_output
    if not block_x_reduce:
        buffer *= block_width * output_vec_size
    return buffer, 4 * grid  # one int semaphore per column of blocks


def _reduction(func, args, kwargs, out):
    """(input, reduced dimensions, keepdim, output) of the reduction kernel `func` runs on CUDA, or None.
    convolution_backward's bias gradient is one: aten's convolution_backward (Convolution.cpp) sums grad_output over
    every dimension but the channels after the backend's kernels return, as it arrived (the transposed gradient of a
    ViT's patch embedding, not cuDNN's contiguous copy of it); a fake kernel returns that gradient with no sum."""
    if func is _CONVOLUTION_BACKWARD:
        output_mask = args[10] if len(args) > 10 else kwargs["output_mask"]
        grad_bias = out[2] if isinstance(out, (tuple, list)) else None
        if not output_mask[2] or not isinstance(grad_bias, torch.Tensor):
            return None
        grad_output = args[0]
        return grad_output, [0, *range(2, grad_output.dim())], False, grad_bias
    if func in _ALL_DIMS:
        return args[0], None, False, out
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    return args[0], [dims] if isinstance(dims, int) else dims, keepdim, out


def staging(func, args, kwargs, out, card: Card | None) -> tuple[int, int]:
    """(buffer, semaphores) bytes the CUDA kernel of this reduction allocates after its output and frees as it
    returns; (0, 0) for any other op, without a card, or where not modelled (see the module docstring)."""
    if card is None or func not in REDUCTIONS:
        return 0, 0
    found = _reduction(func, args, kwargs, out)
    if found is None:
        return 0, 0
    self, dims, keepdim, out = found
    if not isinstance(out, torch.Tensor) or self.dtype not in _FLOATING or not (out.dtype == self.dtype or (
            out.dtype == torch.float32 and self.dtype in (torch.float16, torch.bfloat16))):
        return 0, 0
    ndim = self.dim()
    reduced = set(range(ndim)) if not dims else {d % ndim for d in dims}
    kept = iter(range(out.dim()))
    out_strides = []
    for d in range(ndim):
        if d in reduced:
            out_strides.append(0)
            if keepdim:
                next(kept)
        else:
            out_strides.append(out.stride(next(kept)) * out.element_size())
    shape = list(self.shape)
    in_strides = [s * self.element_size() for s in self.stride()]
    numel = self.numel()
    if numel == 0:
        return 0, 0
    for strides in (out_strides, in_strides):  # TensorIterator.can_use_32bit_indexing
        if numel > _INT32_MAX or 1 + sum((n - 1) * s for n, s in zip(shape, strides)) > _INT32_MAX:
            return 0, 0
    acc_size = 8 if self.dtype == torch.float64 else 4  # arg_t: float for fp16, bf16 and fp32; double for fp64
    return staging_bytes(iterator(shape, out_strides, in_strides), self.element_size(), acc_size,
                         self.storage_offset(), card)
