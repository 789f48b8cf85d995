"""Liger-Kernel 0.8.5's Triton kernels as autograd Functions that allocate and save what Liger's allocate and save.

Read from liger_kernel 0.8.5 (`pip download liger-kernel==0.8.5`): ops/rms_norm.py, ops/layer_norm.py,
ops/swiglu.py, ops/rope.py, ops/fused_linear_cross_entropy.py and transformers/model/loss_utils.py. Each Function
runs the Python around Liger's kernel launch line by line (the same `torch.empty` / `zeros_like` buffers, views,
`.contiguous()` copies, casts and matmuls, in the same order), and in place of each Triton launch runs in-place
torch ops on the buffers that kernel writes, which make no new storage. So the same code runs on real tensors
(backend cpu), fake ones (estimate) and CUDA, and the tracker charges what Liger allocates; Triton's own
registers and shared memory are no storage.

Values: every output and gradient is a finite function of the inputs with Liger's shapes and dtypes; the forward
outputs of the norms and SwiGLU are Liger's formulas. Where Liger's kernel keeps per-row sums in registers, the
stand-in writes a surrogate into the same buffer (each is named where it is made): memory, not values, is what they
model. Card: Liger sizes the norms' partial weight-gradient buffers by the card's multiprocessor count and picks the
fused cross-entropy's weight-gradient path by compute capability; on CUDA tensors the device's are read, elsewhere
MULTIPROCESSORS and CAPABILITY (an H100's), as no target card reaches the model's build.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CAPABILITY", "MULTIPROCESSORS", "FusedLinearCrossEntropyFunction", "LayerNormFunction", "RMSNormFunction",
           "RopeFunction", "SiLUMulFunction", "capability", "causal_lm_loss", "chunk_rows",
           "fused_linear_cross_entropy_forward", "layer_norm_backward", "layer_norm_forward", "multiprocessors",
           "rms_norm_backward", "rms_norm_forward", "rope_text", "rope_vision"]

MULTIPROCESSORS = 132  # an H100's (and H200's) multi_processor_count, where the tensors are not on CUDA
CAPABILITY = 9  # its compute capability's major (sm90): FLCE's addmm paths need 8 or more
LOW_PRECISION = (torch.float16, torch.bfloat16)
FP32_RSTD_MODES = ("llama", "gemma")  # rms_norm.py: RSTD in fp32 for these casting modes, else in X's dtype
EXP_CLAMP = 10.0  # the cross-entropy surrogate's exp stays finite in fp16


def multiprocessors(device: torch.device) -> int:
    """sm_count as rms_norm_backward / layer_norm_backward read it on CUDA."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return MULTIPROCESSORS


def capability(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0]
    return CAPABILITY


def _scale(x: torch.Tensor, weight: torch.Tensor, offset: float) -> None:
    """x *= (offset + weight), in place: x + x * w / offset, times offset, when offset is not 0 (Gemma's 1)."""
    if offset:
        x.addcmul_(x, weight, value=1.0 / offset).mul_(offset)
    else:
        x.mul_(weight)


def _partial_rows(partial: torch.Tensor, dy: torch.Tensor, x_hat_of) -> None:
    """The kernels' per-program partial weight gradients (sm_count rows, fp32). Surrogate: row i holds dy * x_hat of
    input row i for the first sm_count rows (Liger sums every row into its program's row), the rest zero."""
    k = min(partial.shape[0], dy.shape[0])
    x_hat_of(k, partial[:k])
    partial[:k].mul_(dy[:k])
    partial[k:].zero_()


def rms_norm_forward(X, W, eps, offset, casting_mode):
    """ops/rms_norm.py rms_norm_forward: (Y, X as rows, rstd); the kernel: rstd = 1 / sqrt(mean(x^2) + eps),
    Y = x * rstd * (offset + W)."""
    shape = X.shape
    X = X.view(-1, shape[-1])
    n_rows, n_cols = X.shape
    Y = torch.empty((n_rows, n_cols), dtype=X.dtype, device=X.device)
    rstd_dtype = torch.float32 if casting_mode in FP32_RSTD_MODES else X.dtype
    RSTD = torch.empty(n_rows, dtype=rstd_dtype, device=X.device)
    torch.linalg.vector_norm(X, 2, dim=-1, dtype=rstd_dtype, out=RSTD)
    RSTD.square_().div_(n_cols).add_(eps).rsqrt_()
    torch.mul(X, RSTD[:, None], out=Y)
    if W is not None:
        _scale(Y, W, offset)
    return Y.view(*shape), X, RSTD


