"""FakeTensorMode made cheaper per op, with the same answers: views and constants' values answered directly, and a
cheaper cache key.

An estimate point's time is the per-op cost of its aten ops through FakeTensorMode. Answered here, each only where the
answer is FakeTensorMode's own: views (torch's meta kernel, without the dispatch cache), a fake's cache key (one tuple
of its metadata, while torch's key is made of `_KEYED_FIELDS`), `.item()` of a constant fake, elementwise foreach ops,
`empty` / `empty_strided`, `zeros_like` / `empty_like`, `copy_` / `_to_copy` and `cat` of contiguous fakes, c10d
collectives on a fake process group, and the tracker's own dispatch (answer_from_above); anything else (constants,
foreign subclasses, symbolic shapes, other layouts) goes to FakeTensorMode. Not a speed-up: integer host ops run on
real tensors inside fake_patches.host_index_tensors_real. Each answer and why it is the same: docs/estimate.md;
tests/test_fast_fake.py and the estimate == cpu tests check them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode, TensorMetadata
from torch._subclasses.fake_tensor import in_kernel_invocation_manager
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import SUPPORTED_NODES, is_namedtuple_instance, tree_flatten, tree_map_only

from vlmprobe.estimate.fake_patches import HOST_INDEX_TENSORS_REAL
from vlmprobe.estimate.tracker import aliases_inputs

__all__ = ["empty_strided", "FastFakeTensorMode", "session_mode"]


# a view autograd does not track as one (matmul's reshapes): FakeTensorMode answers it with view's own code, but
# never from its cache, so it paid the whole dispatch (630 a nanoVLM-222M step pair, ~0.5 ms each)
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_ITEM = torch.ops.aten._local_scalar_dense.default
_PLAIN = {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
_REAL_NUMBER = {int, float, bool}
_EMPTY_STRIDED = torch.ops.aten.empty_strided.default
_EMPTY = {torch.ops.aten.empty.memory_format, _EMPTY_STRIDED}
_LIKE = {torch.ops.aten.zeros_like.default, torch.ops.aten.empty_like.default}
_TO_COPY = torch.ops.aten._to_copy.default
_COPIES = {torch.ops.aten.copy_.default, _TO_COPY}
_CAT = torch.ops.aten.cat.default
_CATS = {_CAT, torch.ops.aten.cat.out}
_NOT_ANSWERED = object()
# foreach ops that apply one elementwise op per list position (the optimizers' own: torch.optim's adam, adamw,
# sgd, adagrad, rmsprop): an operand's i-th tensors in, one output of their layout out (module doc, 4.)
_ELEMENTWISE_FOREACH = {"add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "neg", "reciprocal",
                        "maximum", "minimum", "clamp_min", "clamp_max", "abs", "sign", "exp", "zero", "pow"}
# the fields of torch's per-tensor key that the fast key covers: memory_format through shape and stride; the
# sparse ones (is_sparse, is_coalesced, dense_dim, sparse_dim) are fixed for a strided tensor
_KEYED_FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
                 "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
                 "dense_dim", "sparse_dim")
_FAST_KEY = (tuple(field.name for field in dataclasses.fields(TensorMetadata)) == _KEYED_FIELDS
             and list(inspect.signature(FakeTensorMode._prep_args_for_hash).parameters)
             == ["self", "result", "args", "state", "id_hashed_objects"])


class FastFakeTensorMode(FakeTensorMode):
    # FakeTensorMode's own __torch_dispatch__ without its torch._dynamo.disable wrapper, as for the tracker
    # (LiveBytesTracker._should_skip_dynamo): no estimate compiles
    __torch_dispatch__ = getattr(FakeTensorMode.__torch_dispatch__, "__wrapped__", FakeTensorMode.__torch_dispatch__)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if HOST_INDEX_TENSORS_REAL.get() and real_integer_op(args, kwargs):  # not a speed-up: see fake_patches
            with no_dispatch():
                return func(*args, **kwargs)
        answer = _ANSWERS.get(func, _UNKNOWN)
        if answer is _UNKNOWN:  # looked up once an op: its name's checks cost more than the op's hash
            answer = _ANSWERS[func] = _answer_for(func)
        if answer is not None and self.shape_env is None and (answer is _item or not self.propagate_real_tensors):
            answered = answer(self, func, args, kwargs)
            if answered is not _NOT_ANSWERED:
                return answered
        return super().dispatch(func, types, args, kwargs)

    def answer_from_above(self, func, types, args, kwargs):
        """What this mode's __torch_dispatch__ answers for `func`, called by the mode right above it (10.)."""
        torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        try:
            return self.dispatch(func, types, args, kwargs)
        finally:
            torch._C._set_dispatch_mode(self)

    def wrap(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """FakeTensor(self, elem, device): the fake of meta tensor `elem` on `device`, as torch's constructor makes
        it (6.), made directly for a CPU device."""
        state = _fake_state()
        if (type(device) is not torch.device or device.type != "cpu" or state is None or FakeTensorConfig.debug
                or torch.compiler.is_exporting()):
            return FakeTensor(self, elem, device)
        made = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                           device_for_backend_keys=device)
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(made)
        else:
            torch._C._set_throw_on_mutable_data_ptr(made)
        attributes = made.__dict__
        attributes.update(state)
        attributes["_fake_device"], attributes["fake_mode"] = device, self
        return made

    def _like(self, args, kwargs) -> FakeTensor | None:
        """`zeros_like` / `empty_like` of a non-constant fake of this mode with contiguous strides (8.), or None."""
        source = args[0] if len(args) == 1 else None
        if (type(source) is not FakeTensor or source.fake_mode is not self or source.constant is not None
                or source.stride() != _contiguous_strides(source.shape)
                or kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory")
                or kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format)
                or kwargs.get("device") not in (None, source.fake_device)
                or not set(kwargs) <= {"dtype", "layout", "device", "pin_memory", "memory_format"}):
            return None
        dtype = kwargs.get("dtype") or source.dtype
        with no_dispatch():
            made = torch.empty_strided(source.shape, source.stride(), dtype=dtype, device="meta")
        return self.wrap(made, source.fake_device)

    def _copy(self, func, args, kwargs) -> FakeTensor | None:
        """`copy_` into, or `_to_copy` of, a non-constant fake of this mode with contiguous strides (9.), or None."""
        target = args[0] if args else None
        if (type(target) is not FakeTensor or target.fake_mode is not self or target.constant is not None
                or target.stride() != _contiguous_strides(target.shape)):
            return None
        if func is _TO_COPY:
            rest = {k: v for k, v in kwargs.items() if k != "non_blocking"}
            return self._like(args, rest) if len(args) == 1 else None
        source = args[1] if len(args) in (2, 3) and set(kwargs) <= {"non_blocking"} else None
        if (type(source) is not FakeTensor or source.fake_mode is not self or source.constant is not None
                or source.shape != target.shape or (source.is_complex() and not target.is_complex())):
            return None
        return target

    def _cat(self, func, args, kwargs) -> FakeTensor | None:
        """`cat` of fakes of one dtype, device and rank (at most 3) with contiguous strides, equal but along
        `dim`, or `cat.out` into such a fake of the result's shape (11.); else None."""
        if func is _CAT:
            if len(args) not in (1, 2) or kwargs:
                return None
            out = None
        elif len(args) not in (1, 2) or set(kwargs) != {"out"}:
            return None
        else:
            out = kwargs["out"]
        tensors, dim = args[0], args[1] if len(args) == 2 else 0
        first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else None
        if type(first) is not FakeTensor or type(dim) is not int or not 1 <= first.dim() <= 3:
            return None
        rank, dtype, device = first.dim(), first.dtype, first.fake_device
        if not -rank <= dim < rank:
            return None
        dim %= rank
        shape = list(first.shape)
        shape[dim] = 0
        for t in tensors:
            if (type(t) is not FakeTensor or t.fake_mode is not self or t.constant is not None or t.dtype != dtype
                    or t.fake_device != device or t.dim() != rank
                    or any(n != shape[i] for i, n in enumerate(t.shape) if i != dim)
                    or t.stride() != _contiguous_strides(t.shape)):
                return None
            shape[dim] += t.shape[dim]
        if out is None:
            with no_dispatch():
                return self.wrap(torch.empty(shape, dtype=dtype, device="meta"), device)
        if (type(out) is not FakeTensor or out.fake_mode is not self or out.constant is not None or out.dtype != dtype
                or out.fake_device != device or list(out.shape) != shape
                or out.stride() != _contiguous_strides(out.shape)
                or any(t.untyped_storage()._cdata == out.untyped_storage()._cdata for t in tensors)):
            return None  # (an input in the output's memory: torch refuses it)
        return out

    def _collective(self, func, args, kwargs):
        """A c10d collective's outputs (the tensors it wrote, a Work) from its meta kernel, as FakeTensorMode runs it
        (7.), where every tensor it takes is a non-constant fake of this mode on one device; else _NOT_ANSWERED."""
        if not _has_meta_kernel(func):
            return _NOT_ANSWERED
        tensors = _tensors_within((*args, *kwargs.values()), [])
        if tensors is None:  # another container than a list or tuple: pytree's walk
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors or any(type(t) is not FakeTensor or t.fake_mode is not self or t.constant is not None
                              for t in tensors):
            return _NOT_ANSWERED
        device = tensors[0].fake_device
        if any(t.fake_device != device for t in tensors):
            return _NOT_ANSWERED
        with in_kernel_invocation_manager(self):
            out = func(*args, **kwargs)
        return _map_tensors(out, lambda t: t if type(t) is FakeTensor else self.wrap(t, device))

    def _empty(self, func, args, kwargs) -> FakeTensor | None:
        """An empty tensor as FakeTensorMode's rule for constructors makes it (module doc, 5.), or None where
        that rule is not the one alone that applies."""
        device = kwargs.get("device")
        if (kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory")
                or not all(type(n) is int for sizes in args for n in sizes)
                or (device is not None and (not isinstance(device, torch.device) or device.type == "meta"))):
            return None
        with in_kernel_invocation_manager(self):
            made = func(*args, **{**kwargs, "device": torch.device("meta")})
        return self.wrap(made, device if device is not None else torch.device("cpu"))

    def _elementwise_foreach(self, func, args, kwargs):
        """An elementwise foreach op's outputs (None for an in-place one) where they follow from its operands
        alone (module doc, 4.); else _NOT_ANSWERED."""
        name = func._schema.name.removeprefix("aten::_foreach_")
        if name.rstrip("_") not in _ELEMENTWISE_FOREACH or "out" in func._overloadname:
            return _NOT_ANSWERED
        lists = []
        for value in (*args, *kwargs.values()):
            if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                lists.append(value)
            elif isinstance(value, (list, tuple)):
                if not all(type(v) in _REAL_NUMBER for v in value):
                    return _NOT_ANSWERED
            elif type(value) not in _REAL_NUMBER and value is not None:
                return _NOT_ANSWERED  # a tensor scalar (promotes by its own rules), or anything else
        if not lists or any(len(tensors) != len(lists[0]) for tensors in lists):
            return _NOT_ANSWERED
        outputs = []
        for operands in zip(*lists):
            first = operands[0]
            layout = _foreach_layout(first, self)
            if layout is None or not first.dtype.is_floating_point \
                    or any(t is not first and _foreach_layout(t, self) != layout for t in operands[1:]):
                return _NOT_ANSWERED
            outputs.append(layout)
        if name.endswith("_"):
            return None
        with no_dispatch():
            return [self.wrap(torch.empty_strided(size, stride, dtype=dtype, device="meta"), device)
                    for size, stride, dtype, device in outputs]

    def _prep_args_for_hash(self, result, args, *rest):
        """torch's (FakeTensorMode._cache_key calls it on the op's args and kwargs, and on what they hold), with
        this mode's fakes and plain values appended directly (see the module doc). The encoding stays one that
        reads back one way only: every list or tuple is its type, then its length (an int, where torch's
        own, used for anything else, writes a "length_N" string), then its items; a fake is one tuple; a plain
        value its type, then itself."""
        if not _FAST_KEY or self.shape_env is not None or isinstance(args, dict):
            return super()._prep_args_for_hash(result, args, *rest)
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(len(args))
        for arg in args:
            if type(arg) is FakeTensor and arg.fake_mode is self and arg.constant is None \
                    and arg.layout is torch.strided:
                result.append((FakeTensor, arg.dtype, arg.shape, arg.stride(), arg.fake_device, arg.layout,
                               arg.storage_offset(), arg.untyped_storage().nbytes(), arg.requires_grad,
                               arg.is_quantized, arg.is_conj(), arg.is_neg(), arg.is_inference()))
            elif type(arg) in _PLAIN:
                result.append(type(arg))
                result.append(arg)
            elif isinstance(arg, (list, tuple)):
                self._prep_args_for_hash(result, arg, *rest)
            else:  # torch's rules: other tensors (which bypass the cache), symbolic values, callables, dicts
                super()._prep_args_for_hash(result, (arg,), *rest)


