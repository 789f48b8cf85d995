"""Make ``torch.autocast('cpu', ...)`` cast ops the way ``torch.autocast('cuda', ...)`` does.

CPU autocast has its own op lists (e.g. ``softmax``/``layer_norm``/``sum`` in the input dtype and ``einsum`` in fp32,
where CUDA does the opposite), so activation dtypes, and memory, would differ from a CUDA run. While
:func:`cuda_autocast_policy` is active, the ``AutocastCPU`` kernels follow CUDA's ``Autocast`` registrations (Python
kernels with CUDA's policy, as ``WrapFunction_`` in ``autocast_mode.h``; a fallthrough where CUDA does not autocast),
with a weight-cast cache like CUDA's ``cached_cast``, in a ``torch.library.Library`` destroyed on exit. Autocast sits
above autograd, so the tensors saved for backward are the cast ones. Lists: ``autocast_mode.h`` / ``.cpp``, torch
2.13.0, checked by the tests against the installed binary; an op an older torch does not register is left out
(:func:`installed`). Not modelled: device-specific kernels behind one op, CUDA-only ops. The registrations are
process-wide while active. The details: docs/estimate.md.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch
from torch.library import Library, fallthrough_kernel
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["cuda_autocast_policy", "installed", "CUDA_POLICY", "CPU_POLICY"]

# ---------------------------------------------------------------------------
# torch 2.13.0, aten/src/ATen/autocast_mode.h (AT_FORALL_*) as registered for
# DispatchKey::Autocast (CUDA) in aten/src/ATen/autocast_mode.cpp.
# Names are ATen overload names ("op" means op.default).
CUDA_LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d",
    "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    # autocast_mode.cpp, CUDA only
    "cudnn_convolution", "cudnn_convolution_transpose",
)
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2",
    "log1p", "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar",
    "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod",
    "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# (registered overload, overload redispatched to with dtype appended)
CUDA_FP32_APPEND_DTYPE = (
    ("norm.Scalar", "norm.ScalarOpt_dtype"),
    ("norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype"),
)
CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
    "grid_sampler", "index_put", "tensordot", "scatter_add",
)
CUDA_BANNED = ("binary_cross_entropy",)

# torch 2.13.0, aten/src/ATen/autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)
CPU_LOWER_PRECISION_FP = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d",
    "conv3d.padding", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
    "_addmm_activation", "addbmm", "linear", "_convolution.deprecated",
    "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
    "scaled_dot_product_attention", "_native_multi_head_attention",
)
CPU_FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod",
    "prod.dim_int", "quantile", "quantile.scalar", "nanquantile",
    "nanquantile.scalar", "stft", "stft.center", "cdist", "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace",
    "view_as_complex", "cholesky", "cholesky_inverse", "cholesky_solve",
    "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d",
    "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d",
    "reflection_pad2d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "mse_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss",
    "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "ctc_loss.IntList", "ctc_loss.Tensor", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2",
    "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2",
    "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft",
    "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float", "linalg_solve", "linalg_cholesky",
    "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
    "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd",
    "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
    "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr",
    "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh",
    "linalg_lstsq", "linalg_inv_ex",
)
CPU_PROMOTE = ("stack", "cat", "index_copy")
# ---------------------------------------------------------------------------


def _by_op(**lists: tuple) -> dict[str, str]:
    return {op: policy for policy, ops in lists.items() for op in ops}


CUDA_POLICY = _by_op(
    lower_precision_fp=CUDA_LOWER_PRECISION_FP,
    fp32=CUDA_FP32,
    fp32_set_opt_dtype=CUDA_FP32_SET_OPT_DTYPE,
    fp32_append_dtype=tuple(op for op, _ in CUDA_FP32_APPEND_DTYPE),
    promote=CUDA_PROMOTE,
    banned=CUDA_BANNED,
)
CPU_POLICY = _by_op(
    lower_precision_fp=CPU_LOWER_PRECISION_FP, fp32=CPU_FP32, promote=CPU_PROMOTE
)
_APPEND_DTYPE_TARGET = dict(CUDA_FP32_APPEND_DTYPE)
_BANNED_MESSAGE = (  # text of binary_cross_entropy_banned in autocast_mode.cpp
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)
_NO_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_TENSOR_TYPES = ("Tensor", "Optional[Tensor]", "List[Tensor]")

_lock = threading.Lock()
_depth = 0
_lib: Library | None = None
_torch_clear_autocast_cache = None
_cast_cache = WeakIdKeyDictionary()  # fp32 leaf -> low-precision copy


def installed(policy: dict[str, str], key: str) -> dict[str, str]:
    """The entries of ``policy`` (op name -> policy) whose op the installed torch registers a kernel for under
    dispatch key ``key`` ("AutocastCUDA", "AutocastCPU"; a CPU-only build registers both). An op without one
    falls through autocast on that device and runs in its input dtype; one this torch lacks is not an op here."""
    ops = set(torch._C._dispatch_get_all_op_names())
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return {name: p for name, p in policy.items() if f"aten::{name}" in ops and has_kernel(f"aten::{name}", key)}


def _aten(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _is_eligible(t) -> bool:
    # is_autocast_eligible + is_eligible (autocast_mode.h), with CPU in place of CUDA.
    return (
        isinstance(t, torch.Tensor)
        and (t.is_cpu or t.is_mkldnn)
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def _cached_cast(t, dtype: torch.dtype):
    """at::autocast::cached_cast for one tensor (None passes through)."""
    if not _is_eligible(t) or t.dtype == dtype:
        return t
    cacheable = (
        dtype == torch.get_autocast_dtype("cpu")
        and t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
        and not torch._C._is_cached_tensor(t)
        and not torch.is_inference_mode_enabled()
    )
    if not cacheable:
        return t.to(dtype)
    casted = _cast_cache.get(t)
    if casted is None:
        with torch.enable_grad():
            casted = _cast_cache[t] = t.to(dtype)
    return casted


def _promote_type(lower: torch.dtype, tensors) -> torch.dtype:
    """at::autocast::promote_type: float32 wins over the low-precision type."""
    current = lower
    for t in tensors:
        if not (t.is_cpu or t.is_mkldnn) or not t.is_floating_point():
            continue
        if t.dtype == torch.float64:
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif not (current == lower and t.dtype == lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _make_kernel(name: str, policy: str):
    op = _aten(name)
    arguments = op._schema.arguments
    tensor_args = {a.name for a in arguments if str(a.type) in _TENSOR_TYPES}
    names = [a.name for a in arguments]

    def map_tensors(fn, args, kwargs):
        """fn applied to each tensor argument, the last argument first: the C++ wrappers cast with a pack
        expansion in a call's arguments (`(*F)(cached_cast(to_type, args, device_type)...)`), whose order C++
        leaves to the compiler, and torch's Linux builds (GCC) evaluate it right to left: the CPU kernels here
        cast a convolution's bias, then its weight, then its input (tests/test_autocast_policy.py), and CUDA's
        wrappers are the same template in the same build. The order places the cast copies in the allocator.
        A list's tensors are cast in order (a loop)."""
        def one(value):
            if isinstance(value, (list, tuple)):
                return type(value)(fn(v) for v in value)
            return fn(value)

        args, kwargs = list(args), dict(kwargs)
        for i, name in reversed([(i, name) for i, name in enumerate(names) if name in tensor_args]):
            if i < len(args):
                args[i] = one(args[i])
            elif name in kwargs:
                kwargs[name] = one(kwargs[name])
        return args, kwargs

    def bound(args, kwargs):
        for i, a in enumerate(arguments):
            if i < len(args):
                yield a, args[i]
            elif a.name in kwargs:
                yield a, kwargs[a.name]

    def kernel(*args, **kwargs):
        if policy == "banned":
            raise RuntimeError(_BANNED_MESSAGE)
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST_CPU):
            lower = torch.get_autocast_dtype("cpu")
            if policy == "lower_precision_fp":
                args, kwargs = map_tensors(lambda t: _cached_cast(t, lower), args, kwargs)
            elif policy == "fp32":
                args, kwargs = map_tensors(lambda t: _cached_cast(t, torch.float32), args, kwargs)
            elif policy == "promote":
                # Optional[Tensor] arguments are cast but do not vote (prioritize overloads).
                voters = [
                    t
                    for a, v in bound(args, kwargs)
                    if str(a.type) in ("Tensor", "List[Tensor]")
                    for t in (v if isinstance(v, (list, tuple)) else (v,))
                    if isinstance(t, torch.Tensor)
                ]
                to = _promote_type(lower, voters)
                args, kwargs = map_tensors(lambda t: _cached_cast(t, to), args, kwargs)
            elif policy == "fp32_set_opt_dtype":
                # Only if the first argument is eligible; an explicit dtype is respected.
                if _is_eligible(args[0]):
                    i = names.index("dtype")
                    if i < len(args) and not arguments[i].kwarg_only:
                        if args[i] is None:
                            args = [*args[:i], torch.float32, *args[i + 1:]]
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
            elif policy == "fp32_append_dtype":
                out = torch.float32 if _is_eligible(args[0]) else args[0].dtype
                defaults = [a.default_value for a in arguments[len(args):] if not a.kwarg_only]
                return _aten(_APPEND_DTYPE_TARGET[name])(*args, *defaults, dtype=out)
            return op(*args, **kwargs)

    return kernel


def _clear_autocast_cache() -> None:
    _torch_clear_autocast_cache()
    _cast_cache.clear()


def _register() -> Library:
    lib = Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel ..." for ops CPU autocasts too.
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            cuda, cpu = installed(CUDA_POLICY, "AutocastCUDA"), installed(CPU_POLICY, "AutocastCPU")
            for name, policy in cuda.items():
                if cpu.get(name) != policy:
                    lib.impl(name, _make_kernel(name, policy), "AutocastCPU")
            for name in cpu:
                if name not in cuda:
                    lib.impl(name, fallthrough_kernel, "AutocastCPU")
    except BaseException:
        lib._destroy()
        raise
    return lib


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While active, ``torch.autocast('cpu', ...)`` casts ops exactly as
    ``torch.autocast('cuda', ...)`` would (op lists and policies of torch 2.13, less the ops the installed
    torch does not autocast).

    Re-entrant; the registrations are removed when the outermost use exits.
    Use it around (or inside) the ``torch.autocast('cpu', dtype)`` region::

        with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
    """
    global _depth, _lib, _torch_clear_autocast_cache
    with _lock:
        if _depth == 0:
            _lib = _register()
            _torch_clear_autocast_cache = torch.clear_autocast_cache
            torch.clear_autocast_cache = _clear_autocast_cache
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if torch.clear_autocast_cache is _clear_autocast_cache:
                    torch.clear_autocast_cache = _torch_clear_autocast_cache
                _cast_cache.clear()
                _lib._destroy()
                _lib = None