def rms_norm_backward(dY, X, W, RSTD, offset, in_place, needs_dw):
    """ops/rms_norm.py rms_norm_backward: dX into dY (in_place) or a zeros_like(dY), an (sm_count, n) fp32 partial
    dW summed over its rows and cast to W's dtype."""
    shape = dY.shape
    dY = dY.view(-1, shape[-1])
    n_rows, n_cols = dY.shape
    compute_dw = W is not None and needs_dw
    _dW = torch.empty((multiprocessors(X.device), n_cols), dtype=torch.float32, device=W.device) if compute_dw else None
    dX = dY if in_place else torch.zeros_like(dY)
    if compute_dw:  # before dX may overwrite dY
        _partial_rows(_dW, dY, lambda k, out: torch.mul(X[:k], RSTD[:k, None], out=out))
    # surrogate dX = dY * (offset + W) * rstd: Liger's, without the per-row mean term its registers hold
    if dX is not dY:
        dX.copy_(dY)
    if W is not None:
        _scale(dX, W, offset)
    dX.mul_(RSTD[:, None])
    dX = dX.view(*shape)
    dW = _dW.sum(dim=0).to(W.dtype) if compute_dw else None
    return dX, dW


class RMSNormFunction(torch.autograd.Function):
    """ops/rms_norm.py LigerRMSNormFunction: Y and an rstd per row (fp32 in the llama and gemma casting modes) made
    in forward, which saves X (its 2-D view), W and rstd; backward writes dX into dY (in_place) or a zeros_like(dY),
    with an (sm_count, n) fp32 partial dW summed over its rows and cast to W's dtype."""

    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        X = X.contiguous()  # @ensure_contiguous
        W = W.contiguous() if W is not None else None
        Y, X, RSTD = rms_norm_forward(X, W, eps, offset, casting_mode)
        ctx.offset, ctx.in_place, ctx.affine = offset, in_place, W is not None
        if W is not None:
            ctx.save_for_backward(X, W, RSTD)
        else:
            ctx.save_for_backward(X, RSTD)
        return Y

    @staticmethod
    def backward(ctx, dY):
        dY = dY.contiguous()  # @ensure_contiguous: this copy lives until backward returns
        if ctx.affine:
            X, W, RSTD = ctx.saved_tensors
        else:
            (X, RSTD), W = ctx.saved_tensors, None
        needs_dw = ctx.needs_input_grad[1] if ctx.affine else False
        dX, dW = rms_norm_backward(dY, X, W, RSTD, ctx.offset, ctx.in_place, needs_dw)
        return dX, dW, None, None, None, None, None


def layer_norm_forward(X, W, B, eps):
    """ops/layer_norm.py layer_norm_forward: (Y, X as rows, mean, rstd); the kernel: mean, rstd = 1 / sqrt(mean(x^2)
    - mean^2 + eps), Y = (x - mean) * rstd * W + B."""
    shape = X.shape
    X = X.view(-1, shape[-1])
    n_rows, n_cols = X.shape
    Y = torch.empty((n_rows, n_cols), dtype=X.dtype, device=X.device)
    Mean = torch.empty(n_rows, dtype=torch.float32, device=X.device)
    RSTD = torch.empty(n_rows, dtype=torch.float32, device=X.device)
    torch.mean(X, -1, dtype=torch.float32, out=Mean)
    torch.linalg.vector_norm(X, 2, dim=-1, dtype=torch.float32, out=RSTD)
    RSTD.square_().div_(n_cols).addcmul_(Mean, Mean, value=-1.0).clamp_(min=0.0).add_(eps).rsqrt_()
    torch.sub(X, Mean[:, None], out=Y)
    Y.mul_(RSTD[:, None]).mul_(W).add_(B)
    return Y.view(*shape), X, Mean, RSTD


