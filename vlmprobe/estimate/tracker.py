"""Live tensor storages, charged the way the CUDA caching allocator would charge them.

Used by the cpu backend (real CPU tensors) and the estimate backend (fake tensors): a TorchDispatchMode sees every
aten op below autograd (forward, saved tensors, backward, optimizer alike). Each new storage an op returns is
allocated from the allocator model (vlmprobe.estimate.allocator) in the order the ops run, and freed there when it
dies, or resized in place (`resize_`); the figures are that model's. Host storages (`track_host()`, offload) are
counted apart. What CUDA allocates that no op returns, or returns differently (vlmprobe.estimate.cuda_rules), and
cuBLAS workspaces are charged where CUDA makes them. Storages from before the tracker starts and tensors made from
Python data (`torch.tensor(...)`) are not counted. The details: docs/estimate.md.

What filled the memory at an out-of-memory (`Attribution`, on where a capacity makes one possible): each block of the
allocator model is labelled when it is allocated with the module whose forward (forward pre/post hooks on the model's
own modules) or backward (a hook on each module output's gradient: the module whose output gradient came last) runs,
the phase (steps.common.PhaseClock) and its tensor's dtype; a replayed step's blocks take the labels of the step it
replays. When the model runs out, the live blocks are grouped by (module, kind, dtype), a kind read from what holds
them (weights, gradients, optimizer state) or from the phase they were made in; the index of a block in a ModuleList
is shown as * (layers.*.mlp), so a tower's layers make one group rather than one each. Hooks, not torch's ModuleTracker:
its multi-grad hooks hold every output gradient of a module until the last one arrives, which changes the frees
(torch/autograd/graph.py register_multi_grad_hook, mode "all", torch 2.13). Limits: a module's backward is known only
from its outputs' gradients, so ops between two modules' backwards go to the one before; a replayed tower block's
(vlmprobe.estimate.replay.blocks) own modules are not hooked (hooks would stop the replay), so its blocks go to the
tower; blocks made while loading, not weights, carry no dtype (a kept model's replayed build has none); a GRPO / DPO
reference model is not hooked (its weights count as made while loading, its activations as of no module), and
FSDP2's gathered parameters count as activations of the module that gathered them.
"""

from __future__ import annotations

import contextvars
import functools
import weakref

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor
from torch._subclasses.fake_tensor import _device_handler as _fake_device
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from vlmprobe.estimate.allocator import CachingAllocatorModel
from vlmprobe.estimate.cuda_rules import embedding_backward, kernel_copies, reduction_staging
from vlmprobe.estimate.cuda_rules.gradient_sums import first_summand
from vlmprobe.gpu.alloc_conf import AllocatorSettings
from vlmprobe.sizes import in_words

__all__ = ["aliases_inputs", "AllocationLog", "Attribution", "collapsed_names", "filled_text", "KINDS", "TRAINING_STATE",
           "LiveBytesTracker", "PLACEMENT"]

_DEVICE = torch.ops.prim.device.default
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_FROM_PYTHON_DATA = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
# The ops CUDA runs through cuBLAS / cuBLASLt (aten's blas kernels), whose first call on a thread makes that
# thread's workspace. Convolutions (cuDNN), attention kernels and elementwise ops take none.
_BLAS_OPS = frozenset(getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "addmm_", "_addmm_activation", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "mv",
    "addmv", "addmv_", "dot", "vdot", "_scaled_mm", "_int_mm"))
# "host" or "device": where the storages made now live, set around a call by the code that names a side; None:
# where the op's inputs are
PLACEMENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("placement", default=None)


