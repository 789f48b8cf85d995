"""The backends without a GPU: `estimate` runs the step on fake CPU tensors, `cpu` the same program on real ones,
and the tracker charges every storage through the model of CUDA's caching allocator (vlmprobe.estimate).

Both make the choices CUDA would make (the optimizer implementation, CUDA's autocast op lists, the SDPA kernel
the card runs, the kernels' own buffers); with the same program on both, the cpu backend proves the fake
bookkeeping: the two agree to the byte. Its figures are a check and a way to run the whole path in CI, never
GPU figures.

Both keep the point's timeline (allocated and reserved after each allocation, the phases: vlmprobe.estimate.allocator
.Timeline) and, where a capacity makes an out-of-memory possible, label every block to say what filled the memory
when it ran out (vlmprobe.estimate.tracker.Attribution): the model's modules hooked once loaded, those of the blocks a
tower replays left alone, a replayed step's blocks labelled as the step it replays. Neither changes a figure.
"""

from __future__ import annotations

import contextlib
import gc
import platform

from vlmprobe.backends.base import Backend
from vlmprobe.estimate.cuda_rules import reduction_staging
from vlmprobe.estimate.cuda_rules.autocast_policy import cuda_autocast_policy
from vlmprobe.estimate.cuda_rules.flash_attn_standin import flash_attention_standin
from vlmprobe.estimate.cuda_rules.grouped_mm import cuda_grouped_mm
from vlmprobe.estimate.cuda_rules.sdpa_choice import cuda_sdpa_choice
from vlmprobe.estimate.fake_patches import real_run_answers_for_fake_batches
from vlmprobe.estimate.fast_fake import session_mode
from vlmprobe.estimate.replay.built_models import BUILT_MODELS
from vlmprobe.estimate.allocator import Timeline
from vlmprobe.estimate.replay.steps import StepReplay
from vlmprobe.estimate.tracker import LiveBytesTracker, filled_text
from vlmprobe.gpu import device_profile
from vlmprobe.gpu.device_profile import DeviceProfile

__all__ = ["CPU", "ESTIMATE", "EstimateBackend", "LabelledStepReplay", "no_automatic_collection", "reduction_card",
           "TrackerMeter"]


