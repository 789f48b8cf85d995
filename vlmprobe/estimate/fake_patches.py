"""Patches that let libraries run on fake tensors as they run on real ones, each active only while needed.

Each answers one place where a library reads data or swaps tensors in a way fake tensors cannot take, with
what a real run of the same synthetic batch does there, so the allocations stay those of the real run.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["fake_modules_move_by_data", "HOST_INDEX_TENSORS_REAL", "host_index_tensors_real",
           "real_run_answers_for_fake_batches"]


@contextlib.contextmanager
def real_run_answers_for_fake_batches():
    """Give transformers the answers a real run of our synthetic batches gets where it reads data.

    transformers takes fake tensors for tracing, and for a data-dependent decision then assumes the worst case,
    materialising masks (and repeating K/V) that a real run of the same batch skips. Synthetic batches hold one
    unpadded sequence per sample, or several in one row whose positions are constants (data.packing), so each
    decision below gets the real run's answer, and the ops a real run makes to decide are still made, so the
    allocations match. Where transformers' masking code is not imported, no model here runs it (a transformers
    family imports it with its spec: models.base.TRANSFORMERS_MODULES), and nothing is patched.
    """
    masking_utils = sys.modules.get("transformers.masking_utils")
    if masking_utils is None:
        yield
        return
    flash_masks = masking_utils.AttentionMaskInterface._global_mapping
    with contextlib.ExitStack() as stack:
        for name, answer in (("find_packed_sequence_indices", functools.partial(packed_sequences_read, masking_utils)),
                             ("_ignore_bidirectional_mask_sdpa", bidirectional_mask_read),
                             ("_ignore_causal_mask_sdpa", functools.partial(causal_mask_read, masking_utils))):
            stack.enter_context(mock.patch.object(masking_utils, name, answer(getattr(masking_utils, name))))
        flash = flash_mask_read(flash_masks["flash_attention_2"])
        stack.enter_context(replaced_item(flash_masks, "flash_attention_2", flash))
        fa_utils = sys.modules.get("transformers.modeling_flash_attention_utils")  # imported with masking_utils
        if fa_utils is not None:
            stack.enter_context(mock.patch.object(fa_utils, "_is_packed_sequence",
                                                  packed_positions_read(fa_utils._is_packed_sequence)))
        yield


@contextlib.contextmanager
def replaced_item(mapping: dict, key, value):
    """mapping[key] is `value` for the block, its own value again after it."""
    original = mapping[key]
    mapping[key] = value
    try:
        yield
    finally:
        mapping[key] = original


def packed_sequences_read(masking_utils, original):
    """find_packed_sequence_indices does not read fake position ids (transformers takes fakes for tracing), so it
    reports a packed batch, and the model materialises a (B, 1, L, L) mask and repeats K/V for SDPA. Read as a
    real run reads them: constant ones (a packed batch's, vlmprobe.models.packing) by their values, the function
    told it is not tracing them, so that it makes its read where a real run does; any other (the model's own
    aranges) hold one unpadded sequence per row, "not packed" (None), after the ops a real run makes to decide."""
    def find_packed_sequence_indices(position_ids):
        if isinstance(position_ids, FakeTensor) and position_ids.constant is not None:
            tracing = masking_utils.is_tracing
            masking_utils.is_tracing = lambda t=None: (t.constant is None if isinstance(t, FakeTensor) else tracing(t))
            try:
                packed = original(position_ids)
            finally:
                masking_utils.is_tracing = tracing
            if not isinstance(packed, FakeTensor) or packed.constant is not None:
                return packed
        else:
            packed = original(position_ids)
        if isinstance(packed, FakeTensor):
            (packed[:, -1] == 0).all()  # what a real run computes to decide, then reads
            return None
        return packed

    return find_packed_sequence_indices


def packed_positions_read(original):
    """Flash attention decides in every layer whether the positions hold several sequences (_is_packed_sequence:
    positions against a fresh arange, summed and read as a bool); the arange is no constant, so a fake read gets
    the tracker's answer (False) and a packed batch would run unpacked. Read as a real run reads it, after the
    same ops: constant positions (a packed batch's, vlmprobe.models.packing) by their values, on the host outside
    every mode (nothing charged); any other as before."""
    def is_packed_sequence(position_ids, batch_size):
        answer = original(position_ids, batch_size)
        if isinstance(answer, FakeTensor) and position_ids.constant is not None:
            with _disable_current_modes():
                positions = position_ids.constant
                return bool((positions != torch.arange(positions.shape[-1]) + positions.min()).any())
        return answer

    return is_packed_sequence


def bidirectional_mask_read(original):
    """_ignore_bidirectional_mask_sdpa skips a vision tower's padding mask where it is all ones, except for fake
    tensors, where the model would then materialise a (N, 1, P, P) mask a real run never makes. The mask is read
    as a real run reads it (`.all()`): a family whose forward derives it from its inputs makes those inputs
    constant fakes (Idefics3's pixel_attention_mask), so the read has the real answer; a non-constant one reads
    False (the tracker's answer)."""
    def ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
        if isinstance(padding_mask, FakeTensor):
            return bool(padding_mask.all()) and (local_attention_size is None or kv_length < local_attention_size)
        return original(padding_mask, kv_length, local_attention_size)

    return ignore_bidirectional_mask_sdpa


def causal_mask_read(masking_utils, original):
    """generate() makes its own all-ones attention mask when none is given (step=grpo's rollout); a real run reads
    it (fast_all) and, finding no padding, skips the (B, 1, q, kv) mask for SDPA's is_causal. Fake masks are taken
    for tracing and never skipped: answered as the real run, making the ops it makes to read. A mask that is a
    constant fake (a dataset's padded batch, vlmprobe.point.dataset_steps) answers from its values: padded rows keep
    the (B, 1, q, kv) mask, as a real run does; any other fake is a synthetic, unpadded one."""
    def ignore_causal_mask_sdpa(padding_mask, *args, **kwargs):
        if not isinstance(padding_mask, FakeTensor):
            return original(padding_mask, *args, **kwargs)
        tracing, fast_all = masking_utils.is_tracing, masking_utils.fast_all

        def all_ones(tensor):
            fast_all(tensor)  # the sum and compare a real run reads
            constant = getattr(tensor, "constant", None)
            return True if constant is None else bool(constant.all())

        masking_utils.is_tracing = lambda t: False if isinstance(t, FakeTensor) else tracing(t)
        masking_utils.fast_all = all_ones
        try:
            return original(padding_mask, *args, **kwargs)
        finally:
            masking_utils.is_tracing, masking_utils.fast_all = tracing, fast_all

    return ignore_causal_mask_sdpa


def flash_mask_read(original):
    """The same for flash attention (vlmprobe.estimate.cuda_rules.flash_attn_standin): flash_attention_mask drops
    generate()'s all-ones mask after reading it (.all()), and flash attention then runs unpadded; a fake mask that
    read False would send every layer through unpadding (nonzero), which a real run of an unpadded batch skips."""
    def flash_attention_mask(**kwargs):  # transformers calls mask interfaces by keyword
        attention_mask, kv_length = kwargs.get("attention_mask"), kwargs["kv_length"]
        if not isinstance(attention_mask, FakeTensor):
            return original(**kwargs)
        sliced = attention_mask[:, -kv_length:]
        sliced.all()  # what a real run computes to decide, then reads: synthetic prompts are unpadded
        return None if sliced.shape[1] == kv_length else sliced

    return flash_attention_mask


@contextlib.contextmanager
def fake_modules_move_by_data():
    """peft moves each new adapter to its base layer with Module.to, which fake modules cannot take: torch
    swaps a fake parameter's tensor, and every fake Parameter carries a weakref that forbids the swap. While
    active, Module.to on a module holding fake tensors converts their dtype through `.data` (what Module.to
    does for real tensors) and leaves the device (fake tensors all live on the CPU)."""
    import torch
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
