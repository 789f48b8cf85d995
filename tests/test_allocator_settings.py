"""The allocator settings of PYTORCH_ALLOC_CONF against hand-worked allocation sequences (one test per rule, sizes
worked out in the comments from c10/cuda/CUDACachingAllocator.cpp), CUDA's out-of-memory message, and the
settings parser against torch's own parser."""

import re
from pathlib import Path

import pytest
import torch

from vlmprobe.errors import ConfigError
from vlmprobe.estimate.allocator import CachingAllocatorModel, format_size, oom_message, round_size
from vlmprobe.gpu.alloc_conf import KEYS, allowed_maximum, parse

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def test_roundup_power2_divisions_rounds_to_the_next_division():
    # divisions 4 everywhere: 5 MiB + 1 lies in [4, 8) MiB, steps of 1 MiB -> 6 MiB; 2.1 MiB in [2, 4) MiB,
    # steps of 512 KiB -> 2.5 MiB; 3 MiB is on a step; 1200 B is not above 512 x 4 -> the 512 B rule: 1536.
    divisions = parse("roundup_power2_divisions:4").roundup_power2_divisions
    assert round_size(5 * MiB + 1, divisions) == 6 * MiB
    assert round_size(2 * MiB + 100 * KiB, divisions) == 2 * MiB + 512 * KiB
    assert round_size(3 * MiB, divisions) == 3 * MiB
    assert round_size(1200, divisions) == 1536
    a = CachingAllocatorModel(settings=parse("roundup_power2_divisions:4"))
    h = a.malloc(5 * MiB + 1)  # a 20 MiB segment split at 6 MiB (the default would charge 5 MiB + 512)
    assert (a.block_size(h), a.allocated, a.reserved) == (6 * MiB, 6 * MiB, 20 * MiB)


def test_roundup_power2_divisions_list_sets_intervals_by_their_power_of_two():
    # [256:1,512:2,>:4]: 256 MB is interval 8 (1 MiB x 2^8); the first entry also fills 0..7; 512 -> 9; '>' fills
    # 10..15. Divisions 1 leave a size as it is (roundup_power2_next_division returns it).
    divisions = parse("roundup_power2_divisions:[256:1,512:2,>:4]").roundup_power2_divisions
    assert divisions == (1,) * 9 + (2,) + (4,) * 6
    assert round_size(300 * MiB + 1, divisions) == 300 * MiB + 1  # interval 8, divisions 1
    assert round_size(600 * MiB, divisions) == 768 * MiB  # interval 9: [512, 1024) MiB in 2 steps
    assert round_size(1100 * MiB, divisions) == 1280 * MiB  # interval 10: [1024, 2048) MiB in 4 steps


def test_large_segment_size_sets_the_segment_of_a_1_to_10_mib_request():
    a = CachingAllocatorModel(settings=parse("large_segment_size_mb:64"))
    a.malloc(3 * MiB)  # 1 MiB < 3 MiB < 10 MiB: a large_segment_size segment, 64 MiB instead of 20
    assert a.reserved == 64 * MiB


def test_max_split_size_releases_an_oversize_cached_segment_before_giving_up():
    # max_split_size_mb:32 on a 100 MiB card: 40 and 50 MiB segments, both cached whole (90 MiB reserved).
    a = CachingAllocatorModel(capacity=100 * MiB, settings=parse("max_split_size_mb:32"))
    for h in [a.malloc(40 * MiB), a.malloc(50 * MiB)]:
        a.free(h)
    # 12 MiB < 32 MiB may not split an oversize block; a 12 MiB segment does not fit (90 + 12 > 100);
    # release_available_cached_blocks frees the smallest oversize block >= max(12, 32) MiB, the 40 MiB one, and the
    # allocation succeeds without a retry: 50 + 12 MiB reserved.
    a.malloc(12 * MiB)
    assert (a.reserved, a.allocated, a.num_alloc_retries) == (62 * MiB, 12 * MiB, 0)
    # Without the setting the 40 MiB block is split: nothing is released.
    b = CachingAllocatorModel(capacity=100 * MiB)
    for h in [b.malloc(40 * MiB), b.malloc(50 * MiB)]:
        b.free(h)
    b.malloc(12 * MiB)
    assert (b.reserved, b.allocated) == (90 * MiB, 12 * MiB)
    a._check_invariants(), b._check_invariants()


