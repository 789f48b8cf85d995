"""A deterministic model of PyTorch's CUDA caching allocator, for one device and one stream.

`torch.cuda.memory_allocated()` / `max_memory_allocated()` count the sizes of the allocator's
*blocks*, not the bytes tensors asked for, and blocks are often larger than the request. This
module replays the sequence of (allocate n bytes / free that allocation) events the tracker sees
through a pure-Python copy of the rules of `DeviceCachingAllocator` in
`c10/cuda/CUDACachingAllocator.cpp` (constants in `c10/core/AllocatorConfig.h`), in its default
configuration, as in torch 2.11-2.13, and reports the `allocated_bytes`, `reserved_bytes`,
`active_bytes` and `requested_bytes` figures ("all"/aggregate stat type) with their peaks.

Modelled (each rule names the source function it mirrors):
- `round_size`: requests round up to a multiple of kMinBlockSize (512 B); roundup_power2_divisions
  is off by default and not modelled.
- `get_pool`: rounded sizes <= kSmallSize (1 MiB) use the small pool, larger ones the large pool.
- `get_allocation_size`: a new segment (cudaMalloc) is kSmallBuffer (2 MiB) for small requests,
  the large segment size (20 MiB) for requests < kMinLargeAlloc (10 MiB), else the request
  rounded up to kRoundLarge (2 MiB).
- `get_free_block`: best fit, the smallest cached free block >= the request in the request's pool;
  ties go to the older segment, then the lower address; with a finite max_split_size, a request
  < max_split_size never takes a block >= max_split_size and a request >= max_split_size only
  takes a block < request + max_non_split_rounding_size (20 MiB).
- `should_split` / `alloc_found_block`: the block is split, the front part handed out and the
  rest cached, when the remainder is >= kMinBlockSize (small pool) or > kSmallSize and the
  request < max_split_size (large pool); otherwise the whole block is charged.
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its segment.
- `alloc_block` / `release_available_cached_blocks` / `release_cached_blocks` and the OOM error
  of `malloc`, only when a `capacity` is given: a new segment must fit in capacity - reserved;
  if not, whole cached free segments are released (cudaFree), the allocation retried once
  (`num_alloc_retries`), then `torch.OutOfMemoryError` is raised, its message saying
  "Tried to allocate <segment size> bytes" (CUDA reports the segment size, formatted).
- Stats (`Stat::increase`/`decrease`, `resetPeakStats`): allocated/active rise by the block size
  on malloc and fall on free, requested by the unrounded size, reserved by the segment size on
  cudaMalloc and only falls when a cached segment is released; `reset_peak()` sets every peak to
  its current value, as `torch.cuda.reset_peak_memory_stats()` does.
- `NativeCachingAllocator::allocate`: a 0-byte request returns a null pointer and charges nothing
  (handle 0 here; freeing it is a no-op); a request >= 1 EiB raises OutOfMemoryError.

Across 2.11-2.13 these rules are the same in the default configuration. What changed around them:
kLargeBuffer became `AcceleratorAllocatorConfig::large_segment_size()` (configurable through
`large_segment_size_mb`, default still 20 MiB, pytorch#172056; the 2.13 headers have it), and
max_non_split_rounding_size defaults to it; kRoundLarge and the other constants are unchanged;
the max_split_size rules are unchanged (recent sources also skip expandable segments in
release_available_cached_blocks, which does not matter here). The tie-break between equal-size
free blocks did change: by address in 2.11, then by a per-Block counter (pytorch#178362, spring
2026), then by the segment's allocation counter and address for all pools (pytorch#183591, May
2026, before the 2.13 branch cut; not checked against the 2.13 tag). Segments here get
increasing synthetic addresses, so ordering by (size, address) is exactly that counter order;
for the address-ordered versions it assumes cudaMalloc returns increasing addresses, which the
driver does not promise. Only which of several equal-size blocks is reused depends on this.

Not modelled: multiple streams and record_stream (cross-stream frees delayed by events, so
active > allocated), expandable_segments, garbage_collection_threshold and
set_per_process_memory_fraction, CUDA graphs and other private pools (MemPool, use_mem_pool),
free-memory callbacks (CUDA IPC), roundup_power2_divisions, cudaMalloc failures other than the
capacity model (driver fragmentation, other processes), and device memory that does not go
through the caching allocator at all (the CUDA context, the libraries' own cudaMalloc calls such
as NCCL's buffers or cuBLAS/cuDNN handle state), which `memory_allocated()` does not count either.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import torch

# c10/core/AllocatorConfig.h (torch 2.13; same values in CUDACachingAllocator.cpp before).
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1048576  # largest "small" allocation is 1 MiB
kSmallBuffer = 2097152  # "small" allocations are packed in 2 MiB blocks
kMinLargeAlloc = 10485760  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2097152  # round up large allocations to 2 MiB
# AcceleratorAllocatorConfig defaults: large_segment_size (the old kLargeBuffer) and
# max_non_split_rounding_size, both 20 MiB; max_split_size unlimited (SIZE_MAX).
kLargeBuffer = 20971520
MAX_NON_SPLIT_ROUNDING_SIZE = kLargeBuffer
SIZE_MAX = 2**64 - 1
ONE_EXA_BYTES = 1152921504606846976  # NativeCachingAllocator::allocate refuses >= 1 EiB

# Free blocks are kept per pool in a sorted list of int keys (size << _ADDR_BITS | address), so
# bisect gives the std::set order (size, then segment age/address) with C-speed comparisons.
_ADDR_BITS = 52
_ADDR_MASK = (1 << _ADDR_BITS) - 1
_FIRST_ADDR = kSmallBuffer  # synthetic addresses start here; 0 stays the null pointer


def round_size(size: int) -> int:
    """DeviceCachingAllocator::round_size with roundup_power2_divisions off (the default)."""
    if size < kMinBlockSize:
        return kMinBlockSize
    return -(-size // kMinBlockSize) * kMinBlockSize


def get_allocation_size(size: int) -> int:
    """DeviceCachingAllocator::get_allocation_size: the cudaMalloc size for a rounded request."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return -(-size // kRoundLarge) * kRoundLarge


