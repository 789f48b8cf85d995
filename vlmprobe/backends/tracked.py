"""Backends without a GPU: the tracker counts live storage bytes while the step runs with CUDA's choices.

Both make the choices CUDA would make (the optimizer implementation in step.make_optimizer, CUDA's autocast
op policy, CUDA's SDPA kernel where it differs in what it keeps for backward); `cpu` runs real CPU tensors
and `estimate` fake ones. With the same program on both, the cpu backend proves the fake bookkeeping: the
two must agree to the byte.
"""

from __future__ import annotations

import contextlib
import platform

from vlmprobe import device_profile
from vlmprobe.autocast_policy import cuda_autocast_policy
from vlmprobe.backends.base import Backend
from vlmprobe.sdpa_choice import cuda_sdpa_choice
from vlmprobe.tracker import LiveBytesTracker


class TrackerMeter:
    def __init__(self, tracker: LiveBytesTracker, capacity: int | None):
        self.tracker = tracker
        self.capacity = capacity  # the allocator model's device capacity, or None (unbounded)
        self.notes: list[str] = []
        self._reserved_closed = 0  # the allocator model's reserved peak in the windows reset_peak closed

    def sync(self) -> None:
        """CPU ops are synchronous: nothing is queued."""

    def current(self) -> int:
        return self.tracker.current

    def peaks(self) -> dict[str, int]:
        return {"allocated": self.tracker.peak}

    def reset_peak(self) -> None:
        self._reserved_closed = self.reserved_peak()
        self.tracker.reset_peak()

    def reserved_peak(self) -> int:
        """The allocator model's peak reserved bytes over the whole session, model load included: the most
        the caching allocator would have held from the card at once (reset_peak does not forget it)."""
        return max(self._reserved_closed, self.tracker.allocator.peak_reserved)


@contextlib.contextmanager
def real_run_answers_for_fake_batches():
    """Give transformers the answers a real run of our synthetic batches gets where it reads data.

    transformers takes fake tensors for tracing; for a data-dependent decision it then assumes the worst
    case. The one that changes memory: `find_packed_sequence_indices` cannot read fake position ids, so it
    reports a packed batch, and the model materialises a (B, 1, L, L) mask and repeats K/V for SDPA, which a
    real run of the same batch skips. Synthetic batches hold one unpadded sequence per sample, so the real
    answer is "not packed" (None); the ops a real run makes to decide are still made, so allocations match.

    The same for a bidirectional (vision tower) padding mask: `_ignore_bidirectional_mask_sdpa` skips the
    mask where it is all ones, except for fake tensors, where the model would then materialise a (N, 1, P, P)
    mask that a real run never makes. The mask is read as a real run reads it (`.all()`): a family whose
    forward derives it from its inputs makes those inputs constant fakes (Idefics3's pixel_attention_mask),
    so the read has the real answer; a non-constant one reads False (the tracker's answer), as before.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    original_ignore = masking_utils._ignore_bidirectional_mask_sdpa

    def ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
        if isinstance(padding_mask, FakeTensor):
            return bool(padding_mask.all()) and (local_attention_size is None or kv_length < local_attention_size)
        return original_ignore(padding_mask, kv_length, local_attention_size)

    def find_packed_sequence_indices(position_ids):
        packed = original(position_ids)
        if isinstance(packed, FakeTensor):
            (packed[:, -1] == 0).all()  # what a real run computes to decide, then reads
            return None
        return packed

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    masking_utils._ignore_bidirectional_mask_sdpa = ignore_bidirectional_mask_sdpa
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
        masking_utils._ignore_bidirectional_mask_sdpa = original_ignore


class TrackedBackend(Backend):
    device_type = "cpu"
    isolate = False  # no device allocator to leak state between points; the tracker starts at zero

    def __init__(self, name: str, fake: bool):
        self.name = name
        self.fake = fake

    @contextlib.contextmanager
    def session(self, capacity, record_history: str = "alloc", device=None):
        with contextlib.ExitStack() as stack:
            stack.enter_context(cuda_autocast_policy())
            stack.enter_context(cuda_sdpa_choice(device))  # the SDPA kernels the target card has
            if self.fake:
                from torch._subclasses.fake_tensor import FakeTensorMode

                # allow_non_fake_inputs: module buffers made from Python constants may be real
                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                stack.enter_context(real_run_answers_for_fake_batches())
            tracker = stack.enter_context(LiveBytesTracker(capacity, answer_fake_scalar_reads=self.fake))
            yield TrackerMeter(tracker, capacity)

    def predicted_device_bytes(self, meter, device) -> int | None:
        return device_profile.predicted_device_bytes(meter.reserved_peak(), device)

    def oom_columns(self, meter, message: str) -> dict:
        block, segment = meter.tracker.allocator.last_oom or (None, None)
        return {"oom_segment_bytes": segment, "oom_block_bytes": block}

    def describe(self) -> dict:
        return {"backend": self.name, "device_name": f"{platform.machine()} CPU ({'fake' if self.fake else 'real'} tensors)"}