def _item(mode, func, args, kwargs):
    """`.item()` of a constant fake: the constant's (3.)."""
    source = args[0]
    if type(source) is FakeTensor and source.fake_mode is mode and source.constant is not None:
        with no_dispatch():
            return func(source.constant)
    return _NOT_ANSWERED


def _view(mode, func, args, kwargs):
    """A view of the op's one tensor, a non-constant fake of `mode`, by the op's meta kernel (1.)."""
    source = only_tensor(args, kwargs)
    if type(source) is not FakeTensor or source.fake_mode is not mode or source.constant is not None:
        return _NOT_ANSWERED
    with in_kernel_invocation_manager(mode):
        out = func(*args, **kwargs)
    # what wrap_meta_outputs_with_default_device_logic makes of it: the one input's device is the common
    # device, each new meta output becomes a FakeTensor there (its memo of the meta tensor is left out: nothing
    # else holds that tensor), an output that is the input itself stays as is
    device = source.fake_device
    wrap = lambda t: t if type(t) is FakeTensor else mode.wrap(t, device)  # noqa: E731
    return type(out)(map(wrap, out)) if isinstance(out, (list, tuple)) else wrap(out)


def _or_not_answered(method):
    """A FastFakeTensorMode method that returns None where it does not answer, as an answer of _ANSWERS."""
    def answer(mode, func, args, kwargs):
        made = method(mode, func, args, kwargs)
        return _NOT_ANSWERED if made is None else made

    return answer