class _Block:
    """A Block: a range of one segment, allocated or cached; prev/next are its segment neighbours."""

    __slots__ = ("addr", "size", "prev", "next", "allocated", "requested", "small")

    def __init__(self, addr, size, prev, next_, small):
        self.addr = addr
        self.size = size
        self.prev = prev
        self.next = next_
        self.allocated = False
        self.requested = 0
        self.small = small


class CachingAllocatorModel:
    """The caching allocator's block accounting for one device and one stream.

    `malloc(nbytes)` returns an opaque int handle (0 for a 0-byte request), `free(handle)` returns
    the block to the cache. `allocated`, `reserved`, `active` and `requested` are the current bytes
    of the matching `torch.cuda.memory_stats()` "*.all.current" entries, `peak_*` their peaks since
    construction or the last `reset_peak()`. `capacity` (bytes the allocator may cudaMalloc in
    total, None for unlimited) turns on the out-of-memory path; `max_split_size` is the
    `max_split_size_mb` setting in bytes (None: unlimited, the default).
    """

    def __init__(self, capacity: int | None = None, *, max_split_size: int | None = None):
        self.capacity = capacity
        self.max_split_size = SIZE_MAX if max_split_size is None else max_split_size
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
        self._small_keys: list[int] = []  # cached free blocks of the small pool, sorted
        self._large_keys: list[int] = []  # ... of the large pool
        self._free: dict[int, _Block] = {}  # key -> cached free block, both pools
        self._live: dict[int, _Block] = {}  # handle (= block address) -> allocated block
        self._next_addr = _FIRST_ADDR  # synthetic cudaMalloc: increasing, never reused

    # ---- public interface -------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """DeviceCachingAllocator::malloc: allocate `nbytes`, return a handle for free()."""
        if nbytes <= 0:
            if nbytes == 0:  # NativeCachingAllocator::allocate: size 0 -> nullptr, no malloc
                return 0
            raise ValueError(f"negative allocation size {nbytes}")
        if nbytes >= ONE_EXA_BYTES:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.")
        size = round_size(nbytes)
        small = size <= kSmallSize  # get_pool
        keys = self._small_keys if small else self._large_keys

        block = self._get_free_block(keys, size)
        if block is None:
            alloc_size = get_allocation_size(size)
            block = self._alloc_block(alloc_size, small, False)
            if block is None:
                if self._release_available_cached_blocks(keys, size):
                    block = self._alloc_block(alloc_size, small, False)
                if block is None:
                    self._release_cached_blocks()
                    block = self._alloc_block(alloc_size, small, True)
                if block is None:
                    self.num_ooms += 1
                    self.last_oom = (size, alloc_size)
                    raise torch.OutOfMemoryError(self._oom_message(nbytes, size, alloc_size))

        # should_split
        remaining = block.size - size
        if small:
            split = remaining >= kMinBlockSize
        else:
            split = size < self.max_split_size and remaining > kSmallSize
        # alloc_found_block: the front part is handed out, the remainder goes back to the pool.
        if split:
            front = _Block(block.addr, size, block.prev, block, small)
            if block.prev is not None:
                block.prev.next = front
            block.prev = front
            block.addr += size
            block.size = remaining
            key = (remaining << _ADDR_BITS) | block.addr
            insort(keys, key)
            self._free[key] = block
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
        return block.addr

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free + free_block: return the block to its pool, merging."""
        if handle == 0:  # NativeCachingAllocator::free(nullptr) returns
            return
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"invalid handle {handle}: not a live allocation")
        size = block.size
        requested = block.requested
        block.allocated = False
        self.allocated -= size
        keys = self._small_keys if block.small else self._large_keys
        free = self._free
        # try_merge_blocks with prev, then next (same segment, not allocated).
        prev = block.prev
        if prev is not None and not prev.allocated:
            key = (prev.size << _ADDR_BITS) | prev.addr
            del keys[bisect_left(keys, key)]
            del free[key]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            key = (nxt.size << _ADDR_BITS) | nxt.addr
            del keys[bisect_left(keys, key)]
            del free[key]
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        key = (block.size << _ADDR_BITS) | block.addr
        insort(keys, key)
        free[key] = block
        self.active -= size
        self.requested -= requested

    def block_size(self, handle: int) -> int:
        """Bytes the live allocation `handle` is charged (its block's size); 0 for handle 0."""
        if handle == 0:
            return 0
        return self._live[handle].size

    def reset_peak(self) -> None:
        """resetPeakStats: every peak becomes its current value."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.peak_active = self.active
        self.peak_requested = self.requested

    # ---- DeviceCachingAllocator internals ---------------------------------------------------

    def _get_free_block(self, keys: list[int], size: int) -> _Block | None:
        """get_free_block: smallest cached block >= size (lower_bound), with the oversize rules."""
        i = bisect_left(keys, size << _ADDR_BITS)
        if i == len(keys):
            return None
        key = keys[i]
        mss = self.max_split_size
        if mss != SIZE_MAX:
            bsize = key >> _ADDR_BITS
            # Do not return an oversized block for a large request
            if size < mss and bsize >= mss:
                return None
            # Allow oversized block size to be rounded up but within a limit
            if size >= mss and bsize >= size + MAX_NON_SPLIT_ROUNDING_SIZE:
                return None
        del keys[i]
        return self._free.pop(key)

    def _alloc_block(self, alloc_size: int, small: bool, is_retry: bool) -> _Block | None:
        """alloc_block: cudaMalloc a new segment; fails when it does not fit in `capacity`."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None  # cudaErrorMemoryAllocation
        addr = self._next_addr
        self._next_addr += alloc_size
        if self._next_addr > _ADDR_MASK:
            raise OverflowError("synthetic address space exhausted")
        self.reserved += alloc_size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return _Block(addr, alloc_size, None, None, small)

    def _release_block(self, key: int) -> None:
        """release_block: cudaFree a cached, unsplit segment (caller removes `key` from `keys`)."""
        block = self._free.pop(key)
        self.reserved -= block.size

    def _release_available_cached_blocks(self, keys: list[int], size: int) -> bool:
        """release_available_cached_blocks: free oversize cached segments, only if max_split_size
        is set. Only whole (unsplit) segments are released here; the source would cudaFree a
        split block in that case, which cannot happen with segment sizes the allocator makes."""
        mss = self.max_split_size
        if mss == SIZE_MAX:
            return False
        target = max(size, mss)
        i = bisect_left(keys, target << _ADDR_BITS)
        if i < len(keys):
            key = keys[i]
            block = self._free[key]
            if block.prev is None and block.next is None:
                del keys[i]
                self._release_block(key)
            return True
        # No single block is large enough; free oversize blocks, largest first.
        released = 0
        j = len(keys) - 1
        while j >= 0 and released < target and (keys[j] >> _ADDR_BITS) >= mss:
            key = keys[j]
            block = self._free[key]
            if block.prev is None and block.next is None:
                released += block.size
                del keys[j]
                self._release_block(key)
            j -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks / release_blocks: cudaFree every cached unsplit segment."""
        for keys in (self._large_keys, self._small_keys):
            kept = []
            for key in keys:
                block = self._free[key]
                if block.prev is None and block.next is None:
                    self._release_block(key)
                else:
                    kept.append(key)
            keys[:] = kept

    def _oom_message(self, nbytes: int, size: int, alloc_size: int) -> str:
        free = self.capacity - self.reserved
        return (
            f"CUDA out of memory (vlmprobe allocator model). Tried to allocate {alloc_size} bytes "
            f"(a new segment for a request of {nbytes} bytes, rounded to {size}). The modelled device "
            f"has a capacity of {self.capacity} bytes of which {free} bytes is free. Of the allocated "
            f"memory {self.allocated} bytes is allocated by PyTorch, and "
            f"{self.reserved - self.allocated} bytes is reserved by PyTorch but unallocated."
        )

    def _check_invariants(self) -> None:
        """Consistency of the block structure and the counters (for tests; O(number of blocks))."""
        heads = set()
        for block in list(self._free.values()) + list(self._live.values()):
            head = block
            while head.prev is not None:
                head = head.prev
            heads.add(head)
        total = allocated = 0
        for head in heads:
            b, prev, seg = head, None, 0
            while b is not None:
                assert b.prev is prev
                if prev is not None:
                    assert prev.addr + prev.size == b.addr, "blocks of a segment must tile it"
                    assert not (not prev.allocated and not b.allocated), "adjacent free blocks not merged"
                    assert prev.small == b.small
                key = (b.size << _ADDR_BITS) | b.addr
                if b.allocated:
                    assert self._live[b.addr] is b and key not in self._free
                    allocated += b.size
                else:
                    assert self._free[key] is b
                    assert key in (self._small_keys if b.small else self._large_keys)
                seg += b.size
                prev, b = b, b.next
            total += seg
        assert total == self.reserved, (total, self.reserved)
        assert allocated == self.allocated == self.active
        assert len(self._small_keys) + len(self._large_keys) == len(self._free)
        assert self._small_keys == sorted(self._small_keys)
        assert self._large_keys == sorted(self._large_keys)
        assert self.allocated <= self.reserved
        assert self.peak_allocated >= self.allocated and self.peak_reserved >= self.reserved
