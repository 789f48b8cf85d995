"""CachingAllocatorModel against hand computations from the rules of c10/cuda/CUDACachingAllocator.cpp.

Constants: kMinBlockSize 512 B, kSmallSize 1 MiB, kSmallBuffer 2 MiB, large segment 20 MiB,
kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB (c10/core/AllocatorConfig.h in torch 2.13).
"""

import random

import pytest
import torch

from vlmprobe.estimate.allocator import CachingAllocatorModel, get_allocation_size, round_size
from vlmprobe.gpu.alloc_conf import parse

KiB = 1024
MiB = 1024 * 1024


def test_requests_round_up_to_512_bytes():
    # round_size: < 512 -> 512; otherwise up to the next multiple of 512.
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024, 1024]
    a = CachingAllocatorModel()
    h1, h2, h3 = a.malloc(1), a.malloc(513), a.malloc(1024)
    assert (a.block_size(h1), a.block_size(h2), a.block_size(h3)) == (512, 1024, 1024)
    # allocated counts block sizes: 512 + 1024 + 1024; requested the unrounded sizes.
    assert a.allocated == 2560
    assert a.requested == 1 + 513 + 1024


def test_zero_byte_request_is_a_null_pointer_that_charges_nothing():
    # NativeCachingAllocator::allocate skips malloc for size 0 and returns a null DataPtr.
    a = CachingAllocatorModel()
    h = a.malloc(0)
    assert h == 0 and a.block_size(h) == 0
    assert (a.allocated, a.reserved, a.peak_allocated) == (0, 0, 0)
    a.free(h)  # free(nullptr) is a no-op
    assert a.allocated == 0


def test_small_request_creates_a_2mib_segment_and_splits_it():
    # 1000 B -> 1024 B block, small pool; no cached block -> cudaMalloc kSmallBuffer = 2 MiB;
    # remainder 2 MiB - 1024 >= 512 -> split, the rest is cached for the next small request.
    a = CachingAllocatorModel()
    h1 = a.malloc(1000)
    assert a.block_size(h1) == 1024
    assert (a.allocated, a.reserved) == (1024, 2 * MiB)
    h2 = a.malloc(1000)  # served from the cached remainder: no new segment
    assert a.block_size(h2) == 1024
    assert (a.allocated, a.reserved) == (2048, 2 * MiB)
    a._check_invariants()


def test_1_5mib_request_creates_a_20mib_segment_and_splits_it():
    # 1.5 MiB > kSmallSize -> large pool; < kMinLargeAlloc -> 20 MiB segment; remainder 18.5 MiB
    # > kSmallSize -> split: charged 1.5 MiB, and a second 1.5 MiB request fits in the remainder.
    assert get_allocation_size(3 * MiB // 2) == 20 * MiB
    a = CachingAllocatorModel()
    h1 = a.malloc(3 * MiB // 2)
    assert a.block_size(h1) == 3 * MiB // 2
    assert (a.allocated, a.reserved) == (3 * MiB // 2, 20 * MiB)
    a.malloc(3 * MiB // 2)
    assert (a.allocated, a.reserved) == (3 * MiB, 20 * MiB)
    a._check_invariants()


def test_11mib_request_gets_a_12mib_segment_and_is_charged_12mib():
    # 11 MiB >= kMinLargeAlloc -> segment = 11 MiB rounded up to kRoundLarge = 12 MiB;
    # should_split (large pool) needs remainder > kSmallSize, and 12 - 11 = 1 MiB is not > 1 MiB,
    # so the whole 12 MiB block is handed out and counted as allocated.
    assert get_allocation_size(11 * MiB) == 12 * MiB
    a = CachingAllocatorModel()
    h = a.malloc(11 * MiB)
    assert a.block_size(h) == 12 * MiB
    assert (a.allocated, a.reserved, a.requested) == (12 * MiB, 12 * MiB, 11 * MiB)


def test_reused_block_with_remainder_up_to_1mib_is_charged_whole():
    a = CachingAllocatorModel()
    a.free(a.malloc(12 * MiB))  # a cached, unsplit 12 MiB segment
    # 11.5 MiB: best fit is the 12 MiB block, remainder 0.5 MiB <= 1 MiB -> not split -> 12 MiB.
    h = a.malloc(11 * MiB + 512 * KiB)
    assert a.block_size(h) == 12 * MiB
    assert (a.allocated, a.reserved) == (12 * MiB, 12 * MiB)
    a.free(h)
    # 10 MiB + 512 B: remainder 2 MiB - 512 B > 1 MiB -> split, charged only the request.
    h = a.malloc(10 * MiB + 512)
    assert a.block_size(h) == 10 * MiB + 512
    assert (a.allocated, a.reserved) == (10 * MiB + 512, 12 * MiB)
    a._check_invariants()


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    a = CachingAllocatorModel()
    big, mid = a.malloc(16 * MiB), a.malloc(12 * MiB)  # segments of 16 and 12 MiB
    a.free(big)
    a.free(mid)
    assert a.reserved == 28 * MiB
    # 11 MiB fits both; best fit picks the 12 MiB block (remainder 1 MiB: charged whole). Had it
    # taken the 16 MiB block it would have split it and charged 11 MiB.
    h1 = a.malloc(11 * MiB)
    assert h1 == mid and a.block_size(h1) == 12 * MiB
    # The next 11 MiB only fits the 16 MiB block: remainder 5 MiB > 1 MiB -> split.
    h2 = a.malloc(11 * MiB)
    assert a.block_size(h2) == 11 * MiB
    assert a.reserved == 28 * MiB  # no new segment
    a._check_invariants()


def test_equal_size_blocks_go_to_the_older_segment_first():
    # BlockComparatorSizeCounterAddress: size, then segment counter, then address.
    a = CachingAllocatorModel()
    first, second = a.malloc(12 * MiB), a.malloc(12 * MiB)
    a.free(second)
    a.free(first)
    assert a.malloc(12 * MiB) == first


def test_freeing_merges_neighbours_so_a_larger_request_fits_without_a_new_segment():
    # Five 4 MiB requests fill one 20 MiB segment exactly (the fifth takes the last 4 MiB whole).
    a = CachingAllocatorModel()
    hs = [a.malloc(4 * MiB) for _ in range(5)]
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
    # Freeing the 2nd and 3rd merges them into one free 8 MiB block; a 6 MiB request fits there
    # (remainder 2 MiB > 1 MiB -> split). Unmerged 4 MiB holes would force a new 20 MiB segment.
    a.free(hs[1])
    a.free(hs[2])
    h = a.malloc(6 * MiB)
    assert a.block_size(h) == 6 * MiB
    assert a.reserved == 20 * MiB
    # Freeing everything merges the segment back into one 20 MiB block, which a 20 MiB request
    # (>= 10 MiB: rounded to 2 MiB, 20 MiB) takes whole.
    for x in (h, hs[0], hs[3], hs[4]):
        a.free(x)
    a._check_invariants()
    h = a.malloc(20 * MiB)
    assert a.block_size(h) == 20 * MiB and a.reserved == 20 * MiB


def test_peaks_and_reset_peak():
    a = CachingAllocatorModel()
    h3 = a.malloc(3 * MiB)  # 20 MiB segment, split
    a.malloc(5 * MiB)  # from the cached 17 MiB remainder
    a.free(h3)
    # allocated went 3 -> 8 -> 5 MiB; reserved stayed 20 MiB.
    assert (a.allocated, a.peak_allocated, a.peak_reserved) == (5 * MiB, 8 * MiB, 20 * MiB)
    assert (a.peak_active, a.peak_requested) == (8 * MiB, 8 * MiB)
    a.reset_peak()  # resetPeakStats: peak = current
    assert (a.peak_allocated, a.peak_reserved, a.peak_active) == (5 * MiB, 20 * MiB, 5 * MiB)
    a.malloc(MiB)  # 1 MiB is small (<= kSmallSize): a new 2 MiB segment
    assert (a.peak_allocated, a.peak_reserved) == (6 * MiB, 22 * MiB)


def test_reserved_never_shrinks_without_capacity():
    a = CachingAllocatorModel()
    hs = [a.malloc(n) for n in (100, 3 * MiB, 30 * MiB, 700 * KiB)]
    reserved = a.reserved  # 2 MiB small + 20 MiB + 30 MiB segments
    assert reserved == 52 * MiB
    for h in hs:
        a.free(h)
    assert (a.allocated, a.reserved, a.num_alloc_retries) == (0, reserved, 0)


def test_capacity_miss_releases_cached_segments_and_retries():
    a = CachingAllocatorModel(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))  # a cached 30 MiB segment
    # 32 MiB: the cached 30 MiB block is too small; a 32 MiB segment does not fit next to it
    # (30 + 32 > 40) -> release_cached_blocks frees the 30 MiB segment, the retry succeeds.
    h = a.malloc(32 * MiB)
    assert (a.allocated, a.reserved, a.num_alloc_retries) == (32 * MiB, 32 * MiB, 1)
    assert a.peak_reserved == 32 * MiB  # 30 MiB was released before the 32 MiB cudaMalloc
    a._check_invariants()
    # 10 MiB more cannot fit even after releasing (nothing cached): OOM reporting the segment size.
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 10\.00 MiB\. GPU 0"):
        a.malloc(10 * MiB)
    assert (a.num_alloc_retries, a.num_ooms, a.allocated) == (2, 1, 32 * MiB)
    a.free(h)


def test_oom_message_reports_the_segment_size_not_the_request():
    # CUDA's message says format_size(alloc_size): a 1 KiB request needs a 2 MiB segment.
    a = CachingAllocatorModel(capacity=MiB)
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2\.00 MiB\."):
        a.malloc(KiB)


def test_split_blocks_are_not_released_on_retry():
    # A segment with a live block in it cannot be cudaFree'd: only whole free segments go.
    a = CachingAllocatorModel(capacity=24 * MiB)
    a.malloc(3 * MiB)  # 20 MiB segment, 17 MiB of it cached but split
    with pytest.raises(torch.OutOfMemoryError):
        a.malloc(18 * MiB)  # needs an 18 MiB segment: 20 + 18 > 24, nothing releasable
    assert a.reserved == 20 * MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    # max_split_size_mb:32 -> a 40 MiB cached block is not given to a 12 MiB request (new segment),
    # and a 36 MiB request may take it whole (40 < 36 + 20 MiB) without splitting.
    a = CachingAllocatorModel(settings=parse("max_split_size_mb:32"))
    a.free(a.malloc(40 * MiB))
    h = a.malloc(12 * MiB)
    assert a.reserved == 52 * MiB and a.block_size(h) == 12 * MiB
    h2 = a.malloc(36 * MiB)
    assert a.block_size(h2) == 40 * MiB and a.reserved == 52 * MiB


@pytest.mark.parametrize("conf", [None, "expandable_segments:True", "max_split_size_mb:20",
                                  "roundup_power2_divisions:4", "garbage_collection_threshold:0.5"])
def test_random_sequence_keeps_invariants(conf):
    rng = random.Random(0)
    sizes = [1, 200, 4096, 70_000, 600 * KiB, MiB, MiB + 1, 3 * MiB, 9 * MiB, 11 * MiB, 25 * MiB]
    for capacity in (None, 160 * MiB):
        a = CachingAllocatorModel(capacity=capacity, settings=parse(conf), allowed_maximum=capacity)
        live = {}
        for step in range(3000):
            if live and rng.random() < 0.45:
                h = rng.choice(list(live))
                a.free(h)
                del live[h]
            else:
                n = rng.choice(sizes) + rng.randrange(0, 4096)
                try:
                    h = a.malloc(n)
                except torch.OutOfMemoryError:
                    assert capacity is not None
                    continue
                live[h] = n
            assert a.allocated <= a.reserved
            assert sum(a.block_size(h) for h in live) == a.allocated == a.active
            assert a.requested == sum(live.values())
            assert all(a.block_size(h) >= round_size(n) for h, n in live.items())
            if capacity is not None:
                assert a.reserved <= capacity
            if step % 100 == 0:
                a._check_invariants()
        for h in list(live):
            a.free(h)
        a._check_invariants()
        assert (a.allocated, a.active, a.requested) == (0, 0, 0)
        assert a.peak_allocated <= a.peak_reserved