def _answer_for(func):
    """The function that may answer `func` directly (module doc), or None: FakeTensorMode's dispatch alone."""
    if func is _ITEM:
        return _item
    if func in _EMPTY:
        return _or_not_answered(FastFakeTensorMode._empty)
    if func.__name__.startswith("_foreach_"):
        return FastFakeTensorMode._elementwise_foreach
    if func in _LIKE:
        return _or_not_answered(lambda mode, func, args, kwargs: mode._like(args, kwargs))
    if func in _COPIES:
        return _or_not_answered(FastFakeTensorMode._copy)
    if func in _CATS:
        return _or_not_answered(FastFakeTensorMode._cat)
    if func.namespace == "c10d":
        return FastFakeTensorMode._collective
    if aliases_inputs(func) or func is _UNSAFE_VIEW:
        return _view
    return None


_UNKNOWN = object()
_ANSWERS: dict = {}  # op -> _answer_for(op), filled as ops are met


def _tensors_within(values, found: list) -> list | None:
    """The tensors among `values` and in the lists and tuples they hold, in pytree's order; None where one holds
    another of pytree's containers (a dict, a named tuple): pytree's walk is the one to take. A plain walk:
    pytree's cost ~0.1 ms of a collective."""
    for value in values:
        kind = type(value)
        if kind is list or kind is tuple:
            if _tensors_within(value, found) is None:
                return None
        elif isinstance(value, torch.Tensor):
            found.append(value)
        elif kind in SUPPORTED_NODES or is_namedtuple_instance(value):
            return None
    return found


