"""`measure.alloc_conf` read as torch reads PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, into the settings the
allocator model applies.

The rules are torch 2.13's (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp): entries
`key:value` (a list value in brackets) separated by `,`, whitespace dropped. A key neither parser knows is
refused, as the CUDA build refuses it; values follow each parse function's checks and messages. A number torch
would silently misread ("128abc" as 128, "-1" as 2**64 - 1) is refused: a setting that does not mean what it
says is bad input. Settings with no effect on device memory are checked and otherwise ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vlmprobe.errors import ConfigError
from vlmprobe.sizes import MiB

__all__ = ["AllocatorSettings", "allowed_maximum", "KEYS", "parse"]

LARGE_SEGMENT_DEFAULT = 20 * MiB  # AcceleratorAllocatorConfig::large_segment_size_ default (the old kLargeBuffer)
MIN_SPLIT_MB = 20  # max_split_size_mb / max_non_split_rounding_mb: >= kLargeBuffer / kMB
MIN_LARGE_SEGMENT_MB = 10  # large_segment_size_mb must be > kMinLargeAlloc / kMB ("must be > 10 MB")
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one entry per power of two
MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads()

BOOL_KEYS = ("expandable_segments", "pinned_use_background_threads", "release_lock_on_cudamalloc",
             "release_lock_on_hipmalloc", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
             "graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom")
KEYS = ("backend", "max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
        "garbage_collection_threshold", "roundup_power2_divisions", "per_process_memory_fraction",
        "pinned_num_register_threads", "pinned_reserve_segment_size_mb", "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb", *BOOL_KEYS)
BACKENDS = ("native", "cudaMallocAsync")
_SPECIAL = re.compile(r"([,:\[\]])")
_UINT = re.compile(r"\d+")
_FLOAT = re.compile(r"(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclass(frozen=True)
class AllocatorSettings:
    """The device allocator settings a configuration string sets; defaults are torch's."""

    max_split_size: int | None = None  # bytes; blocks this large are never split (None: unlimited, SIZE_MAX)
    max_non_split_rounding_size: int = LARGE_SEGMENT_DEFAULT  # bytes an oversize block may exceed a request by
    large_segment_size: int = LARGE_SEGMENT_DEFAULT  # bytes of the segment made for a 1-10 MiB request
    garbage_collection_threshold: float = 0.0  # fraction of the allowed maximum; 0: off
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS  # per power of two from 1 MiB; 0: off
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0  # of the card's memory; below 1 sets the allowed maximum
    backend: str = "native"
    text: str | None = field(default=None, compare=False)  # the configuration string as given


def allowed_maximum(settings: AllocatorSettings, capacity: int | None, imposed: bool) -> int | None:
    """The caching allocator's `allowed_memory_maximum` (set only where a memory fraction below 1 is): vlmprobe
    imposes measure.device_memory on CUDA with set_per_process_memory_fraction, so an imposed capacity is one;
    otherwise per_process_memory_fraction of the card's memory (DeviceCachingAllocator's constructor)."""
    if capacity is None:
        return None
    if imposed:
        return capacity
    if settings.per_process_memory_fraction < 1.0:
        return int(settings.per_process_memory_fraction * capacity)
    return None


def tokens(text: str) -> list[str]:
    """ConfigTokenizer: `,` `:` `[` `]` are tokens of their own; whitespace is dropped everywhere."""
    out = []
    for part in _SPECIAL.split(text):
        part = "".join(part.split())
        if part:
            out.append(part)
    return out


