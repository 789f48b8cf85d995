"""Patches that let libraries run on fake tensors as they run on real ones, each active only while needed.

Each answers one place where a library reads data or swaps tensors in a way fake tensors cannot take, with
what a real run of the same synthetic batch does there, so the allocations stay those of the real run.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

from torch import nn


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

    Where transformers' masking code is not imported, no model here runs it (a transformers family imports it
    with its spec: vlmprobe.models.base.TRANSFORMERS_MODULES), and nothing is patched.
    """
    masking_utils = sys.modules.get("transformers.masking_utils")
    if masking_utils is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    original = masking_utils.find_packed_sequence_indices
    original_bidirectional = masking_utils._ignore_bidirectional_mask_sdpa

    def ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
        if isinstance(padding_mask, FakeTensor):
            return bool(padding_mask.all()) and (local_attention_size is None or kv_length < local_attention_size)
        return original_bidirectional(padding_mask, kv_length, local_attention_size)

    def find_packed_sequence_indices(position_ids):
        packed = original(position_ids)
        if isinstance(packed, FakeTensor):
            (packed[:, -1] == 0).all()  # what a real run computes to decide, then reads
            return None
        return packed

    # generate() makes its own all-ones attention mask when none is given (step=grpo's rollout); a real run
    # reads it (fast_all) and, finding no padding, skips the (B, 1, q, kv) mask for SDPA's is_causal. Fake
    # masks are taken for tracing and never skipped: answer as the real run, making the ops it makes to read.
    original_causal = masking_utils._ignore_causal_mask_sdpa

    def ignore_causal_mask_sdpa(padding_mask, *args, **kwargs):
        if not isinstance(padding_mask, FakeTensor):
            return original_causal(padding_mask, *args, **kwargs)
        tracing, fast_all = masking_utils.is_tracing, masking_utils.fast_all

        def all_ones(tensor):
            fast_all(tensor)  # the sum and compare a real run reads
            return True  # synthetic prompts are unpadded

        masking_utils.is_tracing = lambda t: False if isinstance(t, FakeTensor) else tracing(t)
        masking_utils.fast_all = all_ones
        try:
            return original_causal(padding_mask, *args, **kwargs)
        finally:
            masking_utils.is_tracing, masking_utils.fast_all = tracing, fast_all

    # The same for flash attention (vlmprobe.estimate.flash_attn_standin): flash_attention_mask drops generate()'s
    # all-ones mask after reading it (.all()), and flash attention then runs unpadded; a fake mask that read
    # False would send every layer through unpadding (nonzero), which a real run of an unpadded batch skips.
    flash_masks = masking_utils.AttentionMaskInterface._global_mapping
    original_flash = flash_masks["flash_attention_2"]

    def flash_attention_mask(**kwargs):  # transformers calls mask interfaces by keyword
        attention_mask, kv_length = kwargs.get("attention_mask"), kwargs["kv_length"]
        if not isinstance(attention_mask, FakeTensor):
            return original_flash(**kwargs)
        sliced = attention_mask[:, -kv_length:]
        sliced.all()  # what a real run computes to decide, then reads: synthetic prompts are unpadded
        return None if sliced.shape[1] == kv_length else sliced

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    masking_utils._ignore_bidirectional_mask_sdpa = ignore_bidirectional_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask_sdpa
    flash_masks["flash_attention_2"] = flash_attention_mask
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
        masking_utils._ignore_bidirectional_mask_sdpa = original_bidirectional
        masking_utils._ignore_causal_mask_sdpa = original_causal
        flash_masks["flash_attention_2"] = original_flash


@contextlib.contextmanager
def fake_modules_move_by_data():
    """peft moves each new adapter to its base layer with Module.to, which fake modules cannot take: torch
    swaps a fake parameter's tensor, and every fake Parameter carries a weakref that forbids the swap. While
    active, Module.to on a module holding fake tensors converts their dtype through `.data` (what Module.to
    does for real tensors) and leaves the device (fake tensors all live on the CPU)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    to = nn.Module.to

    def to_by_data(self, *args, **kwargs):
        tensors = [*self.parameters(), *self.buffers()]
        if not any(isinstance(t, FakeTensor) for t in tensors):
            return to(self, *args, **kwargs)
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        for t in tensors:
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)
        return self

    nn.Module.to = to_by_data
    try:
        yield
    finally:
        nn.Module.to = to


# set while C++ bookkeeping that fills and reads small integer tensors on the host runs on fake tensors (see
# host_index_tensors_real); FastFakeTensorMode.dispatch reads it
HOST_INDEX_TENSORS_REAL = contextvars.ContextVar("host_index_tensors_real", default=False)


@contextlib.contextmanager
def host_index_tensors_real():
    """DDP's bucket rebuild (Reducer::sync_bucket_indices, the first forward after the first backward) writes
    the new bucket assignment into an `at::empty` int tensor through an accessor, copies it to the device,
    broadcasts it from rank 0 and reads it back: a fake tensor has no data to write or read. While active, a
    factory op of an integer dtype, and an op whose tensors are all real and of integer dtypes, run on real
    tensors (the fake mode steps aside); the rebuilt buckets themselves (float) stay fake. On a fake group the
    broadcast moves nothing, so each rank reads back its own assignment, which is rank 0's: every simulated
    rank holds the same model. The tracker charges those index tensors as it charges any storage."""
    token = HOST_INDEX_TENSORS_REAL.set(True)
    try:
        yield
    finally:
        HOST_INDEX_TENSORS_REAL.reset(token)
