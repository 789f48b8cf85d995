"""A deterministic model of PyTorch's CUDA caching allocator, for one device and one stream.

`memory_allocated()` counts the allocator's blocks, not the bytes tensors asked for, and the card sees the segments
it reserved (`memory_reserved()`): the difference is fragmentation. The tracker's allocate / free events go through a
pure-Python copy of the rules of `DeviceCachingAllocator` (c10/cuda/CUDACachingAllocator.cpp, constants in
c10/core/AllocatorConfig.h, torch 2.11-2.13; each rule names the source function it mirrors), with the settings of
PYTORCH_ALLOC_CONF that change device memory (vlmprobe.gpu.alloc_conf); the figures are its allocated, reserved,
active and requested bytes with their peaks, `num_alloc_retries` and `num_ooms`.
Not modelled: several streams, CUDA graphs and other private pools, `cudaMallocAsync`, cudaMalloc failures other than
the capacity model (the card's whole memory, the CUDA context not subtracted), and memory outside the caching
allocator. The rules one by one, and how torch's changed across 2.11-2.13: docs/estimate.md.

`Timeline` keeps allocated and reserved over a point's run for timeline.png: after each allocation (a free lowers
allocated and never changes reserved, so no maximum falls between two allocations), bucketed by keeping each
bucket's maximum, so the curve stays small and no peak is lost. A `watcher` (the tracker's attribution) is told of
each allocation and of an out-of-memory. Neither changes a figure of the model.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import torch

from vlmprobe.gpu.alloc_conf import AllocatorSettings

__all__ = ["CachingAllocatorModel", "format_size", "get_allocation_size", "kMinBlockSize", "kMinLargeAlloc",
           "kRoundLarge", "kSmallBuffer", "kSmallSize", "oom_message", "round_size", "roundup_power2_next_division",
           "Timeline"]

# c10/core/AllocatorConfig.h (torch 2.13; same values in CUDACachingAllocator.cpp before).
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1048576  # largest "small" allocation is 1 MiB
kSmallBuffer = 2097152  # "small" allocations are packed in 2 MiB blocks
kMinLargeAlloc = 10485760  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2097152  # round up large allocations to 2 MiB
SIZE_MAX = 2**64 - 1
ONE_EXA_BYTES = 1152921504606846976  # NativeCachingAllocator::allocate refuses >= 1 EiB
ROUNDUP_START_LOG2 = 20  # roundup_power2_divisions intervals start at 1 MiB (kRoundUpPowerOfTwoStart)
UNBOUNDED_DEVICE = 1 << 40  # bytes an expandable segment's address space covers with no capacity (1 TiB: above any card)

# Free blocks are kept per pool in a sorted list of int keys (size << _ADDR_BITS | address), so
# bisect gives the std::set order (size, then segment age/address) with C-speed comparisons.
_ADDR_BITS = 52
_ADDR_MASK = (1 << _ADDR_BITS) - 1
_FIRST_ADDR = kSmallBuffer  # synthetic addresses start here; 0 stays the null pointer


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """DeviceCachingAllocator::roundup_power2_next_division: the next of `divisions` equal steps between the
    powers of two around `size` (1200 with 4 divisions: steps 1024, 1280, 1536, 1792 -> 1280)."""
    if size <= 4 or divisions <= 1 or size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def round_size(size: int, divisions: tuple[int, ...] | None = None) -> int:
    """DeviceCachingAllocator::round_size; `divisions` is roundup_power2_divisions per power of two from 1 MiB
    (None or all 0: off, the default)."""
    if size < kMinBlockSize:
        return kMinBlockSize
    if divisions:
        index = min(max(size.bit_length() - 1 - ROUNDUP_START_LOG2, 0), len(divisions) - 1)
        d = divisions[index]
        if d > 0 and size > kMinBlockSize * d:
            return roundup_power2_next_division(size, d)
    return -(-size // kMinBlockSize) * kMinBlockSize


def get_allocation_size(size: int, large_segment_size: int = 20 * 1048576) -> int:
    """DeviceCachingAllocator::get_allocation_size: the cudaMalloc size for a rounded request."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return large_segment_size
    return -(-size // kRoundLarge) * kRoundLarge


def format_size(size: int) -> str:
    """c10's format_size (CUDACachingAllocator): 2 decimals, bytes / KiB / MiB / GiB, 1024-based, each unit up
    to and including its top. printf rounds an exact tie to even, as Python's formatting does."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def oom_message(alloc_size: int, device_total: int, device_free: int, allocated: int, reserved: int,
                allowed: int | None = None) -> str:
    """The message of DeviceCachingAllocator::malloc's OutOfMemoryError (torch 2.13), where NVML adds no
    per-process line and no private pool holds memory (neither is modelled)."""
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a total capacity of "
        f"{format_size(device_total)} of which {format_size(device_free)} is free. {allowed_info}"
        f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
        f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. If reserved but "
        f"unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        f"fragmentation.  See documentation for Memory Management  "
        f"(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    )


class _Segment:
    """ExpandableSegment: reserved address space of `pages` pages of `page` bytes, `mapped` per page."""

    __slots__ = ("base", "page", "mapped")

    def __init__(self, base: int, page: int, pages: int):
        self.base = base
        self.page = page
        self.mapped = bytearray(pages)


class _Block:
    """A Block: a range of one segment, allocated or cached (or, in an expandable segment, not backed by
    memory: `mapped` False); prev/next are its segment neighbours; `gc_base` is its pool's get_free_block
    count when it was cached."""

    __slots__ = ("addr", "size", "prev", "next", "allocated", "requested", "small", "mapped", "segment", "gc_base")

    def __init__(self, addr, size, prev, next_, small, segment=None, mapped=True):
        self.addr = addr
        self.size = size
        self.prev = prev
        self.next = next_
        self.allocated = False
        self.requested = 0
        self.small = small
        self.mapped = mapped
        self.segment = segment
        self.gc_base = 0


class _Pool:
    """A BlockPool: its cached blocks (`keys`, sorted), its unmapped ranges (`unmapped`, addresses, sorted) and
    get_free_blocks_call_count."""

    __slots__ = ("small", "keys", "unmapped", "calls")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[int] = []
        self.unmapped: list[int] = []
        self.calls = 0


def _key(block: _Block) -> int:
    return (block.size << _ADDR_BITS) | block.addr


class CachingAllocatorModel:
    """The caching allocator's block accounting for one device and one stream.

    `malloc(nbytes)` returns an opaque int handle (0 for a 0-byte request), `free(handle)` returns
    the block to the cache. `allocated`, `reserved`, `active` and `requested` are the current bytes
    of the matching `torch.cuda.memory_stats()` "*.all.current" entries, `peak_*` their peaks since
    construction or the last `reset_peak()`. `capacity` (bytes of the card, None for unlimited)
    turns on the out-of-memory path; `settings` are the allocator settings
    (vlmprobe.gpu.alloc_conf.parse); `allowed_maximum` the allowed_memory_maximum a memory
    fraction sets (vlmprobe.gpu.alloc_conf.allowed_maximum), None where none is set.
    """

    def __init__(self, capacity: int | None = None, settings: AllocatorSettings | None = None,
                 allowed_maximum: int | None = None):
        self.capacity = capacity
        self.settings = settings or AllocatorSettings()
        self.allowed_maximum = allowed_maximum
        self.max_split_size = self.settings.max_split_size or SIZE_MAX
        self._divisions = self.settings.roundup_power2_divisions if any(self.settings.roundup_power2_divisions) else None
        self._expandable = self.settings.expandable_segments
        # garbage collection runs only where a memory fraction sets the allowed maximum (malloc's condition)
        self._gc = allowed_maximum is not None and self.settings.garbage_collection_threshold > 0.0
        self.allocated = 0
        self.reserved = 0
        self.active = 0
        self.requested = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_active = 0
        self.peak_requested = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.last_oom: tuple[int, int] | None = None  # (block, segment) bytes of the last out-of-memory
        self._pools = {True: _Pool(True), False: _Pool(False)}  # small, large
        self._free: dict[int, _Block] = {}  # key -> cached free (mapped) block, both pools
        self._unmapped: dict[int, _Block] = {}  # address -> unmapped range of an expandable segment
        self._live: dict[int, _Block] = {}  # handle (= block address) -> allocated block
        self._next_addr = _FIRST_ADDR  # synthetic cudaMalloc / address reservation: increasing, never reused
        self.timeline: Timeline | None = None  # while set, allocated and reserved after each allocation
        self.watcher = None  # while set, its allocated(handle) after each allocation, ran_out(self) at an out-of-memory

    # ---- public interface -------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """DeviceCachingAllocator::malloc: allocate `nbytes`, return a handle for free()."""
        if nbytes <= 0:
            if nbytes == 0:  # NativeCachingAllocator::allocate: size 0 -> nullptr, no malloc
                return 0
            raise ValueError(f"negative allocation size {nbytes}")
        if nbytes >= ONE_EXA_BYTES:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.")
        size = round_size(nbytes, self._divisions)
        small = size <= kSmallSize  # get_pool
        pool = self._pools[small]
        alloc_size = get_allocation_size(size, self.settings.large_segment_size)

        block = self._get_free_block(pool, size)
        if block is None:
            if self._gc:
                self._garbage_collect()
            block = self._alloc_block(pool, size, alloc_size, False)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size, False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, True)
            if block is None:
                self.num_ooms += 1
                self.last_oom = (size, alloc_size)
                if self.watcher is not None:
                    self.watcher.ran_out(self)
                total = next(t for t in (self.capacity, self.allowed_maximum, _ADDR_MASK) if t is not None)
                raise torch.OutOfMemoryError(oom_message(alloc_size, total, total - self.reserved, self.allocated,
                                                         self.reserved, self.allowed_maximum))

        # should_split
        remaining = block.size - size
        if small or self._expandable:
            split = remaining >= kMinBlockSize
        else:
            split = size < self.max_split_size and remaining > kSmallSize
        # alloc_found_block: the front part is handed out, the remainder goes back to the pool.
        if split:
            front = _Block(block.addr, size, block.prev, block, small, block.segment)
            if block.prev is not None:
                block.prev.next = front
            block.prev = front
            block.addr += size
            block.size = remaining
            self._insert(pool, block)
            block = front
        block.allocated = True
        block.requested = nbytes
        self._live[block.addr] = block

        bsize = block.size
        self.allocated += bsize
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        self.active += bsize
        if self.active > self.peak_active:
            self.peak_active = self.active
        self.requested += nbytes
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        if self.timeline is not None:
            self.timeline.note(self.allocated, self.reserved)
        if self.watcher is not None:
            self.watcher.allocated(block.addr)
        return block.addr

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free + free_block: return the block to its pool, merging."""
        if handle == 0:  # NativeCachingAllocator::free(nullptr) returns
            return
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"invalid handle {handle}: not a live allocation")
        size = block.size
        self.allocated -= size
        self.active -= size
        self.requested -= block.requested
        block.allocated = False
        pool = self._pools[block.small]
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        self._insert(pool, block)

    def block_size(self, handle: int) -> int:
        """Bytes the live allocation `handle` is charged (its block's size); 0 for handle 0."""
        if handle == 0:
            return 0
        return self._live[handle].size

    def live_sizes(self) -> dict[int, int]:
        """handle -> bytes charged (its block's size), of every live allocation."""
        return {handle: block.size for handle, block in self._live.items()}

    def reset_peak(self) -> None:
        """resetPeakStats: every peak becomes its current value."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.peak_active = self.active
        self.peak_requested = self.requested

    # ---- pool bookkeeping ---------------------------------------------------------------------

    def _insert(self, pool: _Pool, block: _Block) -> None:
        """BlockPool::insert_into_blocks: cache a free block, remembering the pool's get_free_block count."""
        key = _key(block)
        insort(pool.keys, key)
        self._free[key] = block
        block.gc_base = pool.calls

    def _remove(self, pool: _Pool, block: _Block) -> None:
        key = _key(block)
        del pool.keys[bisect_left(pool.keys, key)]
        del self._free[key]

    def _insert_unmapped(self, pool: _Pool, block: _Block) -> None:
        insort(pool.unmapped, block.addr)
        self._unmapped[block.addr] = block

    def _remove_unmapped(self, pool: _Pool, block: _Block) -> None:
        del pool.unmapped[bisect_left(pool.unmapped, block.addr)]
        del self._unmapped[block.addr]

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """try_merge_blocks: `dst` (in no set) absorbs its neighbour `src` when that is free and mapped alike."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove(pool, src)
        else:
            self._remove_unmapped(pool, src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    # ---- DeviceCachingAllocator internals ---------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """get_free_block: smallest cached block >= size (lower_bound), with the expandable and oversize rules."""
        if self._gc:
            pool.calls += 1  # block reuse intervals, counted only while garbage collection is on
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)
        if i == len(keys):
            return None
        block = self._free[keys[i]]
        # A block an expandable segment could grow counts as large as it could grow to: take the next
        # larger block while that one could grow less.
        while block.segment is not None and i + 1 < len(keys):
            nxt = self._free[keys[i + 1]]
            if _expandable_size(nxt) >= _expandable_size(block):
                break
            i, block = i + 1, nxt
        mss = self.max_split_size
        if mss != SIZE_MAX:
            # Do not return an oversized block for a large request
            if size < mss and block.size >= mss:
                return None
            # Allow oversized block size to be rounded up but within a limit
            if size >= mss and block.size >= size + self.settings.max_non_split_rounding_size:
                return None
        self._remove(pool, block)
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, is_retry: bool) -> _Block | None:
        """alloc_block: a new segment (cudaMalloc), or pages mapped into an expandable segment."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.allowed_maximum is not None and self.reserved + alloc_size > self.allowed_maximum:
            return None  # set_fraction: past the allowed maximum, cudaErrorMemoryAllocation without a cudaMalloc
        if self._expandable:
            return self._allocate_expandable(pool, size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None  # cudaErrorMemoryAllocation
        if self._next_addr + alloc_size > _ADDR_MASK:
            return None  # the model's addresses run out (4 PiB, beyond any card): out of memory, as on a card
        addr = self._new_address_range(alloc_size)
        self._grow(alloc_size)
        return _Block(addr, alloc_size, None, None, pool.small)

    def _new_address_range(self, nbytes: int) -> int:
        addr = self._next_addr
        self._next_addr += nbytes
        if self._next_addr > _ADDR_MASK:
            raise OverflowError("synthetic address space exhausted")
        return addr

    def _allocate_expandable(self, pool: _Pool, size: int) -> _Block | None:
        """try_allocate_expandable_block: map pages at the lowest address with room for `size` bytes."""
        block = self._find_expandable_block(pool, size)
        if not block.mapped and not self._map(pool, block, min(block.size, size)):
            return None
        while block.size < size:  # a free block followed by unmapped space: map behind it and merge
            nxt = block.next
            if not self._map(pool, nxt, min(size - block.size, nxt.size)):
                return None
            block = nxt
        self._remove(pool, block)
        return block

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """find_expandable_block: the lowest unmapped range (with the free block before it) that has room, or a
        new segment whose address space covers 9/8 of the card."""
        for addr in pool.unmapped:
            block = self._unmapped[addr]
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            room, b = 0, block
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return block
        page = kSmallBuffer if pool.small else self.settings.large_segment_size
        device = self.capacity if self.capacity is not None else UNBOUNDED_DEVICE
        pages = -(-(device + device // 8) // page)
        segment = _Segment(self._new_address_range(pages * page), page, pages)
        block = _Block(segment.base, pages * page, None, None, pool.small, segment, mapped=False)
        self._insert_unmapped(pool, block)
        return block

    def _map(self, pool: _Pool, block: _Block, size: int) -> bool:
        """map_block: back the first `size` bytes of an unmapped range with whole pages, if the card has them."""
        segment = block.segment
        first = (block.addr - segment.base) // segment.page
        last = -(-(block.addr - segment.base + size) // segment.page)
        nbytes = (last - first) * segment.page
        if nbytes == 0 or (self.capacity is not None and self.reserved + nbytes > self.capacity):
            return False  # cuMemCreate fails: CUDA_ERROR_OUT_OF_MEMORY
        segment.mapped[first:last] = b"\x01" * (last - first)
        self._remove_unmapped(pool, block)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.addr + nbytes, block.size - nbytes, block, block.next, pool.small, segment, mapped=False)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = nbytes
            self._insert_unmapped(pool, rest)
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        self._insert(pool, block)
        self._grow(nbytes)
        return True

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """unmap_block: give back the whole pages inside a cached block of an expandable segment."""
        segment = block.segment
        offset = block.addr - segment.base
        first = -(-offset // segment.page)
        last = (offset + block.size) // segment.page
        if first >= last:
            return
        self._remove(pool, block)
        start, nbytes = segment.base + first * segment.page, (last - first) * segment.page
        before, after = start - block.addr, block.size - (start - block.addr) - nbytes
        if before > 0:
            head = _Block(block.addr, before, block.prev, block, pool.small, segment)
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            self._insert(pool, head)
        if after > 0:
            tail = _Block(start + nbytes, after, block, block.next, pool.small, segment)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            self._insert(pool, tail)
        block.addr, block.size, block.mapped = start, nbytes, False
        segment.mapped[first:last] = bytes(last - first)
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        self._insert_unmapped(pool, block)
        self.reserved -= nbytes

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        """release_block: cudaFree a cached, unsplit segment."""
        self._remove(pool, block)
        self.reserved -= block.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: free oversize cached segments, only if max_split_size is set.
        Only whole (unsplit) segments are released here; the source would cudaFree a split block in that
        case, which segment sizes the allocator makes do not produce with the default segment size."""
        mss = self.max_split_size
        if mss == SIZE_MAX:
            return False
        keys = pool.keys
        target = max(size, mss)
        i = bisect_left(keys, target << _ADDR_BITS)
        if i < len(keys) and self._free[keys[i]].segment is None:
            block = self._free[keys[i]]
            if block.prev is None and block.next is None:
                self._release_block(pool, block)
            return True
        # No single block is large enough; free oversize blocks, largest first.
        released = 0
        for key in reversed(keys[:i]):
            block = self._free[key]
            if released >= target or block.size < mss:
                break
            if block.segment is None and block.prev is None and block.next is None:
                released += block.size
                self._release_block(pool, block)
        return released >= target

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache (emptyCache): every cached segment no live block uses goes back to CUDA."""
        self._release_cached_blocks()

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks / release_blocks: cudaFree every cached unsplit segment of both pools, unmap the
        free pages of expandable segments, drop a segment with nothing left mapped."""
        for pool in (self._pools[False], self._pools[True]):
            to_unmap = []
            for key in list(pool.keys):
                block = self._free[key]
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(pool, block)
            for block in to_unmap:
                self._unmap(pool, block)
                if not block.mapped and block.prev is None and block.next is None:
                    self._remove_unmapped(pool, block)  # release_expandable_segment

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: past threshold x allowed maximum, release cached whole segments of the
        large pool whose age (get_free_block calls since they were cached) is at least the mean age, again
        and again, until reserved is back under the threshold or nothing more can go."""
        threshold = int(self.settings.garbage_collection_threshold * self.allowed_maximum)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self._pools[False]

        def freeable():
            return [b for b in (self._free[k] for k in pool.keys)
                    if b.prev is None and b.next is None and b.segment is None]

        blocks = freeable()
        total_age, count = sum(pool.calls - b.gc_base for b in blocks), len(blocks)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in freeable():
                age = pool.calls - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(pool, block)

    def _check_invariants(self) -> None:
        """Consistency of the block structure and the counters (for tests; O(number of blocks))."""
        heads = set()
        for block in [*self._free.values(), *self._live.values(), *self._unmapped.values()]:
            head = block
            while head.prev is not None:
                head = head.prev
            heads.add(head)
        mapped = allocated = 0
        for head in heads:
            b, prev = head, None
            while b is not None:
                assert b.prev is prev
                if prev is not None:
                    assert prev.addr + prev.size == b.addr, "blocks of a segment must tile it"
                    assert prev.allocated or b.allocated or prev.mapped != b.mapped, "adjacent free blocks not merged"
                    assert prev.small == b.small and prev.segment is b.segment
                pool = self._pools[b.small]
                if b.allocated:
                    assert self._live[b.addr] is b and _key(b) not in self._free and b.mapped
                    allocated += b.size
                elif b.mapped:
                    assert self._free[_key(b)] is b and _key(b) in pool.keys
                else:
                    assert self._unmapped[b.addr] is b and b.addr in pool.unmapped
                    assert not any(b.segment.mapped[(b.addr - b.segment.base) // b.segment.page:
                                                    (b.addr + b.size - b.segment.base) // b.segment.page])
                if b.mapped:
                    mapped += b.size
                prev, b = b, b.next
        assert mapped == self.reserved, (mapped, self.reserved)
        assert allocated == self.allocated == self.active
        pools = self._pools.values()
        assert sum(len(p.keys) for p in pools) == len(self._free)
        assert sum(len(p.unmapped) for p in pools) == len(self._unmapped)
        assert all(p.keys == sorted(p.keys) and p.unmapped == sorted(p.unmapped) for p in pools)
        assert self.allocated <= self.reserved
        assert self.peak_allocated >= self.allocated and self.peak_reserved >= self.reserved


class Timeline:
    """Allocated and reserved bytes after each allocation of a run, at most `limit` samples: the allocations are
    cut into buckets of `width` allocations and a bucket keeps the maximum of each figure over it; when there are
    `limit` buckets, each pair is merged (the maximum of the two) and the width doubles. So the samples hold
    between limit / 2 and limit buckets, the highest allocated and reserved of the run among them. `phases`: (name,
    first allocation, allocation after its last), in allocations, from `begin` / `end`."""

    def __init__(self, limit: int = 2000):
        self.limit = limit - limit % 2 or 2
        self.width = 1
        self.count = 0  # allocations noted
        self.allocated: list[int] = []  # per bucket, its maximum (the last bucket may be filling)
        self.reserved: list[int] = []
        self.phases: list[list] = []

    def note(self, allocated: int, reserved: int) -> None:
        if self.count % self.width:  # the last bucket is filling
            if allocated > self.allocated[-1]:
                self.allocated[-1] = allocated
            if reserved > self.reserved[-1]:
                self.reserved[-1] = reserved
        else:
            if len(self.allocated) == self.limit:
                self.allocated = [max(pair) for pair in zip(self.allocated[::2], self.allocated[1::2])]
                self.reserved = [max(pair) for pair in zip(self.reserved[::2], self.reserved[1::2])]
                self.width *= 2
            self.allocated.append(allocated)
            self.reserved.append(reserved)
        self.count += 1

    def begin(self, phase: str) -> None:
        self.phases.append([str(phase), self.count, None])

    def end(self, phase: str) -> None:
        """Close the last open span of `phase` (no span open: one from where the last span ended)."""
        for span in reversed(self.phases):
            if span[0] == str(phase) and span[2] is None:
                span[2] = self.count
                return
        self.phases.append([str(phase), self.phases[-1][2] if self.phases else 0, self.count])

    def data(self) -> dict:
        """As plain data (JSON): `x` the first allocation of each bucket, `allocated` and `reserved` its maxima,
        `phases` [name, first, end] (an end of None: it ran to the end, as an out-of-memory leaves it)."""
        return {"unit": "allocations", "allocations": self.count, "width": self.width,
                "x": [i * self.width for i in range(len(self.allocated))],
                "allocated": list(self.allocated), "reserved": list(self.reserved),
                "phases": [list(span) for span in self.phases]}


def _expandable_size(block: _Block) -> int:
    """get_free_block's expandable_size: a block's size plus the unmapped range right after it."""
    return block.size + (block.next.size if block.next is not None and not block.next.mapped else 0)