def layer_norm_backward(dY, X, W, B, Mean, RSTD, needs_dw, needs_db):
    """ops/layer_norm.py layer_norm_backward: (sm_count, n) fp32 partial dW and dB, a new dX, the partials summed
    over their rows, each cast to its parameter's dtype."""
    shape = dY.shape
    dY = dY.view(-1, shape[-1])
    n_rows, n_cols = dY.shape
    sm_count = multiprocessors(X.device)
    _DW = torch.empty((sm_count, n_cols), dtype=torch.float32, device=W.device) if needs_dw else None
    _DB = torch.empty((sm_count, n_cols), dtype=torch.float32, device=W.device) if needs_db else None
    DX = torch.empty((n_rows, n_cols), dtype=X.dtype, device=X.device)
    if needs_dw:
        _partial_rows(_DW, dY, lambda k, out: torch.sub(X[:k], Mean[:k, None], out=out).mul_(RSTD[:k, None]))
    if needs_db:
        _partial_rows(_DB, dY, lambda k, out: out.fill_(1.0))
    # surrogate dX = dY * W * rstd: Liger's, without the two per-row mean terms its registers hold
    torch.mul(dY, W, out=DX)
    DX.mul_(RSTD[:, None])
    DX = DX.view(*shape)
    DW = _DW.sum(dim=0).to(W.dtype) if needs_dw else None
    DB = _DB.sum(dim=0).to(B.dtype) if needs_db else None
    return DX, DW, DB


class LayerNormFunction(torch.autograd.Function):
    """ops/layer_norm.py LigerLayerNormFunction: Y, a mean and an rstd per row (fp32) made in forward, which saves X,
    W, B, mean and rstd; backward makes (sm_count, n) fp32 partial dW and dB, then a new dX, and sums the partials
    over their rows, each cast to its parameter's dtype."""

    @staticmethod
    def forward(ctx, X, W, B, eps):
        X, W, B = X.contiguous(), W.contiguous(), B.contiguous()  # @ensure_contiguous
        Y, X, Mean, RSTD = layer_norm_forward(X, W, B, eps)
        ctx.save_for_backward(X, W, B, Mean, RSTD)
        return Y

    @staticmethod
    def backward(ctx, dY):
        dY = dY.contiguous()  # @ensure_contiguous: this copy lives until backward returns
        X, W, B, Mean, RSTD = ctx.saved_tensors
        DX, DW, DB = layer_norm_backward(dY, X, W, B, Mean, RSTD, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        return DX, DW, DB, None


class SiLUMulFunction(torch.autograd.Function):
    """ops/swiglu.py LigerSiLUMulFunction: c = silu(a) * b in a new buffer like a; saves a and b (2-D views of the
    gate and up projections' outputs) and nothing else; backward writes da into a's buffer and db into b's and
    returns them: it allocates nothing but dc's contiguous copy where dc is not contiguous."""

    @staticmethod
    def forward(ctx, a, b, gate_multiplier=1.0, down_multiplier=1.0):
        a, b = a.contiguous(), b.contiguous()  # @ensure_contiguous
        ctx.gate_multiplier, ctx.down_multiplier = float(gate_multiplier), float(down_multiplier)
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        c = torch.empty_like(a)
        if gate_multiplier != 1.0:
            torch.mul(a, gate_multiplier, out=c)
            torch.ops.aten.silu_(c)
        else:
            torch.ops.aten.silu.out(a, out=c)
        c.mul_(b)
        c = c.view(*shape)
        if ctx.down_multiplier != 1.0:
            c = c * ctx.down_multiplier
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc):
        dc = dc.contiguous()  # @ensure_contiguous
        a, b = ctx.saved_tensors
        if ctx.down_multiplier != 1.0:
            dc = dc * ctx.down_multiplier
        shape = dc.shape
        d = dc.view(-1, shape[-1])
        # the kernel writes da = dc * b * silu'(a) into a and db = dc * silu(a) into b; here with dc as scratch
        # (gate_multiplier's factor on da left out)
        b.mul_(d)  # dc * b
        torch.ops.aten.silu_backward.grad_input(b, a, grad_input=b)  # da, in b
        torch.ops.aten.silu_(a)
        a.mul_(d)  # db, in a
        d.copy_(a)
        a.copy_(b)
        b.copy_(d)
        return a.view(*shape), b.view(*shape), None, None