def test_max_non_split_rounding_widens_what_an_oversize_request_may_take_whole():
    # max_split_size 32 MiB: a 40 MiB request may take a cached 64 MiB block only if 64 < 40 + rounding.
    for conf, reserved in (("max_split_size_mb:32", 64 * MiB + 40 * MiB), ("max_split_size_mb:32,max_non_split_rounding_mb:30", 64 * MiB)):
        a = CachingAllocatorModel(settings=parse(conf))
        a.free(a.malloc(64 * MiB))
        a.malloc(40 * MiB)  # 64 >= 40 + 20: new segment; 64 < 40 + 30: the 64 MiB block whole
        assert a.reserved == reserved, conf


def test_expandable_segments_grow_one_segment_by_pages():
    # Large pool pages are 20 MiB. 3 MiB maps one page (20 MiB reserved, 17 MiB cached behind the block); 30 MiB
    # does not fit the 17 MiB block, so the page after it is mapped and merged: a 37 MiB block, split at 30 MiB.
    a = CachingAllocatorModel(settings=parse("expandable_segments:True"))
    x, y = a.malloc(3 * MiB), a.malloc(30 * MiB)
    assert (a.allocated, a.reserved) == (33 * MiB, 40 * MiB)
    assert a.block_size(y) == 30 * MiB and y == x + 3 * MiB  # one segment: y right after x
    # The default allocator makes a 20 MiB and a 30 MiB segment.
    b = CachingAllocatorModel()
    b.malloc(3 * MiB), b.malloc(30 * MiB)
    assert (b.allocated, b.reserved) == (33 * MiB, 50 * MiB)
    a._check_invariants()


def test_expandable_segments_reuse_freed_pages_where_whole_segments_would_need_a_retry():
    # 60 MiB card. Default: 20 + 30 MiB segments cached; 50 MiB fits neither, 50 + 50 > 60 -> release both,
    # retry: 50 MiB reserved, one retry. Expandable: the 40 MiB free run grows by one page into 60: no retry.
    default = CachingAllocatorModel(capacity=60 * MiB)
    expandable = CachingAllocatorModel(capacity=60 * MiB, settings=parse("expandable_segments:True"))
    for a in (default, expandable):
        for h in [a.malloc(3 * MiB), a.malloc(30 * MiB)]:
            a.free(h)
        a.malloc(50 * MiB)
        a._check_invariants()
    assert (default.reserved, default.num_alloc_retries) == (50 * MiB, 1)
    assert (expandable.reserved, expandable.num_alloc_retries) == (60 * MiB, 0)


def test_expandable_segments_unmap_free_pages_when_memory_runs_out():
    # 60 MiB card, all of it mapped and free in the large pool. A 1 KiB request needs a 2 MiB page of the small
    # pool's segment: 60 + 2 > 60 -> release_cached_blocks unmaps the three free 20 MiB pages (the large segment,
    # empty, is dropped), the retry maps the page: 2 MiB reserved, one retry.
    a = CachingAllocatorModel(capacity=60 * MiB, settings=parse("expandable_segments:True"))
    a.free(a.malloc(50 * MiB))
    assert a.reserved == 60 * MiB
    a.malloc(KiB)
    assert (a.reserved, a.allocated, a.num_alloc_retries) == (2 * MiB, KiB, 1)
    a._check_invariants()


def test_expandable_segments_unmap_only_whole_free_pages():
    # 3 MiB in one 20 MiB page, then 50 MiB: the 17 MiB free behind it + 2 new pages (40 MiB) = a 57 MiB run, split
    # at 50 MiB: 60 MiB reserved, the last 7 MiB of page 3 free.
    a = CachingAllocatorModel(capacity=60 * MiB, settings=parse("expandable_segments:True"))
    a.malloc(3 * MiB)
    a.malloc(50 * MiB)
    assert (a.reserved, a.allocated) == (60 * MiB, 53 * MiB)
    # 8 MiB: the 7 MiB block is too small; one more page does not fit the card; the 7 MiB is the tail of a page
    # whose head is allocated, so release_cached_blocks unmaps nothing and the retry fails. CUDA names the
    # get_allocation_size of the request, 20 MiB for 1-10 MiB, with expandable segments too.
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 20\.00 MiB.*and 7\.00 MiB is reserved by "
                                                      r"PyTorch but unallocated"):
        a.malloc(8 * MiB)
    assert a.reserved == 60 * MiB
    a._check_invariants()