def _map_tensors(value, fn):
    """`value` with fn(tensor) for each tensor in it and in the lists and tuples it holds, in one plain walk;
    another of pytree's containers inside is mapped by pytree."""
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(_map_tensors(v, fn) for v in value)
    if isinstance(value, torch.Tensor):
        return fn(value)
    if kind in SUPPORTED_NODES or is_namedtuple_instance(value):
        return tree_map_only(torch.Tensor, fn, value)
    return value


def _foreach_layout(t, mode) -> tuple | None:
    """(size, stride, dtype, device) of a contiguous, non-constant fake of `mode`; else None."""
    if type(t) is not FakeTensor or t.fake_mode is not mode or t.constant is not None or t.layout is not torch.strided \
            or not t.is_contiguous():
        return None
    return tuple(t.shape), t.stride(), t.dtype, t.fake_device


def only_tensor(args, kwargs):
    """The op's first argument when it is its only tensor (a view's `self`; a plain loop, as pytree costs more
    than the view itself), else None."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return None
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, torch.Tensor) or (
                isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)):
            return None
    return first


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@functools.cache
def _has_meta_kernel(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "Meta")


@functools.cache
def session_mode() -> FastFakeTensorMode:
    """The fake mode every estimate session of this process enters (vlmprobe.backends.estimate): one, so that a
    model built in one session runs in the next (vlmprobe.estimate.replay.built_models); a fake tensor belongs to the mode
    that made it, and FakeTensorMode refuses another's. Its state between sessions is none that changes an answer:
    the dispatch cache is torch's, one a process already, and the memo of real tensors made fake holds each only
    while that real tensor lives. allow_non_fake_inputs: module buffers made from Python constants may be real."""
    return FastFakeTensorMode(allow_non_fake_inputs=True)


@functools.cache
def _fake_state() -> dict | None:
    """The attributes torch's FakeTensor constructor gives a fake of a meta tensor on the CPU, other than its
    device and mode (the value memos, all None), or None where they are not all None in this torch: then
    FastFakeTensorMode.wrap leaves every fake to torch's constructor."""
    with no_dispatch():
        made = FakeTensor(FakeTensorMode(), torch.empty(0, device="meta"), torch.device("cpu"))
    state = {k: v for k, v in made.__dict__.items() if k not in ("_fake_device", "fake_mode")}
    return state if all(v is None for v in state.values()) else None


def empty_strided(tracker, size, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty_strided(size, stride, dtype=dtype, device=device) as an estimate session's mode stack makes it
    (this module's fast fake mode at the bottom, `tracker` alone above it): the fake mode's answer (5.), charged
    by the tracker as its __torch_dispatch__ charges a constructor's output, without the call's trip through the
    dispatcher and both modes (0.23 ms a call against 0.07 ms here; a replay makes thousands: each replayed
    step's gradients and state tensors). On any other stack, or where the fake mode would not answer the call
    alone, the call itself."""
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if (type(fake) is FastFakeTensorMode and torch._C._len_torch_dispatch_stack() == 2
            and _get_current_dispatch_mode() is tracker and not torch._C._len_torch_function_stack()
            and not fake.propagate_real_tensors and fake.shape_env is None
            and not (HOST_INDEX_TENSORS_REAL.get() and not dtype.is_floating_point and not dtype.is_complex)):
        made = fake._empty(_EMPTY_STRIDED, (size, stride), {"dtype": dtype, "device": device})
        if made is not None:
            tracker.charge_constructed(made)
            return made
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def real_integer_op(args, kwargs) -> bool:
    """Whether every tensor the op takes is a real one of an integer dtype, or, taking none, it makes one of an
    integer dtype (fake_patches.host_index_tensors_real)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        dtype = kwargs.get("dtype")
        return dtype is not None and not dtype.is_floating_point and not dtype.is_complex
    return all(not isinstance(t, FakeTensor) and not t.is_floating_point() and not t.is_complex() for t in tensors)