def _resolve_rotary_dim(cos: torch.Tensor, head_dim: int, rotary_dim: int | None) -> int:
    """ops/rope.py _resolve_rotary_dim: the width of cos, unless given."""
    return min(cos.shape[-1], head_dim) if rotary_dim is None else rotary_dim


def _rope(q, k, cos, sin, unsqueeze_dim: int, rotary_dim: int | None, inverse: bool):
    """ops/rope.py rope_forward / rope_backward: cos and sin brought to (batch or 1, seq, width), q and k as
    (batch, seq, heads, head_dim) made contiguous (a copy only where they are not), rotated in place."""
    if cos.ndim == 4:
        if cos.shape[unsqueeze_dim] == 1:
            cos, sin = cos.squeeze(unsqueeze_dim), sin.squeeze(unsqueeze_dim)
        elif cos.shape[1] == 1:
            cos, sin = cos.squeeze(1), sin.squeeze(1)
        else:
            cos, sin = cos.squeeze(), sin.squeeze()
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    rotary = _resolve_rotary_dim(cos, q.shape[-1], rotary_dim)
    q, k, cos, sin = q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous()
    for x in (q, k):
        _rotate(x, cos, sin, rotary, inverse)
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: int, inverse: bool) -> None:
    """The kernel's rotation of each head's first `rotary` entries by (cos, sin), in place. Surrogate: two shears,
    x1 <- x1 cos -/+ x2 sin, then x2 <- x2 cos +/- x1 sin with the new x1 (a rotation needs the old x1 kept)."""
    half = rotary // 2
    c, s = cos[..., None, :half], sin[..., None, :half]
    x1, x2 = x[..., :half], x[..., half:rotary]
    sign = 1.0 if inverse else -1.0
    x1.mul_(c).addcmul_(x2, s, value=sign)
    x2.mul_(c).addcmul_(x1, s, value=-sign)


class RopeFunction(torch.autograd.Function):
    """ops/rope.py LigerRopeFunction: q and k rotated in place (their buffers, or contiguous copies where they are
    not contiguous), returned as views; saves cos and sin as reshaped; backward rotates dq and dk in place."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        q, k, cos, sin = _rope(q, k, cos, sin, unsqueeze_dim, rotary_dim, inverse=False)
        ctx.save_for_backward(cos, sin)
        ctx.rotary_dim = rotary_dim
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk, _, _ = _rope(dq, dk, cos, sin, 1, ctx.rotary_dim, inverse=True)
        return dq, dk, None, None, None, None, None


def rope_text(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers/rope.py liger_rotary_pos_emb, with the Triton implementation the dispatcher picks by default."""
    return RopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim, None)


