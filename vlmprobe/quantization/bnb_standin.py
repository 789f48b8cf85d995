"""Stand-ins for bitsandbytes 0.50.2's Linear4bit and Linear8bitLt that allocate what its CUDA path allocates,
so the estimate backend (fake tensors, no bitsandbytes needed) charges QLoRA's bytes. Each piece names the
bitsandbytes code it follows; values are never computed (weights do not change memory, shapes do).

Kept per quantized layer: the packed or int8 weight and its quantization state; transient per matmul: what each
forward and backward dequantizes or casts (docs/quantization.md lists them). Limits: from 5 to 1536 rows
bitsandbytes picks the 4-bit forward's kernel by card and shape, and the larger (the dequantize fallback) is
charged, as `notes()` says; the 8-bit layer's outlier columns depend on the activations' values and none is
assumed.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["dequantize_4bit", "gemm_4bit", "Linear4bit", "Linear8bitLt", "MatMul8bitLt", "notes", "quantize_4bit",
           "replace"]


BLOCKSIZE = 64  # Linear4bit's default block size; transformers' BitsAndBytesConfig sets no other
NESTED_BLOCKSIZE = 256  # quantize_4bit's compress_statistics: quantize_blockwise(absmax, blocksize=256)
FUSED_MAX_ROWS = 4  # backends/cuda/ops.py _GEMM_4BIT_CUSTOM_FLOOR_M: at most this many rows, the fused kernel
FALLBACK_MIN_ROWS = 1537  # over _gemm_4bit_custom_max_m (1536) rows, always the dequantize + F.linear fallback
THRESHOLD = 6.0  # transformers' llm_int8_threshold default: outlier columns |A| >= 6 stay in fp16

_uncertain_rows: set[int] = set()  # row counts whose 4-bit kernel CUDA picks per card (charged as the fallback)


def notes() -> list[str]:
    """What the rows should say about this run's stand-in choices (and forget them)."""
    rows = sorted(_uncertain_rows)
    _uncertain_rows.clear()
    if not rows:
        return []
    return [f"bitsandbytes 4-bit matmuls over {rows[0]}-{rows[-1]} rows: CUDA picks its fused kernel or dequantize + "
            f"linear by card and shape; the estimate charges the dequantized weight (the larger)"]


class QuantState:
    """The tensors of bitsandbytes.functional.QuantState that stay on the device (4-bit)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, nested: bool, code, absmax, offset=None,
                 state2_absmax=None, state2_code=None):
        self.shape, self.dtype, self.nested = shape, dtype, nested  # dtype: the weight's when quantized
        self.code, self.absmax, self.offset = code, absmax, offset
        self.state2_absmax, self.state2_code = state2_absmax, state2_code


def quantize_4bit(weight: torch.Tensor, nested: bool, maps: dict) -> tuple[torch.Tensor, QuantState]:
    """functional.quantize_4bit on CUDA, allocation by allocation: the op's fp32 absmax per block, then the packed
    codes; the type's table (get_4bit_type: made, then divided by its largest value); with double quantization the
    mean, the absmax less it, the dynamic map (made once a process: `maps`, bitsandbytes' name2qmap), the nested
    op's fp32 absmax then its uint8 codes, the map's copy; the fp32 absmax and its shifted copy freed."""
    n, device = weight.numel(), weight.device
    blocks = -(n // -BLOCKSIZE)
    absmax = torch.empty(blocks, dtype=torch.float32, device=device)  # backends/cuda/ops.py quantize_4bit
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device)
    code = torch.ones(16, dtype=torch.float32, device=device)  # get_4bit_type: torch.tensor(data, device)
    code.div_(code.abs().max())
    if not nested:
        return packed, QuantState(weight.shape, weight.dtype, False, code, absmax)
    offset = absmax.mean()
    shifted = absmax - offset
    if "dynamic" not in maps:  # quantize_blockwise: name2qmap["dynamic"] = create_dynamic_map().to(A.device)
        maps["dynamic"] = torch.empty(256, dtype=torch.float32, device=device)
    state2_absmax = torch.empty(-(blocks // -NESTED_BLOCKSIZE), dtype=torch.float32, device=device)
    codes = torch.empty(blocks, dtype=torch.uint8, device=device)
    state2_code = torch.empty(256, dtype=torch.float32, device=device)  # code.to(A.device, copy=True)
    del shifted, absmax
    return packed, QuantState(weight.shape, weight.dtype, True, code, codes, offset, state2_absmax, state2_code)


class Linear4bit(nn.Linear):
    """bitsandbytes.nn.Linear4bit as transformers builds it, quantized from `linear`'s weight (the checkpoint's
    tensor, just loaded: Params4bit._quantize)."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, double_quant: bool, maps: dict):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed, self.quant_state = quantize_4bit(linear.weight, double_quant, maps)
        self.weight = nn.Parameter(packed, requires_grad=False)  # Params4bit
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)  # replace_with_bnb_linear: new_module.requires_grad_(False)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Linear4bit.forward
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        out = MatMul4Bit.apply(x, self.weight, bias, self) if needs_grad else gemm_4bit(x, self, bias)
        return out.to(inp_dtype)