class _Reader:
    def __init__(self, text: str):
        self.text = text
        self.tokens = tokens(text)

    def refuse(self, why: str) -> ConfigError:
        return ConfigError(f"measure.alloc_conf={self.text!r} is not allowed: {why}")

    def token(self, i: int, what: str) -> str:
        if i >= len(self.tokens):
            raise self.refuse(f"it ends where {what} should follow")
        return self.tokens[i]

    def expect(self, i: int, token: str, after: str) -> None:
        got = self.token(i, f"'{token}' after {after}")
        if got != token:
            raise self.refuse(f"expected '{token}' after {after}, got '{got}'")

    def uint(self, i: int, key: str) -> int:
        value = self.token(i, f"a value for {key}")
        if not _UINT.fullmatch(value):
            raise self.refuse(f"{key} takes a non-negative integer, got '{value}'")
        return int(value)

    def number(self, i: int, key: str) -> float:
        value = self.token(i, f"a value for {key}")
        if not _FLOAT.fullmatch(value):
            raise self.refuse(f"{key} takes a number, got '{value}'")
        return float(value)

    def boolean(self, i: int, key: str) -> bool:
        value = self.token(i, f"a value for {key}")
        if value not in ("True", "False"):
            raise self.refuse(f"{key} takes True or False (capitalised), got '{value}'")
        return value == "True"


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _roundup_divisions(r: _Reader, i: int) -> tuple[tuple[int, ...], int]:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions: one power of two for every interval, or a list
    `[boundary_mb:divisions, ..., >:divisions]` (boundaries powers of two; divisions powers of two or 0)."""
    key = "roundup_power2_divisions"
    divisions = [0] * ROUNDUP_INTERVALS
    if r.token(i, f"a value for {key}") != "[":
        value = r.uint(i, key)
        if not _power_of_two(value):
            raise r.refuse(f"{key} takes a power of two (or a list [MB:divisions, ..., >:divisions]), got {value}")
        return (value,) * ROUNDUP_INTERVALS, i
    first, last = True, 0
    i += 1
    while r.token(i, f"']' closing {key}") != "]":
        boundary = r.tokens[i]
        r.expect(i + 1, ":", f"'{boundary}' in {key}")
        value = r.uint(i + 2, key)
        if value and not _power_of_two(value):
            raise r.refuse(f"{key}: divisions must be a power of two or 0, got {value}")
        if boundary == ">":
            divisions[last + 1:] = [value] * (ROUNDUP_INTERVALS - last - 1)
        else:
            if not _UINT.fullmatch(boundary) or not _power_of_two(int(boundary)):
                raise r.refuse(f"{key}: interval boundaries (MB) must be powers of two or '>', got '{boundary}'")
            index = min(int(boundary).bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index] = value
            last = index
        i += 3
        if r.token(i, f"']' closing {key}") != "]":
            r.expect(i, ",", f"an entry of {key}")
            i += 1
    return tuple(divisions), i


def parse(text: str | None) -> AllocatorSettings:
    """The settings `text` (PYTORCH_ALLOC_CONF syntax) sets; ConfigError (one line) for a key torch does not know
    or a value it refuses. None or "" is the default allocator."""
    if not text:
        return AllocatorSettings(text=text)
    r = _Reader(text)
    values: dict = {}
    i = 0
    while i < len(r.tokens):
        key = r.tokens[i]
        if key not in KEYS:
            raise r.refuse(f"unrecognized key '{key}' (torch's CUDA allocator knows {', '.join(sorted(KEYS))})")
        r.expect(i + 1, ":", key)
        i += 2
        if key in BOOL_KEYS:
            values[key] = r.boolean(i, key)
        elif key == "backend":
            value = r.token(i, "a value for backend")
            if value not in BACKENDS:
                raise r.refuse(f"backend takes {' or '.join(BACKENDS)}, got '{value}'")
            values[key] = value
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            value = r.uint(i, key)
            if value < MIN_SPLIT_MB:
                raise r.refuse(f"{key} must be >= {MIN_SPLIT_MB}, got {value}")
            values[key] = value * MiB
        elif key == "large_segment_size_mb":
            value = r.uint(i, key)
            if value <= MIN_LARGE_SEGMENT_MB:
                raise r.refuse(f"{key} must be > {MIN_LARGE_SEGMENT_MB}, got {value}")
            values[key] = value * MiB
        elif key == "garbage_collection_threshold":
            value = r.number(i, key)
            if not 0.0 < value < 1.0:
                raise r.refuse(f"{key} must be in (0.0, 1.0), got {value}")
            values[key] = value
        elif key == "per_process_memory_fraction":
            value = r.number(i, key)
            if not 0.0 <= value <= 1.0:
                raise r.refuse(f"{key} must be in [0.0, 1.0], got {value}")
            values[key] = value
        elif key == "roundup_power2_divisions":
            values[key], i = _roundup_divisions(r, i)
        elif key == "pinned_num_register_threads":
            value = r.uint(i, key)
            if not _power_of_two(value) or value > MAX_REGISTER_THREADS:
                raise r.refuse(f"{key} must be a power of two <= {MAX_REGISTER_THREADS}, got {value}")
        elif key == "pinned_reserve_segment_size_mb":
            if r.uint(i, key) == 0:
                raise r.refuse(f"{key} must be > 0")
        else:  # pinned_max_round_threshold_mb, pinned_max_cached_size_mb: sizes in MB
            r.uint(i, key)
        i += 1
        if i < len(r.tokens):
            r.expect(i, ",", f"the value of {key}")
            i += 1
    return AllocatorSettings(
        max_split_size=values.get("max_split_size_mb"),
        max_non_split_rounding_size=values.get("max_non_split_rounding_mb", LARGE_SEGMENT_DEFAULT),
        large_segment_size=values.get("large_segment_size_mb", LARGE_SEGMENT_DEFAULT),
        garbage_collection_threshold=values.get("garbage_collection_threshold", 0.0),
        roundup_power2_divisions=values.get("roundup_power2_divisions", (0,) * ROUNDUP_INTERVALS),
        expandable_segments=values.get("expandable_segments", False),
        per_process_memory_fraction=values.get("per_process_memory_fraction", 1.0),
        backend=values.get("backend", "native"),
        text=text,
    )