class LiveBytesTracker(TorchDispatchMode):
    """Allocates every new storage from a caching-allocator model; with a `capacity` (device bytes), a
    segment that does not fit raises OutOfMemoryError as CUDA would. `settings` and `allowed_maximum`: the
    allocator settings and memory fraction the model applies (vlmprobe.gpu.alloc_conf).

    `blas_workspaces`: the blocks (bytes) of the cuBLAS workspace a thread's first matrix multiply makes on the
    target card (vlmprobe.gpu.device_profile.workspace_blocks; none without a card). torch keeps one
    workspace per (cuBLAS handle, stream) until the process exits (CublasHandlePool.cpp,
    cublas_handle_stream_to_workspace, allocated through the caching allocator right after the op's output),
    and a thread keeps its handle (DeviceThreadHandlePool). A training step runs its matrix multiplies on two
    threads: the forward (and the generation, the reference model) on the calling thread, the backward on
    autograd's device thread for CUDA tensors. So two workspaces, the first at the forward's first multiply,
    the second at the backward's, both alive to the end: the first backward op (the loss's) runs before the
    second exists. On an H100 the estimate without them was 57-74 MiB below each of the 8 measured seq_len peaks
    and 64-98 MiB below the 4 Qwen2-VL-2B ones; two Hopper workspaces are 64 MiB (results/gpu_check/)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._dynamo.disable unless this says no:
        # it keeps torch.compile out of dispatch frames, and no estimate compiles, so each of a point's ~68k ops
        # would pay for the wrapper (it saves, clears and restores the frame-evaluation hook) for nothing
        return False

    def __init__(self, capacity: int | None = None, answer_fake_scalar_reads: bool = False,
                 settings: AllocatorSettings | None = None, allowed_maximum: int | None = None,
                 blas_workspaces: tuple[int, ...] = (), reduction_card: reduction_staging.Card | None = None):
        super().__init__()
        self.allocator = CachingAllocatorModel(capacity, settings, allowed_maximum)
        self.blas_workspaces = blas_workspaces
        self.reduction_card = reduction_card  # the target card's multiprocessors, for reductions' staging buffers
        self._blas_threads: set[str] = set()  # the threads ("forward", "backward") whose workspace is made
        self._blas_pending = bool(blas_workspaces)  # a thread's workspace is still to make
        self.answer_fake_scalar_reads = answer_fake_scalar_reads
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> (handle, finalizer)
        self._open = True  # storages that die after the measurement are not freed into the model
        self._host: weakref.WeakKeyDictionary | None = None  # storage -> bytes, while host memory is told apart
        self.host_current = self.host_peak = 0
        self.log: AllocationLog | None = None  # while set, every device allocation and free is logged in it
        self.after_free: dict[int, object] = {}  # handle -> callable(), called once that block is freed
        self.below = None  # the fast fake mode beneath this one, where it answers calls directly (_call)
        self.attribution: Attribution | None = None  # while set, every block labelled (attribute())

    def attribute(self) -> Attribution:
        """Label every block from now on, for what filled the memory at an out-of-memory (module doc)."""
        if self.attribution is None:
            self.attribution = self.allocator.watcher = Attribution()
        return self.attribution

    def track_host(self) -> None:
        """Tell host from device memory from now on (see the module doc)."""
        if self._host is None:
            self._host = weakref.WeakKeyDictionary()

    @property
    def host_tracked(self) -> bool:
        return self._host is not None

    def on_host(self, tensor: torch.Tensor) -> bool:
        return self._host is not None and tensor.untyped_storage() in self._host

    @property
    def current(self) -> int:
        """Bytes allocated now (memory_allocated)."""
        return self.allocator.allocated

    @property
    def peak(self) -> int:
        """Peak allocated since the last reset_peak() (max_memory_allocated)."""
        return self.allocator.peak_allocated

    def reset_peak(self) -> None:
        self.allocator.reset_peak()

    def _charge(self, storage, on_host: bool = False) -> None:
        if on_host:
            self._host[storage] = cell = [storage.nbytes()]  # a cell: resize_ changes it, the finalizer reads it
            self._seen.add(storage)
            self.host_current += storage.nbytes()
            self.host_peak = max(self.host_peak, self.host_current)
            weakref.finalize(storage, self._free_host, cell).atexit = False
            return
        self.adopt(storage, self.malloc_block(storage.nbytes()))

    def adopt(self, storage, handle: int) -> None:
        """Charge live `storage` with block `handle` of the allocator model, allocated for it already: freed into
        the model when the storage dies. _charge's, and a replayed build's for the storages of a kept model
        (vlmprobe.estimate.replay.built_models)."""
        self._seen.add(storage)
        finalizer = weakref.finalize(storage, self._free, handle)
        finalizer.atexit = False  # nothing to free into at exit
        self._blocks[storage] = (handle, finalizer)

    def charged(self) -> list[tuple[object, int]]:
        """(storage, handle) of each live device storage this tracker charged."""
        return [(storage, handle) for storage, (handle, _) in list(self._blocks.items())]

    def _free(self, handle: int) -> None:
        if self._open:
            self.allocator.free(handle)
            if self.log is not None:
                self.log.free(handle)
            if self.after_free:
                callback = self.after_free.pop(handle, None)
                if callback is not None:
                    callback()

    def charge_constructed(self, tensor: torch.Tensor) -> None:
        """Charge `tensor`'s storage as __torch_dispatch__ charges the output of a constructor (an op that takes no
        tensor), for a caller that made it with the mode below this one (fast_fake.empty_strided)."""
        self._charge(tensor.untyped_storage(), self._host is not None and self._placed_on_host((), {}))

    def malloc_block(self, nbytes: int) -> int:
        """A bare block of the allocator model (no storage), logged as a storage's would be; free_block frees it."""
        handle = self.allocator.malloc(nbytes)
        if self.log is not None:
            self.log.malloc(handle, nbytes, self.attribution.last if self.attribution is not None and handle else None)
        return handle

    def free_block(self, handle: int) -> None:
        self._free(handle)

    def release(self, storage) -> bool:
        """Free the block of a device storage this tracker charged now, as if it had died here; its later death
        frees nothing. For a replay whose logged step freed this storage here, while Python still holds it. False
        if no block of it is live."""
        handle, finalizer = self._blocks.pop(storage, (None, None))
        if finalizer is None or finalizer.detach() is None:
            return False
        self._free(handle)
        return True

    def handle_of(self, storage) -> int | None:
        """The allocator model's handle of a device storage this tracker charged (None for any other)."""
        entry = self._blocks.get(storage)
        return None if entry is None else entry[0]

    def _free_host(self, cell: list[int]) -> None:
        if self._open:
            self.host_current -= cell[0]

    def _resized(self, storage) -> None:
        """A storage resized in place (FSDP2 frees an unsharded parameter with resize_(0) and allocates it
        again with resize_(n), keeping the storage object): CUDA frees the old block and allocates a new
        one, so the model does the same."""
        if self._host is not None and storage in self._host:  # a host buffer stays on the host
            cell = self._host[storage]
            self.host_current += storage.nbytes() - cell[0]
            self.host_peak = max(self.host_peak, self.host_current)
            cell[0] = storage.nbytes()
            return
        if self.log is not None:
            self.log.irregular += 1  # resized in place: not a request and a free of the log's kind
        handle, finalizer = self._blocks.pop(storage, (None, None))
        if finalizer is not None and finalizer.detach() is not None:
            self._free(handle)
        if storage.nbytes():
            self._charge(storage)

    def __enter__(self):
        resize = self._storage_resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = resize(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        # An interrupt can strike inside malloc/free and leave the model half-updated; the figures are read
        # before this point, so later deaths (garbage collection, interpreter exit) must not touch it.
        self._open = False
        # A storage that outlives the session (a kept model's: vlmprobe.estimate.replay.built_models) would otherwise keep
        # this tracker and its allocator model alive through its finalizer, one of each per point measured
        for _, finalizer in list(self._blocks.values()):
            finalizer.detach()
        torch.UntypedStorage.resize_ = self._storage_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # C++ asks each fake tensor's device several times an op: no storage to see
            # a fake tensor's is answered by FakeTensorMode's own handler here rather than two dispatch layers
            # down (the fast fake mode's dispatch, then FakeTensorMode's): ~45k asks in a nanoVLM-222M step pair
            return _fake_device(args) if isinstance(args[0], FakeTensor) else func(*args)
        kwargs = kwargs or {}
        if aliases_inputs(func):  # a view (about a quarter of a ZeRO-3 step's ops): nothing new to charge
            return self._call(func, types, args, kwargs)
        summand = first_summand(func, args, kwargs)  # the engine adding a gradient into another in place on CUDA
        before, after = self._scratch_program(func, args, kwargs)
        held = self._scratch(before)  # allocated before the op's outputs, as CUDA's kernel does
        try:
            out = self._call(func, types, args, kwargs)
        except DataDependentOutputException:
            if not (self.answer_fake_scalar_reads and func is torch.ops.aten._local_scalar_dense.default):
                raise
            # `.item()` of a fake tensor has no value; it is answered as a healthy step reads it. A number is
            # computed with (Adafactor's step size, a norm): it allocates the same whatever it is, so 1.0. A flag
            # is an overflow / invalid-norm check (DeepSpeed's has_overflow reads a uint8): 0 / False, "none",
            # or DeepSpeed would skip the update and what it allocates. transformers does not get here: it
            # skips data checks for fake tensors.
            if args[0].dtype.is_floating_point:
                return 1.0
            return False if args[0].dtype == torch.bool else 0
        if func in _FROM_PYTHON_DATA:
            return out
        if summand is None or not self._add_into(summand, out):
            self._charge_outputs(out, args, kwargs)
        if self._blas_pending and func.overloadpacket in _BLAS_OPS:
            self._blas_workspace(args, kwargs)
        held += self._scratch(after)  # what the kernel makes once its outputs exist
        for handle in reversed(held):  # the kernel's buffers die as it returns, the last made first (C++ locals)
            self.free_block(handle)
        if self.reduction_card is not None and func in reduction_staging.REDUCTIONS:
            # after the copies: a convolution's bias sum runs once cuDNN's kernels have returned
            self._reduction_staging(func, args, kwargs, out)
        return out

    def _charge_outputs(self, out, args, kwargs) -> None:
        """Charge each storage the op returned that is new: not seen before and not one of its inputs'."""
        inputs = None
        for t in storage_tensors(out):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage in self._seen:
                continue
            if inputs is None:  # an output aliasing an input (in-place op, view) allocated nothing new
                inputs = {id(a.untyped_storage()) for a in storage_tensors((args, kwargs))}
            if id(storage) not in inputs:
                on_host = self._host is not None and self._placed_on_host(args, kwargs)
                self._charge(storage, on_host)
                if self.attribution is not None and not on_host and storage.nbytes():
                    self.attribution.last[2] = t.dtype  # the block just allocated is this storage's

    def _scratch_program(self, func, args, kwargs) -> tuple[list, list]:
        """(before, after) the op's outputs: the blocks CUDA's kernel of `func` makes for itself inside the op, each
        (bytes, dropped at once); the others die as it returns. They are the contiguous copies of its inputs
        (vlmprobe.estimate.cuda_rules.kernel_copies) and the embedding backward's index and partial-sum buffers
        (vlmprobe.estimate.cuda_rules.embedding_backward). None for an op on the host (offloaded work runs no CUDA kernel)."""
        before, after = embedding_backward.scratch(func, args)
        copied_before, copied_after = kernel_copies.copies(func, args)
        if copied_before or copied_after:
            before = before + [(nbytes, False) for nbytes in copied_before]
            after = after + [(nbytes, False) for nbytes in copied_after]
        if (before or after) and self._host is not None and self._placed_on_host(args, kwargs):
            return [], []
        return before, after

    def _scratch(self, steps) -> list[int]:
        """Allocate each (bytes, dropped at once) of `steps` in order, freeing the dropped ones at once; the handles
        of the others, for the caller to free when the op returns."""
        held = []
        for nbytes, dropped in steps:
            handle = self.malloc_block(nbytes)
            if dropped:
                self.free_block(handle)
            else:
                held.append(handle)
        return held

    def _reduction_staging(self, func, args, kwargs, out) -> None:
        """The staging buffer and semaphores CUDA's kernel of reduction `func` allocates after its output where one
        output's inputs span several thread blocks, freed as it returns (vlmprobe.estimate.cuda_rules.reduction_staging). None
        for a reduction on the host."""
        buffer, semaphores = reduction_staging.staging(func, args, kwargs, out, self.reduction_card)
        if not buffer or (self._host is not None and self._placed_on_host(args, kwargs)):
            return
        for handle in reversed(self._scratch([(buffer, False), (semaphores, False)])):
            self.free_block(handle)  # the semaphores' DataPtr, declared after the buffer's, is destroyed first

    def _add_into(self, summand: torch.Tensor, out: torch.Tensor) -> bool:
        """Charge the engine's gradient sum `out` as CUDA's `summand.add_(...)`: the sum takes over summand's block,
        so nothing is allocated, and summand's death frees nothing (vlmprobe.estimate.cuda_rules.gradient_sums). False where
        summand has no block here (made before the tracker, or on the host)."""
        entry = self._blocks.pop(summand.untyped_storage(), None)
        if entry is None:
            return False
        handle, finalizer = entry
        finalizer.detach()
        self.adopt(out.untyped_storage(), handle)
        return True

    def _blas_workspace(self, args, kwargs) -> None:
        """Make this thread's cuBLAS workspace if the matrix multiply just run is the thread's first (see
        __init__). Not logged: it is made once a process, so a replayed step or block (step_replay, block_replay)
        must not make it again."""
        if self._host is not None and self._placed_on_host(args, kwargs):
            return  # a multiply on the host (offloaded work) runs no cuBLAS
        thread = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
        if thread in self._blas_threads:
            return
        self._blas_threads.add(thread)
        self._blas_pending = len(self._blas_threads) < 2
        for nbytes in self.blas_workspaces:
            handle = self.allocator.malloc(nbytes)  # never freed: torch keeps it until the process exits
            if self.attribution is not None:
                self.attribution.labels[handle] = [None, WORKSPACE, None]

    def _call(self, func, types, args, kwargs):
        """func(*args, **kwargs), answered by the fast fake mode beneath directly where nothing sits between
        (fast_fake, 10.). Its NotImplemented (an argument of a subclass it does not know, as FSDP2's DTensor) goes
        through the dispatcher, which gives the op to that subclass as it would have: with this mode off the
        stack, so the subclass's inner ops are not charged here, only what the op returns."""
        below = self.below
        if below is not None and torch._C._len_torch_dispatch_stack() == 1 and \
                torch._C._get_dispatch_mode(_FAKE) is below:
            out = below.answer_from_above(func, types, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def _placed_on_host(self, args, kwargs) -> bool:
        placement = PLACEMENT.get()
        if placement is not None:
            return placement == "host"
        # 0-dim tensors are left out: CUDA ops take CPU scalars beside device tensors (AdamW's step counters)
        storages = [t.untyped_storage() for t in storage_tensors((args, kwargs)) if t.dim() and t.device.type != "meta"]
        return bool(storages) and all(s in self._host for s in storages)


class AllocationLog:
    """The device allocations and frees the tracker made while it held this log, in order (for
    vlmprobe.estimate.replay.steps): `events` holds an allocation as its size in bytes (>= 0) and a free as
    -1 - the index of the allocation it frees. What it cannot hold as such is counted in `irregular`: a free of a
    block allocated before the log began, a storage resized in place. `marks` are event indexes a caller set.""" 

    def __init__(self):
        self.events: list[int] = []
        self.marks: list[int] = []
        self.irregular = 0
        self.live: dict[int, int] = {}  # handle -> index of its allocation, while it lives
        self.labels: dict[int, list] = {}  # index of an allocation -> its Attribution label, where blocks are labelled

    def malloc(self, handle: int, nbytes: int, label: list | None = None) -> None:
        if handle:  # 0: a zero-size storage, no block
            self.live[handle] = len(self.events)
            if label is not None:
                self.labels[len(self.events)] = label
            self.events.append(nbytes)

    def free(self, handle: int) -> None:
        if not handle:
            return
        index = self.live.pop(handle, None)
        if index is None:
            self.irregular += 1
        else:
            self.events.append(-1 - index)

    def mark(self) -> None:
        self.marks.append(len(self.events))

    def index_of(self, tracker: LiveBytesTracker, tensor: torch.Tensor) -> int | None:
        """The index of the allocation of `tensor`'s storage, if it was allocated in this log and lives."""
        handle = tracker.handle_of(tensor.untyped_storage())
        return None if handle is None else self.live.get(handle)


WORKSPACE = "workspace"  # a label's phase for a cuBLAS workspace
TRAINING_STATE = ("weights", "buffers", "gradients", "optimizer state")  # kinds the row's own columns count
# a block's kind from the phase it was allocated in, where nothing that holds it says (weights, gradients, optimizer state)
KINDS = {"forward": "activations", "generate": "activations", "reference": "activations",
         "backward": "activation gradients", WORKSPACE: "cuBLAS workspace", "load": "made while loading"}
SHORT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


class Attribution:
    """Labels of the allocator model's blocks, [module, phase, dtype] each (the module doc): `module` the name of
    the module running (in the model's named_modules; "" the model itself; None outside it), `phase` the step's
    phase (vlmprobe.states.Phase, "load" before the first), `dtype` the dtype of the tensor the block holds (None:
    a bare block, a kernel's own buffer). `at_oom`: handle -> (bytes, label) of every live block when the model
    last ran out of memory."""

    def __init__(self):
        self.labels: dict[int, list] = {}  # handle -> label of the block allocated there last
        self.last: list | None = None  # the label of the last allocation
        self.module: str | None = None
        self.phase: str | None = "load"
        self.queued: list = []  # labels a replay's allocations take, the next one last
        self.at_oom: dict[int, tuple[int, list | None]] | None = None
        self.model = None
        self.shown: dict[str, str] = {}  # a module's name -> its name as the groups show it (collapsed_names)
        self._stack: list[str] = []  # the modules whose forward runs, innermost last
        self._hooks: dict = {}  # module -> its two hook handles

    # ---- the allocator model's watcher -------------------------------------------------------------------------

    def allocated(self, handle: int) -> None:
        label = self.queued.pop() if self.queued else None
        if label is None:
            label = [self.module, self.phase, None]
        self.labels[handle] = self.last = label

    def ran_out(self, allocator) -> None:
        self.at_oom = {handle: (size, self.labels.get(handle)) for handle, size in allocator.live_sizes().items()}

    # ---- what runs ---------------------------------------------------------------------------------------------

    def enter_phase(self, phase: str | None) -> None:
        """The step's phase from here (None: between phases); the module is the one whose forward runs, if any."""
        self.phase = phase
        self.module = self._stack[-1] if self._stack else None

    def watch(self, model) -> None:
        """Hook each of `model`'s modules (named as in named_modules) to say whose forward and backward runs."""
        self.model = model
        self.shown = collapsed_names(model)
        for name, module in model.named_modules():
            if module not in self._hooks:
                self._hooks[module] = (module.register_forward_pre_hook(functools.partial(self._enter, name)),
                                       module.register_forward_hook(functools.partial(self._leave, name)))

    def unwatch(self, modules=None) -> None:
        """Remove the hooks of `modules` (every module's if None)."""
        for module in list(self._hooks) if modules is None else modules:
            for handle in self._hooks.pop(module, ()):
                handle.remove()

    def _enter(self, name: str, module, args) -> None:
        self._stack.append(name)
        self.module = name

    def _leave(self, name: str, module, args, output) -> None:
        if self._stack and self._stack[-1] == name:
            self._stack.pop()
        self.module = self._stack[-1] if self._stack else None
        if torch.is_grad_enabled():
            for t in _tensors_in(output):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(functools.partial(self._backward_of, name))

    def _backward_of(self, name: str, grad) -> None:
        self.module = name  # the gradient of this module's output is here: its backward runs next

    def replaying(self, events, log: AllocationLog | None, play):
        """`play()` (a replay of `events`, AllocationLog events as vlmprobe.estimate.replay.playback.play_events
        gives them), each of its allocations labelled as the logged one it replays."""
        self.queued = [log.labels.get(event[1]) for event in reversed(events) if event[0] != "free"] if log else []
        try:
            return play()
        finally:
            self.queued = []

    # ---- at an out-of-memory -----------------------------------------------------------------------------------

    def filled(self, tracker: LiveBytesTracker, optimizer=None, state: list | None = None,
               top: int = 5) -> list[tuple[str | None, str, str | None, int]]:
        """The `top` largest (module, kind, dtype, bytes) groups of the blocks live when the model last ran out: what
        the step made (activations and the rest) largest first, then the training state (TRAINING_STATE: the row
        has its own columns for it), largest first; the bytes are the blocks' (as allocated counts them). Kind: weights, buffers, gradients and
        optimizer state where the model's parameters and buffers, their .grad or the optimizer's state (`optimizer`,
        and `state`: the engine's state tensors, of no module where the optimizer's state does not name them) hold
        the block; else from the phase it was made in (KINDS: "made while loading" is mostly the batch; "other":
        between phases, in the optimizer step). [] where it has not run out."""
        if self.at_oom is None:
            return []
        known: dict[int, tuple] = {}

        def hold(tensor, module, kind) -> None:
            for t in storage_tensors(tensor):
                handle = tracker.handle_of(t.untyped_storage())
                if handle in self.at_oom and handle not in known:
                    known[handle] = (module, kind, dtype_name(t.dtype))

        owners: dict[int, str] = {}
        if self.model is not None:
            for name, p in self.model.named_parameters():
                owners[id(p)] = name.rpartition(".")[0]
                hold(p, owners[id(p)], "weights")
                if p.grad is not None:
                    hold(p.grad, owners[id(p)], "gradients")
            for name, b in self.model.named_buffers():
                hold(b, name.rpartition(".")[0], "buffers")
        if optimizer is not None:
            for p, values in optimizer.state.items():
                for value in values.values():
                    if isinstance(value, torch.Tensor):
                        hold(value, owners.get(id(p)), "optimizer state")
        for t in state or ():
            hold(t, None, "optimizer state")
        groups: dict[tuple, int] = {}
        for handle, (size, label) in self.at_oom.items():
            key = known.get(handle)
            if key is None:
                module, phase, dtype = label or (None, None, None)
                key = (module, KINDS.get(phase, "other"), None if phase == "load" else dtype_name(dtype))
            key = (self.shown.get(key[0], key[0]), *key[1:])
            groups[key] = groups.get(key, 0) + size
        root = type(self.model).__name__ if self.model is not None else None
        ranked = sorted(groups.items(), key=lambda item: (item[0][1] in TRAINING_STATE, -item[1], str(item[0])))
        return [(root if module == "" else module, kind, dtype, size) for (module, kind, dtype), size in ranked[:top]]


def collapsed_names(model) -> dict[str, str]:
    """Each module's name in `model` (named_modules) -> the same with the index of each block of a ModuleList as *
    (model.layers.3.mlp -> model.layers.*.mlp); a Sequential's children, of different kinds, keep theirs."""
    shown = {"": ""}
    for name, module in model.named_modules():
        for child, _ in module.named_children():
            part = "*" if isinstance(module, torch.nn.ModuleList) and child.isdigit() else child
            shown.setdefault(f"{name}.{child}" if name else child,
                             f"{shown.get(name, name)}.{part}" if shown.get(name, name) else part)
    return shown


def dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    return SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def filled_text(groups) -> str:
    """Attribution.filled's groups as the row's oom_filled: "fp32 activations of lm_head 4.64 GiB; ..."."""
    return "; ".join(f"{dtype + ' ' if dtype else ''}{kind}{' of ' + module if module else ''} {in_words(size)}"
                     for module, kind, dtype, size in groups)


def _tensors_in(output) -> list[torch.Tensor]:
    """The tensors of a module's output: itself, or those in its tuples, lists and dicts (ModelOutput), one level
    of nesting deep."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    found = []
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            found.extend(t for t in item if isinstance(t, torch.Tensor))
    return found


@functools.cache
def aliases_inputs(func) -> bool:
    """Whether every output of the op is always a view of an input, so that it allocates no storage: its
    schema says each output aliases an input (`Tensor(a)`, no write), and it has no CompositeImplicitAutograd
    kernel (those, `to`, `reshape`, `contiguous`, may copy instead; torch requires every other op with such a
    schema to return views)."""
    schema = getattr(func, "_schema", None)
    return (bool(getattr(func, "is_view", False)) and bool(schema.returns)
            and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
            and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"))


_PLAIN_TENSORS = {torch.Tensor, torch.nn.Parameter, FakeTensor}
_NO_TENSOR = {int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format}


def storage_tensors(tree, found: list | None = None) -> list[torch.Tensor]:
    """The tensors in `tree` (an op's arguments or outputs: tensors, lists, tuples, dicts) that own memory: a
    wrapper subclass (DTensor: a global shape around this rank's local shard) stands for its inner tensors,
    whose storages are the memory; its own storage is none. A plain walk: it runs twice an op, and pytree's
    general one cost a sixth of a fake op."""
    found = [] if found is None else found
    if type(tree) in _PLAIN_TENSORS:  # most of them: neither is a wrapper subclass
        if tree.layout == torch.strided:
            found.append(tree)
    elif isinstance(tree, torch.Tensor):
        if tree.layout == torch.strided and is_traceable_wrapper_subclass(tree):
            names, _ = tree.__tensor_flatten__()
            storage_tensors([getattr(tree, name) for name in names], found)
        elif tree.layout == torch.strided:
            found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            if type(item) not in _NO_TENSOR:  # a size's ints are most items: no call each
                storage_tensors(item, found)
    elif isinstance(tree, dict):
        storage_tensors(list(tree.values()), found)
    return found