@contextlib.contextmanager
def no_automatic_collection():
    """Python's cyclic garbage collector off for the session, after one collection before it: a tensor that
    only a reference cycle keeps alive lives to the session's end, wherever a collection would have fallen.
    With the collector on, the figures depended on when one happened to run: a few more Python objects made
    before DeepSpeed ZeRO-2's optimizer step moved a real gloo rank's optimizer peak by 80,384 B, so the
    estimate and the cpu backend (or one commit and the next) disagreed on the same program. On CUDA such a
    tensor is freed when a collection runs, if one runs within the step; the figures here are those of a step
    in which none does, the higher of the two.

    What survives that collection is frozen (gc.freeze: never walked again), so that the next session's
    collection walks only what was made since, the last point's objects: a full walk of torch's, transformers'
    and the caches' objects was ~0.14 s of every point here (~350k objects), a tenth of a warm estimate point.
    What is frozen is alive; a cycle of it that dies later is not collected (none is known: the caches that
    outlive a point hold plain data)."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class TrackerMeter:
    def __init__(self, tracker: LiveBytesTracker, capacity: int | None):
        self.tracker = tracker
        self.capacity = capacity  # the allocator model's device capacity, or None (unbounded)
        self.notes: list[str] = []
        self._reserved_closed = 0  # the allocator model's reserved peak in the windows reset_peak closed
        self.timeline = tracker.allocator.timeline
        self._loading = self.timeline is not None  # the timeline's "load" span is open until the first phase
        if self._loading:
            self.timeline.begin("load")

    def mark_phase(self, phase: str, started: bool) -> None:
        """The step's `phase` starts (started) or ends here (steps.common.PhaseClock): a span of the timeline, the
        phase of the blocks allocated from here."""
        if self.timeline is not None:
            if self._loading:
                self.timeline.end("load")
                self._loading = False
            (self.timeline.begin if started else self.timeline.end)(phase)
        if self.tracker.attribution is not None:
            self.tracker.attribution.enter_phase(phase if started else None)

    def sync(self) -> None:
        """CPU ops are synchronous: nothing is queued."""

    def current(self) -> int:
        return self.tracker.current

    def peaks(self) -> dict[str, int]:
        model = self.tracker.allocator  # one stream: nothing awaits another stream, so active == allocated
        return {"allocated": model.peak_allocated, "reserved": model.peak_reserved, "active": model.peak_active}

    def reset_peak(self) -> None:
        self._reserved_closed = self.reserved_peak()
        self.tracker.reset_peak()

    def reserved_peak(self) -> int:
        """The allocator model's peak reserved bytes over the whole session, model load included: the most
        the caching allocator would have held from the card at once (reset_peak does not forget it)."""
        return max(self._reserved_closed, self.tracker.allocator.peak_reserved)


class EstimateBackend(Backend):
    device_type = "cpu"
    isolate = False  # no device allocator to leak state between points; the tracker starts at zero

    def __init__(self, name: str, fake: bool):
        self.name = name
        self.fake = fake

    @contextlib.contextmanager
    def session(self, capacity, record_history: str = "alloc", device=None, settings=None, allowed_maximum=None):
        with contextlib.ExitStack() as stack:
            stack.enter_context(no_automatic_collection())
            stack.enter_context(cuda_autocast_policy())
            stack.enter_context(cuda_sdpa_choice(device))  # the SDPA kernels the target card has
            if self.fake:
                fake = stack.enter_context(session_mode())
                stack.enter_context(real_run_answers_for_fake_batches())
                stack.enter_context(flash_attention_standin())  # flash_attention_2 without the package or a GPU
                stack.enter_context(cuda_grouped_mm())  # MoE experts: CUDA's dtypes and output layout
            tracker = stack.enter_context(LiveBytesTracker(
                capacity, answer_fake_scalar_reads=self.fake, settings=settings, allowed_maximum=allowed_maximum,
                blas_workspaces=device_profile.workspace_blocks(device),
                reduction_card=reduction_card(device)))
            if self.fake:
                tracker.below = fake
            tracker.allocator.timeline = Timeline()
            if capacity is not None:  # without one nothing runs out: no labels to keep
                stack.callback(tracker.attribute().unwatch)  # the hooks off the model (a kept one outlives this)
            yield TrackerMeter(tracker, capacity)

    def load_model(self, meter, key, build):
        # fake tensors only: the cpu backend builds every point's model, so estimate == cpu checks the reuse
        if not self.fake or key is None:
            model, peak = super().load_model(meter, key, build)
        else:
            model, peak = BUILT_MODELS.load(meter.tracker, key, build)
        if meter.tracker.attribution is not None:
            meter.tracker.attribution.watch(model)
        return model, peak

    def step_replay(self, meter, engine, towers=()):
        attribution = meter.tracker.attribution
        if attribution is not None:  # hooks on a block would stop its tower's replay: the tower's blocks go unhooked
            attribution.unwatch([m for blocks in towers if len(blocks) >= 3 for block in blocks for m in block.modules()])
        # fake tensors only: the cpu backend runs every step for real, so estimate == cpu checks the replay
        if not (self.fake and engine.repeats_steps):
            return None
        if attribution is not None:
            return LabelledStepReplay(meter.tracker, engine.optimizer, towers)
        return StepReplay(meter.tracker, engine.optimizer, towers)

    def predicted_device_bytes(self, meter, device) -> int | None:
        return device_profile.predicted_device_bytes(meter.reserved_peak(), device)

    def final_stats(self, meter) -> dict:
        tracker = meter.tracker
        model = tracker.allocator
        host = tracker.host_tracked
        return {"num_alloc_retries": model.num_alloc_retries, "num_ooms": model.num_ooms,
                "peak_host_bytes": tracker.host_peak if host else None,
                "after_step_host_bytes": tracker.host_current if host else None}

    def oom_filled(self, meter, engine) -> str | None:
        attribution = meter.tracker.attribution
        if attribution is None:
            return None
        groups = attribution.filled(meter.tracker, getattr(engine, "optimizer", None),
                                    engine.state_tensors() if engine is not None else None)
        return filled_text(groups) or None

    def timeline(self, meter) -> dict | None:
        return meter.timeline.data() if meter.timeline is not None else None

    def oom_columns(self, meter, message: str) -> dict:
        block, segment = meter.tracker.allocator.last_oom or (None, None)
        return {"oom_segment_bytes": segment, "oom_block_bytes": block}

    def describe(self) -> dict:
        return {"backend": self.name, "device_name": f"{platform.machine()} CPU ({'fake' if self.fake else 'real'} tensors)"}


class LabelledStepReplay(StepReplay):
    """StepReplay whose replayed forward and backward label their blocks as the logged step labelled its own
    (vlmprobe.estimate.tracker.Attribution.replaying): the modules' hooks do not run in a replay."""

    def __init__(self, tracker: LiveBytesTracker, optimizer, towers=()):
        super().__init__(tracker, optimizer, towers)
        self.logged = None  # the first step's AllocationLog, with its labels

    def forward(self, run):
        if self.plan is not None:
            return self.tracker.attribution.replaying(self.plan.forward_events, self.logged,
                                                      lambda: super(LabelledStepReplay, self).forward(run))
        logging = not self.recorded
        results = super().forward(run)
        if logging:
            self.logged = self.tracker.log  # the log this step's forward and backward fill
        return results

    def backward(self, run, loss) -> None:
        if self.plan is not None:
            self.tracker.attribution.replaying(self.plan.backward_events, self.logged,
                                               lambda: super(LabelledStepReplay, self).backward(run, loss))
            return
        super().backward(run, loss)


def reduction_card(profile: DeviceProfile | None) -> reduction_staging.Card | None:
    """What CUDA's reduction kernels read of the card to split a reduction across thread blocks
    (vlmprobe.estimate.cuda_rules.reduction_staging). None without a profile: no staging buffer is charged."""
    if profile is None:
        return None
    return reduction_staging.Card(profile.multiprocessors, profile.max_threads_per_multiprocessor)


ESTIMATE = EstimateBackend("estimate", fake=True)
CPU = EstimateBackend("cpu", fake=False)