def rope_vision(q, k, cos, sin):
    """transformers/rope.py liger_rotary_pos_emb_vision (Qwen3-VL's vision tower): q and k (seq, heads, head_dim) cast
    to fp32 (a new buffer unless already fp32) as (1, heads, seq, head_dim), rotated, cast back."""
    q_dtype, k_dtype = q.dtype, k.dtype
    q32 = q.to(torch.float32).unsqueeze(0).transpose(1, 2)
    k32 = k.to(torch.float32).unsqueeze(0).transpose(1, 2)
    q_out, k_out = rope_text(q32, k32, cos.to(torch.float32), sin.to(torch.float32))
    return q_out.transpose(1, 2).squeeze(0).to(q_dtype), k_out.transpose(1, 2).squeeze(0).to(k_dtype)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def chunk_rows(rows: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> int:
    """fused_linear_cross_entropy_forward's chunk size: logits chunks bounded to about rows x hidden elements."""
    inc_factor = -(vocab // -(chunk_mem_const * hidden))
    return min(_next_power_of_2(-(rows // -inc_factor)), rows)


def _can_use_mm_out(_input: torch.Tensor, weight: torch.Tensor) -> bool:
    """_can_use_mm_out as on CUDA (not ROCm): the logits chunk into one reused buffer through mm(out=) where the
    matmul would run in the operands' own dtype."""
    if torch.is_grad_enabled() or _input.dtype != weight.dtype or \
            _input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    device = _input.device.type
    if torch.is_autocast_enabled(device):
        return _input.dtype == torch.get_autocast_dtype(device)
    return True


def _cross_entropy_in_place(logits: torch.Tensor, loss: torch.Tensor, mask: torch.Tensor, n_non_ignore: int,
                            mean: bool, gradients: bool) -> None:
    """ops/cross_entropy.py liger_cross_entropy_kernel over one chunk: each row's loss into `loss` (fp32) and, with
    gradients, the logits' gradient over the logits. Surrogate: log-sum-exp as the loss and softmax as the gradient,
    the target's terms left out (they need the target's logit, which the kernel keeps in a register); ignored rows
    zero."""
    logits.clamp_(max=EXP_CLAMP).exp_()
    torch.sum(logits, dim=-1, dtype=torch.float32, out=loss)
    if gradients:
        logits.div_(loss[:, None]).mul_(mask[:, None])
        if mean:
            logits.div_(n_non_ignore)
    loss.log_().mul_(mask)
    if mean:
        loss.div_(n_non_ignore)


def _accumulate_fp32(grad_weight: torch.Tensor, grad_logits_t: torch.Tensor, input_chunk: torch.Tensor) -> None:
    """torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=float32, out=grad_weight): fp16/bf16 operands
    into the fp32 gradient, nothing allocated. CPU has no kernel for it, so off CUDA its value is left out."""
    if grad_weight.device.type == "cuda":
        torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=torch.float32, out=grad_weight)


def fused_linear_cross_entropy_forward(_input, weight, target, bias=None, ignore_index=-100, reduction="mean"):
    """ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward (no class weights, z-loss, label
    smoothing, softcap or token scaling, as LigerForCausalLMLoss calls it): (loss, grad_input, grad_weight,
    grad_bias), the three gradients made and filled here, chunk by chunk."""
    device = _input.device
    input_requires_grad, weight_needs_grad = _input.requires_grad, weight.requires_grad
    rows, hidden = _input.shape
    vocab = weight.shape[0]
    chunk_size = chunk_rows(rows, hidden, vocab)
    num_chunks = -(rows // -chunk_size)
    grad_input = torch.zeros_like(_input, device=device)
    if input_requires_grad:
        grad_weight = torch.zeros_like(weight, device=device) if weight_needs_grad else None
        grad_bias = torch.zeros_like(bias, device=device) if bias is not None else None
    else:
        grad_weight = grad_bias = None
    loss_1d = torch.zeros(rows, dtype=torch.float32, device=device)
    target_mask = target != ignore_index
    total_n_non_ignore = target_mask.sum().item()  # a fake run reads 0 here (vlmprobe.estimate.tracker)
    use_mm_out = _can_use_mm_out(_input, weight)
    logits_storage = (torch.empty((chunk_size, vocab), dtype=_input.dtype, device=device)
                      if use_mm_out and (bias is None or bias.dtype == _input.dtype) else None)
    for chunk_id in range(num_chunks):
        start, end = chunk_id * chunk_size, min((chunk_id + 1) * chunk_size, rows)
        _input_chunk = _input[start:end]
        if logits_storage is not None:
            logits_chunk = logits_storage[: end - start]
            torch.mm(_input_chunk, weight.t(), out=logits_chunk)
            if bias is not None:
                logits_chunk.add_(bias)
        else:
            logits_chunk = _input_chunk @ weight.t()
            if bias is not None:
                logits_chunk = logits_chunk + bias
        target_chunk = target[start:end]
        logits_chunk, target_chunk = logits_chunk.contiguous(), target_chunk.contiguous()
        loss_1d_slice = loss_1d[start:end]  # a view kept past the loop, as Liger's is: loss_1d dies after target_mask
        _cross_entropy_in_place(logits_chunk, loss_1d_slice, target_mask[start:end],
                                max(int(total_n_non_ignore), 1), reduction == "mean", input_requires_grad)
        grad_logits_chunk = logits_chunk
        del logits_chunk
        if input_requires_grad:
            if use_mm_out and grad_logits_chunk.dtype == grad_input.dtype:
                torch.mm(grad_logits_chunk, weight, out=grad_input[start:end])
            else:
                grad_input[start:end] = grad_logits_chunk @ weight
        if grad_weight is not None and input_requires_grad:
            grad_logits_t = grad_logits_chunk.t()
            major = capability(grad_weight.device)
            if major >= 8 and grad_weight.dtype == torch.float32 and grad_logits_t.dtype in LOW_PRECISION:
                input_chunk = _input_chunk
                if input_chunk.dtype != grad_logits_t.dtype:
                    input_chunk = input_chunk.to(grad_logits_t.dtype)
                _accumulate_fp32(grad_weight, grad_logits_t, input_chunk)
                del input_chunk
            elif major >= 8 and grad_logits_t.dtype in LOW_PRECISION and grad_weight.dtype == grad_logits_t.dtype:
                input_chunk = _input_chunk
                if input_chunk.dtype != grad_logits_t.dtype:
                    input_chunk = input_chunk.to(grad_logits_t.dtype)
                torch.addmm(grad_weight, grad_logits_t, input_chunk, out=grad_weight)
                del input_chunk
            else:  # Liger's legacy fallback: a weight-sized fp32 product per chunk
                grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()
            del grad_logits_t
        if bias is not None and input_requires_grad:
            torch.add(input=grad_bias, other=grad_logits_chunk.sum(dim=0), out=grad_bias, alpha=1.0)
        del grad_logits_chunk, _input_chunk, target_chunk
    del logits_storage
    loss = loss_1d if reduction == "none" else torch.sum(loss_1d)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
    return loss, grad_input, grad_weight, grad_bias


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """ops/fused_linear_cross_entropy.py LigerFusedLinearCrossEntropyFunction (mean or sum reduction): the loss and
    the gradients of the hidden states and of the head's weight computed in forward, chunk by chunk, the logits never
    whole; the gradients are saved (kept from forward to backward), and backward scales them by the loss's gradient in
    place and returns them. Liger's amp_custom_fwd / custom_bwd leave both unchanged without cast_inputs: left out."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias=None, ignore_index=-100, reduction="mean"):
        loss, grad_input, grad_weight, grad_bias = fused_linear_cross_entropy_forward(
            _input, weight, target, bias, ignore_index, reduction)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None,
                              grad_bias.detach() if grad_bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        # fused_linear_cross_entropy_backward: element_mul_kernel in place (skipped by Liger when grad_output is
        # 1.0, which changes no value; its torch.tensor(1.0) is made from Python data)
        for grad in (grad_input, grad_weight, grad_bias):
            if grad is not None:
                grad.mul_(grad_output)
        return grad_input, grad_weight, None, grad_bias, None, None


def causal_lm_loss(hidden_states, lm_head_weight, labels, hidden_size: int, num_items_in_batch=None,
                   ignore_index: int = -100, shift_labels=None):
    """transformers/model/loss_utils.py LigerForCausalLMLoss: the labels padded and shifted (two int64 copies), the
    hidden states flattened (a view), the fused loss in mean reduction, or sum divided by num_items_in_batch."""
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    hidden_states = hidden_states.view(-1, hidden_size)
    shift_labels = shift_labels.view(-1).to(hidden_states.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = FusedLinearCrossEntropyFunction.apply(hidden_states, lm_head_weight, shift_labels, None, ignore_index,
                                                 reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss
