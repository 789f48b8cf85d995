"""cuda_autocast_policy: CPU autocast follows CUDA's op lists.

Expected dtypes come from the PyTorch AMP docs (https://pytorch.org/docs/stable/amp.html,
"CUDA Ops that can autocast to float16 / to float32 / that promote to the widest input
type"), not from the module's own lists; einsum is CUDA lower-precision per
autocast_mode.h (the docs do not list it).
"""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from vlmprobe.estimate.cuda_rules import autocast_policy
from vlmprobe.estimate.cuda_rules.autocast_policy import CPU_POLICY, CUDA_POLICY, cuda_autocast_policy, installed

BF16, FP32 = torch.bfloat16, torch.float32


def _bf16(*shape):
    return torch.randn(*shape).to(BF16)


def _fp32(*shape):
    return torch.randn(*shape)


def _targets(n=4, classes=5):
    return torch.arange(n) % classes


# "CUDA Ops that can autocast to float32": bf16 inputs, fp32 output.
DOC_FP32_OPS = {
    "__pow__": lambda: _bf16(4, 5) ** 2,
    "__rdiv__": lambda: 1.0 / _bf16(4, 5),
    "__rpow__": lambda: 2.0 ** _bf16(4, 5),
    "acos": lambda: torch.acos(_bf16(4, 5).clamp(-1, 1)),
    "asin": lambda: torch.asin(_bf16(4, 5).clamp(-1, 1)),
    "binary_cross_entropy_with_logits": lambda: F.binary_cross_entropy_with_logits(
        _bf16(4, 5), torch.rand(4, 5).to(BF16)
    ),
    "cosh": lambda: torch.cosh(_bf16(4, 5)),
    "cosine_embedding_loss": lambda: F.cosine_embedding_loss(
        _bf16(4, 5), _bf16(4, 5), torch.ones(4)
    ),
    "cdist": lambda: torch.cdist(_bf16(4, 5), _bf16(3, 5)),
    "cosine_similarity": lambda: F.cosine_similarity(_bf16(4, 5), _bf16(4, 5)),
    "cross_entropy": lambda: F.cross_entropy(_bf16(4, 5), _targets()),
    "cumprod": lambda: torch.cumprod(_bf16(4, 5), 0),
    "cumsum": lambda: torch.cumsum(_bf16(4, 5), 0),
    "dist": lambda: torch.dist(_bf16(4, 5), _bf16(4, 5)),
    "erfinv": lambda: torch.erfinv(_bf16(4, 5).clamp(-0.9, 0.9)),
    "exp": lambda: torch.exp(_bf16(4, 5)),
    "expm1": lambda: torch.expm1(_bf16(4, 5)),
    "group_norm": lambda: F.group_norm(_bf16(2, 4, 3), 2),
    "hinge_embedding_loss": lambda: F.hinge_embedding_loss(_bf16(4, 5), torch.ones(4, 5)),
    "kl_div": lambda: F.kl_div(_bf16(4, 5), _bf16(4, 5), reduction="batchmean"),
    "l1_loss": lambda: F.l1_loss(_bf16(4, 5), _bf16(4, 5)),
    "layer_norm": lambda: F.layer_norm(_bf16(4, 5), (5,)),
    "log": lambda: torch.log(_bf16(4, 5).abs()),
    "log_softmax": lambda: F.log_softmax(_bf16(4, 5), -1),
    "log10": lambda: torch.log10(_bf16(4, 5).abs()),
    "log1p": lambda: torch.log1p(_bf16(4, 5).abs()),
    "log2": lambda: torch.log2(_bf16(4, 5).abs()),
    "margin_ranking_loss": lambda: F.margin_ranking_loss(_bf16(4), _bf16(4), torch.ones(4)),
    "mse_loss": lambda: F.mse_loss(_bf16(4, 5), _bf16(4, 5)),
    "multilabel_margin_loss": lambda: F.multilabel_margin_loss(
        _bf16(4, 5), torch.zeros(4, 5, dtype=torch.long)
    ),
    "multi_margin_loss": lambda: F.multi_margin_loss(_bf16(4, 5), _targets()),
    "nll_loss": lambda: F.nll_loss(_bf16(4, 5), _targets()),
    "norm": lambda: torch.norm(_bf16(4, 5)),
    "normalize": lambda: F.normalize(_bf16(4, 5)),
    "pdist": lambda: F.pdist(_bf16(4, 5)),
    "poisson_nll_loss": lambda: F.poisson_nll_loss(_bf16(4, 5), _bf16(4, 5).abs()),
    "pow": lambda: torch.pow(_bf16(4, 5), 3),
    "prod": lambda: torch.prod(_bf16(4, 5)),
    "reciprocal": lambda: torch.reciprocal(_bf16(4, 5)),
    "rsqrt": lambda: torch.rsqrt(_bf16(4, 5).abs()),
    "sinh": lambda: torch.sinh(_bf16(4, 5)),
    "smooth_l1_loss": lambda: F.smooth_l1_loss(_bf16(4, 5), _bf16(4, 5)),
    "soft_margin_loss": lambda: F.soft_margin_loss(_bf16(4, 5), torch.ones(4, 5)),
    "softmax": lambda: F.softmax(_bf16(4, 5), -1),
    "softmin": lambda: F.softmin(_bf16(4, 5), -1),
    "softplus": lambda: F.softplus(_bf16(4, 5)),
    "sum": lambda: torch.sum(_bf16(4, 5)),
    "sum(dim)": lambda: torch.sum(_bf16(4, 5), dim=1),
    "renorm": lambda: torch.renorm(_bf16(4, 5), 2, 0, 1.0),
    "tan": lambda: torch.tan(_bf16(4, 5)),
    "triplet_margin_loss": lambda: F.triplet_margin_loss(_bf16(4, 5), _bf16(4, 5), _bf16(4, 5)),
}

# "CUDA Ops that can autocast to float16" (here: to the autocast dtype): fp32 inputs.
DOC_LOWER_PRECISION_OPS = {
    "__matmul__": lambda: _fp32(4, 5) @ _fp32(5, 3),
    "addbmm": lambda: torch.addbmm(_fp32(4, 3), _fp32(2, 4, 5), _fp32(2, 5, 3)),
    "addmm": lambda: torch.addmm(_fp32(4, 3), _fp32(4, 5), _fp32(5, 3)),
    "addmv": lambda: torch.addmv(_fp32(4), _fp32(4, 5), _fp32(5)),
    "addr": lambda: torch.addr(_fp32(4, 5), _fp32(4), _fp32(5)),
    "baddbmm": lambda: torch.baddbmm(_fp32(2, 4, 3), _fp32(2, 4, 5), _fp32(2, 5, 3)),
    "bmm": lambda: torch.bmm(_fp32(2, 4, 5), _fp32(2, 5, 3)),
    "chain_matmul": lambda: torch.chain_matmul(_fp32(4, 5), _fp32(5, 3), _fp32(3, 2)),
    "multi_dot": lambda: torch.linalg.multi_dot([_fp32(4, 5), _fp32(5, 3)]),
    "conv1d": lambda: F.conv1d(_fp32(1, 2, 8), _fp32(3, 2, 3)),
    "conv2d": lambda: F.conv2d(_fp32(1, 2, 8, 8), _fp32(3, 2, 3, 3)),
    "conv3d": lambda: F.conv3d(_fp32(1, 2, 4, 4, 4), _fp32(3, 2, 2, 2, 2)),
    "conv_transpose1d": lambda: F.conv_transpose1d(_fp32(1, 2, 8), _fp32(2, 3, 3)),
    "conv_transpose2d": lambda: F.conv_transpose2d(_fp32(1, 2, 8, 8), _fp32(2, 3, 3, 3)),
    "conv_transpose3d": lambda: F.conv_transpose3d(_fp32(1, 2, 4, 4, 4), _fp32(2, 3, 2, 2, 2)),
    "GRUCell": lambda: torch.nn.GRUCell(5, 3)(_fp32(4, 5)),
    "linear": lambda: F.linear(_fp32(4, 5), _fp32(3, 5)),
    "LSTMCell": lambda: torch.nn.LSTMCell(5, 3)(_fp32(4, 5))[0],
    "matmul": lambda: torch.matmul(_fp32(4, 5), _fp32(5, 3)),
    "mm": lambda: torch.mm(_fp32(4, 5), _fp32(5, 3)),
    "mv": lambda: torch.mv(_fp32(4, 5), _fp32(5)),
    "prelu": lambda: F.prelu(_fp32(4, 5), _fp32(1)),
    "RNNCell": lambda: torch.nn.RNNCell(5, 3)(_fp32(4, 5)),
    "einsum": lambda: torch.einsum("ij,jk->ik", _fp32(4, 5), _fp32(5, 3)),
}

# "CUDA Ops that promote to the widest input type": one fp32 input wins.
DOC_PROMOTE_OPS = {
    "addcdiv": lambda a, b: torch.addcdiv(a(4), b(4), a(4).abs() + 1),
    "addcmul": lambda a, b: torch.addcmul(a(4), b(4), a(4)),
    "atan2": lambda a, b: torch.atan2(a(4), b(4)),
    "bilinear": lambda a, b: F.bilinear(a(2, 3), b(2, 4), a(5, 3, 4)),
    "cross": lambda a, b: torch.cross(a(2, 3), b(2, 3), dim=1),
    "dot": lambda a, b: torch.dot(a(4), b(4)),
    "grid_sample": lambda a, b: F.grid_sample(a(1, 1, 4, 4), b(1, 2, 2, 2) / 4, align_corners=False),
    "index_put": lambda a, b: a(4).index_put((torch.tensor([1]),), b(1)),
    "scatter_add": lambda a, b: a(4).scatter_add(0, torch.tensor([0, 1]), b(2)),
    "tensordot": lambda a, b: torch.tensordot(a(3, 4), b(4, 2), dims=1),
}


def _rms_norm():
    return F.rms_norm(_bf16(4, 5), (5,))


# torch >= 2.12 runs rms_norm in fp32 under CUDA autocast; older ones leave it to its input dtype, as CPU does
RMS_NORM_AUTOCASTS_ON_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")

# Ops whose CPU autocast result dtype differs from CUDA's: the proof that the context acts.
DIFFERS_ON_CPU = {
    **{k: (DOC_FP32_OPS[k], FP32) for k in ("softmax", "log_softmax", "layer_norm", "pow", "sum", "exp", "rsqrt", "cumsum", "normalize")},
    **{k: (DOC_LOWER_PRECISION_OPS[k], BF16) for k in ("addmv", "addr", "mv", "GRUCell", "LSTMCell")},
    **({"rms_norm": (_rms_norm, FP32)} if RMS_NORM_AUTOCASTS_ON_CUDA else {}),
    "interpolate": (lambda: F.interpolate(_bf16(1, 1, 4, 4), scale_factor=2.0), FP32),
    "grid_sample(bf16, bf16)": (lambda: DOC_PROMOTE_OPS["grid_sample"](_bf16, _bf16), BF16),
}


def _autocast():
    return torch.autocast("cpu", dtype=BF16)


def _softmax_dtype():
    with _autocast():
        return F.softmax(_bf16(2, 3), -1).dtype


@pytest.mark.parametrize("name", sorted(DOC_FP32_OPS))
def test_documented_cuda_fp32_ops_return_float32(name):
    with cuda_autocast_policy(), _autocast():
        assert DOC_FP32_OPS[name]().dtype == FP32


@pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated")
@pytest.mark.parametrize("name", sorted(DOC_LOWER_PRECISION_OPS))
def test_documented_cuda_lower_precision_ops_return_autocast_dtype(name):
    with cuda_autocast_policy(), _autocast():
        assert DOC_LOWER_PRECISION_OPS[name]().dtype == BF16


@pytest.mark.parametrize("name", sorted(DOC_PROMOTE_OPS))
def test_documented_cuda_promote_ops_run_in_widest_input_type(name):
    with cuda_autocast_policy(), _autocast():
        assert DOC_PROMOTE_OPS[name](_bf16, _fp32).dtype == FP32
        assert DOC_PROMOTE_OPS[name](_bf16, _bf16).dtype == BF16


@pytest.mark.parametrize("name", sorted(DIFFERS_ON_CPU))
def test_policy_changes_ops_where_cpu_autocast_differs_from_cuda(name):
    fn, cuda_dtype = DIFFERS_ON_CPU[name]
    with _autocast():
        assert fn().dtype != cuda_dtype  # plain CPU autocast
    with cuda_autocast_policy(), _autocast():
        assert fn().dtype == cuda_dtype


@pytest.mark.parametrize(
    "fn",
    [
        lambda: torch.trace(_bf16(4, 4)),
        lambda: F.max_pool3d(_bf16(1, 1, 4, 4, 4), 2),
        lambda: F.pad(_bf16(1, 2, 4), (1, 1), mode="reflect"),
        lambda: F.pad(_bf16(1, 2, 4), (1, 1), mode="replicate"),
    ],
    ids=["trace", "max_pool3d", "reflection_pad", "replication_pad"],
)
def test_ops_only_cpu_autocasts_run_in_their_input_dtype(fn):
    with _autocast():
        assert fn().dtype != BF16  # CPU autocast runs these in fp32
    with cuda_autocast_policy(), _autocast():
        out = fn()
    assert out.dtype == BF16


def test_mixed_dtype_dot_is_promoted_instead_of_failing_like_plain_cpu():
    with _autocast(), pytest.raises(RuntimeError):
        torch.dot(_bf16(4), _fp32(4))
    with cuda_autocast_policy(), _autocast():
        assert torch.dot(_bf16(4), _fp32(4)).dtype == FP32


def test_binary_cross_entropy_is_rejected_as_on_cuda():
    args = (torch.rand(4).to(BF16), torch.rand(4).to(BF16))
    with _autocast():
        assert F.binary_cross_entropy(*args).dtype == FP32
    with cuda_autocast_policy(), _autocast(), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(*args)


def test_explicit_dtype_and_float64_inputs_are_left_alone():
    with cuda_autocast_policy(), _autocast():
        assert F.softmax(_bf16(2, 3), -1, dtype=BF16).dtype == BF16
        assert torch.sum(_bf16(2, 3), dtype=BF16).dtype == BF16
        assert F.softmax(torch.randn(2, 3, dtype=torch.float64), -1).dtype == torch.float64
        assert F.linear(torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)).dtype == torch.float64
        assert torch.sum(torch.ones(3, dtype=torch.long)).dtype == torch.long


def test_norm_overloads_without_dtype_run_in_float32():
    x = _bf16(4, 5)
    with cuda_autocast_policy(), _autocast():
        assert torch.ops.aten.norm.Scalar(x).dtype == FP32
        assert torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1]).dtype == FP32
        assert torch.ops.aten.norm.Scalar(x.double()).dtype == torch.float64


def test_reductions_get_a_float32_dtype_argument_instead_of_a_float32_copy():
    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func, (kwargs or {}).get("dtype")))
            return func(*args, **(kwargs or {}))

    x = _bf16(4, 5)
    with cuda_autocast_policy(), _autocast(), Recorder() as rec:
        torch.sum(x)
    assert rec.calls == [(torch.ops.aten.sum.default, FP32)]  # no _to_copy of x


def test_policy_only_applies_inside_an_autocast_region():
    with cuda_autocast_policy():
        assert F.softmax(_bf16(2, 3), -1).dtype == BF16
        assert F.linear(_fp32(2, 3), _fp32(4, 3)).dtype == FP32


def test_exiting_restores_cpu_autocast_behaviour():
    original_clear = torch.clear_autocast_cache
    with cuda_autocast_policy():
        assert _softmax_dtype() == FP32
    assert _softmax_dtype() == BF16
    with _autocast():
        assert torch.prod(_bf16(3)).dtype == FP32  # PyTorch's own CPU fp32 kernel is back
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutocastCPU")
    (prod_autocast_cpu,) = [
        line for line in torch._C._dispatch_dump_table("aten::prod").splitlines()
        if line.startswith("AutocastCPU:")
    ]
    assert "autocast_mode.cpp" in prod_autocast_cpu
    assert torch.clear_autocast_cache is original_clear


def test_exiting_after_an_exception_restores_cpu_autocast_behaviour():
    with pytest.raises(ValueError), cuda_autocast_policy():
        raise ValueError
    assert _softmax_dtype() == BF16


def test_can_be_entered_repeatedly_and_nested():
    for _ in range(3):
        with cuda_autocast_policy():
            assert _softmax_dtype() == FP32
            with cuda_autocast_policy():
                assert _softmax_dtype() == FP32
            assert _softmax_dtype() == FP32  # inner exit keeps the outer registration
        assert _softmax_dtype() == BF16


def test_works_on_fake_tensors_forward_and_backward():
    with FakeTensorMode():
        lin = torch.nn.Linear(8, 16)
        norm = torch.nn.LayerNorm(16)
        x = torch.randn(4, 8)
        with cuda_autocast_policy():
            with _autocast():
                h = lin(x)
                y = norm(h.to(BF16))
                probs = F.softmax(y, -1)
                loss = F.cross_entropy(h, torch.zeros(4, dtype=torch.long))
                z = torch.einsum("oi,bi->bo", lin.weight, x)  # Python kernel, cached weight cast
            assert isinstance(z, FakeTensor)
            assert (h.dtype, y.dtype, probs.dtype, loss.dtype, z.dtype) == (BF16, FP32, FP32, FP32, BF16)
            (loss + probs.sum() + z.sum()).backward()
        assert lin.weight.grad.dtype == FP32 and lin.weight.grad.shape == (16, 8)
        assert norm.weight.grad.dtype == FP32


def _saved_dtypes(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        out = fn()
    return out, saved


def test_backward_saves_the_cast_tensors():
    x = _bf16(4, 5).requires_grad_()
    w = torch.nn.Parameter(_fp32(5, 3))
    with cuda_autocast_policy(), _autocast():
        out, saved = _saved_dtypes(lambda: F.layer_norm(x, (5,)).sum())
        assert saved and set(saved) == {FP32}  # fp32 copy of the bf16 input, as on CUDA
        out.backward()
        out2, saved2 = _saved_dtypes(lambda: torch.einsum("ij,jk->ik", x.float(), w).sum())
        assert set(saved2) == {BF16}
        out2.backward()
    assert x.grad.dtype == BF16 and w.grad.dtype == FP32
    with _autocast():
        _, saved_cpu = _saved_dtypes(lambda: F.layer_norm(x, (5,)).sum())
    assert BF16 in saved_cpu  # plain CPU autocast saves bf16


def _weight_cast_node(out):
    """The autograd node of the bf16 copy of the Parameter (ToCopyBackward0)."""
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith("ToCopyBackward") and any(
            type(n).__name__ == "AccumulateGrad" for n, _ in node.next_functions
        ):
            return node
        stack.extend(n for n, _ in node.next_functions)
    raise AssertionError("no cast of a leaf found")


def test_parameter_casts_are_cached_for_the_autocast_region_like_cuda():
    w = torch.nn.Parameter(_fp32(5, 5))
    x = _fp32(5)
    with cuda_autocast_policy():
        with _autocast():
            first, second = torch.mv(w, x), torch.mv(w, x)  # mv: Python (CUDA-policy) kernel
            assert _weight_cast_node(first) is _weight_cast_node(second)
        with _autocast():
            assert _weight_cast_node(torch.mv(w, x)) is not _weight_cast_node(first)
        with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
            assert _weight_cast_node(torch.mv(w, x)) is not _weight_cast_node(torch.mv(w, x))
    assert len(autocast_policy._cast_cache) == 0


def test_op_lists_match_the_kernels_registered_in_the_installed_torch():
    def registered(key):
        return {
            name.removeprefix("aten::").removesuffix(".default")
            for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::")
            and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
        }

    def normalized(names):
        return {n.removesuffix(".default") for n in names}

    # the lists are torch 2.13's; an older torch autocasts a subset of them (see the next test)
    exact = torch.__version__.startswith("2.13.")
    for key, policy in (("AutocastCUDA", CUDA_POLICY), ("AutocastCPU", CPU_POLICY)):
        assert registered(key) == normalized(installed(policy, key))
        assert registered(key) == normalized(policy) if exact else registered(key) <= normalized(policy)


def test_only_ops_the_installed_torch_autocasts_on_a_device_get_that_devices_policy():
    # relu is autocast on neither device, and an op this torch lacks is not one; rms_norm's fp32 policy on
    # CUDA applies where the installed torch registers it (2.12 on)
    policy = {"relu": "fp32", "no_such_op": "fp32", "rms_norm": "fp32", "mm": "lower_precision_fp"}
    cuda = installed(policy, "AutocastCUDA")
    assert cuda.keys() == {"mm"} | ({"rms_norm"} if RMS_NORM_AUTOCASTS_ON_CUDA else set())
    assert installed(policy, "AutocastCPU") == {"mm": "lower_precision_fp"}
    with cuda_autocast_policy(), _autocast():
        assert _rms_norm().dtype == (FP32 if RMS_NORM_AUTOCASTS_ON_CUDA else BF16)


_CUDA_COMPARABLE = {
    **DOC_FP32_OPS,
    **DOC_LOWER_PRECISION_OPS,
    **{f"promote {k}": (lambda k=k: DOC_PROMOTE_OPS[k](_bf16, _fp32)) for k in DOC_PROMOTE_OPS},
    **{k: fn for k, (fn, _) in DIFFERS_ON_CPU.items()},
    "rms_norm": _rms_norm,
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated")
@pytest.mark.parametrize("name", sorted(_CUDA_COMPARABLE))
def test_emulated_dtypes_match_real_cuda_autocast(name):
    fn = _CUDA_COMPARABLE[name]
    with torch.device("cuda"), torch.autocast("cuda", dtype=BF16):
        expected = fn().dtype
    with cuda_autocast_policy(), _autocast():
        assert fn().dtype == expected


class CastOrder(TorchDispatchMode):
    """The shapes autocast casts, in the order it casts them."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_emulated_kernels_cast_in_the_order_the_cpp_wrappers_do():
    """A C++ autocast wrapper casts its arguments in the order this build evaluates a call's arguments (the
    CPU and CUDA wrappers are one template): conv2d's CPU kernel, C++ here, casts the bias, the weight, then the
    input. aten.convolution is autocast by CUDA only, so the policy gives it a Python kernel: it must cast in
    that same order, which decides where the copies land in the allocator."""
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 4, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), CastOrder() as cpp:
        F.conv2d(x, w, b, stride=4)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16), CastOrder() as emulated:
        torch.ops.aten.convolution(x, w, b, [4, 4], [0, 0], [1, 1], False, [0, 0], 1)
    assert cpp.shapes == [(4,), (4, 3, 4, 4), (2, 3, 8, 8)]
    assert emulated.shapes == cpp.shapes