def gemm_4bit(A: torch.Tensor, layer: Linear4bit, bias) -> torch.Tensor:
    """bitsandbytes::gemm_4bit's CUDA kernel (backends/cuda/ops.py)."""
    K = A.shape[-1]
    rows = A.numel() // K
    if rows <= FUSED_MAX_ROWS and K % BLOCKSIZE == 0:  # _gemm_4bit_kernel_impl: the output only
        return torch.empty((*A.shape[:-1], layer.out_features), dtype=A.dtype, device=A.device)
    if rows < FALLBACK_MIN_ROWS and K % BLOCKSIZE == 0:
        _uncertain_rows.add(rows)
    state = layer.quant_state
    absmax_dq = absmax = state.absmax  # _dequant_linear_fallback: both stay alive until it returns
    if state.nested:
        absmax_dq = torch.empty_like(state.absmax, dtype=torch.float32)
        absmax = absmax_dq + state.offset
    weight = torch.empty(state.shape, dtype=A.dtype, device=A.device)  # B_dq, _dequantize_4bit_impl's out
    out = nn.functional.linear(A, weight, bias)
    del absmax_dq, absmax, weight
    return out


def dequantize_4bit(state: QuantState) -> torch.Tensor:
    """functional.dequantize_4bit on CUDA: the weight in the dtype it was quantized from."""
    absmax = state.absmax
    if state.nested:
        absmax = torch.empty(state.absmax.shape, dtype=torch.float32, device=state.absmax.device)  # dequantize_blockwise
        absmax += state.offset
    out = torch.empty(state.shape, dtype=state.dtype, device=state.absmax.device)
    del absmax
    return out


class MatMul4Bit(torch.autograd.Function):
    """autograd/_functions.py MatMul4Bit: saves nothing new; backward dequantizes the weight again."""

    @staticmethod
    def forward(ctx, A, weight, bias, layer):
        ctx.layer = layer
        return gemm_4bit(A, layer, bias)

    @staticmethod
    def backward(ctx, grad_output):
        grad_A = None
        if ctx.needs_input_grad[0]:
            grad_A = torch.matmul(grad_output, dequantize_4bit(ctx.layer.quant_state).to(grad_output.dtype))
        return grad_A, None, None, None


class Linear8bitLt(nn.Linear):
    """bitsandbytes.nn.Linear8bitLt as transformers builds it (has_fp16_weights=False, threshold 6.0), quantized
    from `linear`'s weight as transformers' Bnb8bitQuantize does: the loaded tensor copied to the host, back to the
    device in fp16 (Int8Params._quantize), then int8_vectorwise_quant's row scales and int8 rows; the fp16 copy
    freed."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        device = linear.weight.device
        fp16 = torch.empty(linear.weight.shape, dtype=torch.float16, device=device)  # from the host copy
        self.SCB = torch.empty(self.out_features, dtype=torch.float32, device=device)  # row_stats
        self.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=torch.int8, device=device),
                                   requires_grad=False)  # Int8Params: CB
        del fp16
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Linear8bitLt.forward -> bnb.matmul on CUDA
        if self.bias is not None and self.bias.dtype != x.dtype:
            self.bias.data = self.bias.data.to(x.dtype)
        return MatMul8bitLt.apply(x, self.weight, self.bias, self)


class MatMul8bitLt(torch.autograd.Function):
    """autograd/_functions.py MatMul8bitLt, frozen int8 weight, no outlier columns (module docstring)."""

    @staticmethod
    def forward(ctx, A, weight, bias, layer):
        input_shape = A.shape
        A = A.reshape(-1, A.shape[-1])
        A16 = A.to(torch.float16)
        # int8_vectorwise_quant (CUDA): row stats and int8 rows (kept until forward returns), the outlier test
        row_stats = torch.empty(A16.shape[0], dtype=torch.float32, device=A.device)
        quantized = torch.empty(A16.shape, dtype=torch.int8, device=A.device)
        outliers = A16.abs() >= THRESHOLD
        outliers.any()
        del outliers, A16
        sub_a = torch.empty(0, dtype=A.dtype, device=A.device)  # int8_mixed_scaled_mm without outliers
        out_i32 = torch.empty((A.shape[0], layer.out_features), dtype=torch.int32, device=A.device)  # int8_linear_matmul
        out16 = torch.empty_like(out_i32, dtype=torch.float16)  # int8_mm_dequant (CUDA): fp16 out, then cast
        if bias is not None and bias.dtype != torch.float16:
            out16.add_(bias)
        output = out16.to(A.dtype)
        del out16, out_i32, quantized, row_stats
        ctx.layer, ctx.grad_shape, ctx.dtype_A = layer, input_shape, A.dtype
        ctx.tensors = (sub_a, A) if ctx.needs_input_grad[0] else None
        return output.reshape(*input_shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        layer = ctx.layer
        weight = layer.weight.to(ctx.dtype_A, copy=True).mul_(layer.SCB.unsqueeze(1).mul(1.0 / 127.0))
        grad_A = torch.matmul(grad_output.to(ctx.dtype_A), weight).view(ctx.grad_shape)
        return grad_A, None, None, None


def replace(linear: nn.Linear, train: dict, maps: dict) -> nn.Linear:
    """The stand-in of the bitsandbytes layer transformers puts in `linear`'s place, quantized from its weight
    (`maps`: the device maps bitsandbytes makes once a process, kept by the caller for the point's life)."""
    if train["quantization"] == "int8":
        return Linear8bitLt(linear)
    compute_dtype = getattr(torch, train["quantization_compute_dtype"])  # a name validate() allowed
    return Linear4bit(linear, compute_dtype, train["quantization_double_quant"], maps)