def test_garbage_collection_releases_the_oldest_cached_segments_past_the_threshold():
    # threshold 0.5 of a 100 MiB allowed maximum = 50 MiB. Ages count get_free_block calls of the large pool.
    a = CachingAllocatorModel(capacity=100 * MiB, settings=parse("garbage_collection_threshold:0.5"),
                              allowed_maximum=100 * MiB)
    a_ = a.malloc(20 * MiB)  # call 1: new 20 MiB segment, reserved 20
    b = a.malloc(22 * MiB)  # call 2: reserved 42
    a.free(a_)  # cached at call count 2
    a.malloc(26 * MiB)  # call 3: nothing fits; 42 <= 50, no collection; reserved 68
    a.free(b)  # cached at call count 3
    a.malloc(28 * MiB)  # call 4: nothing fits; 68 > 50: target 18 MiB; ages 2 and 1, mean 1.5: the 20 MiB one goes
    assert a.reserved == (22 + 26 + 28) * MiB  # the 22 MiB segment (age 1) stays
    # No memory fraction (allowed maximum) set: the source never collects, whatever the threshold.
    n = CachingAllocatorModel(capacity=100 * MiB, settings=parse("garbage_collection_threshold:0.5"))
    x, y = n.malloc(20 * MiB), n.malloc(22 * MiB)
    n.free(x), n.malloc(26 * MiB), n.free(y), n.malloc(28 * MiB)
    assert n.reserved == (20 + 22 + 26 + 28) * MiB
    a._check_invariants(), n._check_invariants()


def test_a_memory_fraction_is_an_allowed_maximum_and_cuda_says_so():
    # per_process_memory_fraction:0.5 of a 100 MiB card: 50 MiB allowed. 40 MiB fits; 12 MiB more does not, even
    # after releasing the (empty) cache: one retry, then CUDA's message with "50.00 MiB allowed; ".
    settings = parse("per_process_memory_fraction:0.5")
    allowed = allowed_maximum(settings, 100 * MiB, imposed=False)
    assert allowed == 50 * MiB and allowed_maximum(parse(None), 100 * MiB, imposed=True) == 100 * MiB
    assert allowed_maximum(parse(None), 100 * MiB, imposed=False) is None
    a = CachingAllocatorModel(capacity=100 * MiB, settings=settings, allowed_maximum=allowed)
    a.malloc(40 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        a.malloc(12 * MiB)
    assert str(raised.value) == (
        "CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total capacity of 100.00 MiB of which "
        "60.00 MiB is free. 50.00 MiB allowed; Of the allocated memory 40.00 MiB is allocated by PyTorch, and "
        "0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-"
        "cuda-alloc-conf)")
    assert (a.num_alloc_retries, a.num_ooms) == (1, 1)


def test_oom_message_is_cudas_format_string():
    # Figures like the ShareGPT4V report's in torch 2.13's wording (3.90625 GiB prints 3.91); 1024 B is still
    # "bytes", 1025 B is KiB.
    message = oom_message(4_194_304_000, 42_505_273_344, int(3.2 * GiB), int(28.77 * GiB), int(36.0 * GiB))
    assert message.startswith("CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of "
                              "39.59 GiB of which 3.20 GiB is free. Of the allocated memory 28.77 GiB is allocated "
                              "by PyTorch, and 7.23 GiB is reserved by PyTorch but unallocated.")
    assert [format_size(n) for n in (1024, 1025, MiB, MiB + 1, GiB)] == [
        "1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1024.00 MiB"]
    # vlmprobe reads the segment size back from either wording (oom_segment_bytes)
    from vlmprobe.sizes import segment_bytes_in_message

    assert segment_bytes_in_message(message) == round(3.91 * GiB)


# ---- the parser against torch's ------------------------------------------------------------------------------

GENERIC_CASES = [  # keys the installed torch parses itself (AcceleratorAllocatorConfig::parseArgs)
    "expandable_segments:True", "expandable_segments:False", "expandable_segments:true", "expandable_segments:[True]",
    "max_split_size_mb:128", "max_split_size_mb:20", "max_split_size_mb:10", "max_split_size_mb:abc",
    "max_split_size_mb", "max_non_split_rounding_mb:19", "max_non_split_rounding_mb:64",
    "large_segment_size_mb:10", "large_segment_size_mb:11", "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:1.5", "garbage_collection_threshold:0", "garbage_collection_threshold:abc",
    "roundup_power2_divisions:4", "roundup_power2_divisions:3", "roundup_power2_divisions:0",
    "roundup_power2_divisions:[256:1,512:2,>:4]", "roundup_power2_divisions:[3:4]", "roundup_power2_divisions:[256:3]",
    "roundup_power2_divisions:[1:0,>:4]", "max_split_size_mb:128 , expandable_segments : True",
    "max_split_size_mb:128expandable_segments:True", "expandable_segments:True:False", "",
    "pinned_use_background_threads:True", "pinned_use_background_threads:yes",
]


def _torch_accepts(text: str) -> bool:
    try:
        torch._C._accelerator_setAllocatorSettings(text)
    except (RuntimeError, ValueError):
        return False
    return True


def test_what_torch_refuses_is_refused_and_what_is_accepted_torch_accepts():
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        for text in GENERIC_CASES:
            torch_ok = _torch_accepts(text)
            try:
                parse(text)
                ours = True
            except ConfigError as exc:
                ours = False
                assert str(exc).startswith(f"measure.alloc_conf={text!r} is not allowed: ") and "\n" not in str(exc)
            assert ours == torch_ok, (text, ours, torch_ok)
    finally:
        torch._C._accelerator_setAllocatorSettings(before)


def test_values_torch_would_misread_are_refused():
    for text in ("max_split_size_mb:128abc", "max_split_size_mb:-1", "garbage_collection_threshold:0.6x"):
        with pytest.raises(ConfigError):
            parse(text)


def test_every_cuda_key_of_the_installed_headers_is_known_and_others_are_refused():
    header = Path(torch.__file__).parent / "include" / "c10" / "cuda" / "CUDAAllocatorConfig.h"
    if not header.is_file():
        pytest.skip("torch's C++ headers are not installed")
    block = re.search(r"static std::unordered_set<std::string> keys\{(.*?)\};", header.read_text(), re.S).group(1)
    block = re.sub(r"//[^\n]*", "", block)
    literals = re.findall(r'"([^"]*)"(\s*(?="))?', block)
    keys, pending = [], ""
    for text, joined in literals:  # adjacent literals ("release_lock_on_cud" "amalloc") are one string
        pending += text
        if not joined:
            keys.append(pending)
            pending = ""
    assert "release_lock_on_cudamalloc" in keys and len(keys) >= 10
    assert set(keys) <= set(KEYS)
    with pytest.raises(ConfigError, match="unrecognized key 'expandable_segment'"):
        parse("expandable_segment:True")
    assert parse("backend:cudaMallocAsync").backend == "cudaMallocAsync"
    with pytest.raises(ConfigError, match="backend takes native or cudaMallocAsync"):
        parse("backend:async")


def test_cuda_malloc_async_is_skipped_off_cuda_and_settings_reach_the_point(plan_points):
    (planned,) = plan_points(["model=nanovlm_tiny", "measure.backend=estimate", "measure.alloc_conf=backend:cudaMallocAsync"])
    assert planned.skip == ("backend:cudaMallocAsync is not modelled (the estimate backend models the native caching "
                            "allocator)")
    (planned,) = plan_points(["model=nanovlm_tiny", "measure.backend=estimate",
                              'measure.alloc_conf="max_split_size_mb:128,expandable_segments:True"'])
    assert planned.skip is None and planned.inputs["alloc_conf"] == "max_split_size_mb:128,expandable_segments:True"
    settings = parse(planned.config["measure"]["alloc_conf"])
    assert (settings.max_split_size, settings.expandable_segments) == (128 * MiB, True)
