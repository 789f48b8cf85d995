"""cuda: real measurements. The only module that touches torch.cuda memory APIs and NVML.

Each point runs in a fresh worker process (the sweep spawns it; the parent never initialises CUDA), so
one point's cached blocks, cuBLAS workspaces and autocast caches never leak into the next.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch

from vlmprobe.backends.base import Backend
from vlmprobe.gpu import device_profile
from vlmprobe.sizes import segment_bytes_in_message

__all__ = ["available", "BACKEND", "device_count", "imposed_fraction", "nvml_usage", "unusable_reason"]

SNAPSHOT_ENTRIES = 200_000  # allocation events kept for a snapshot (the oldest are dropped past this)
# measure.record_history -> (context, stacks) of torch.cuda.memory._record_memory_history. Stacks cost host
# time on every recorded event (they inflate step_time_s, not any device figure): `alloc` keeps Python
# stacks of allocations only, enough for memory_viz to say what allocated each block; `all` adds C++
# frames and stacks of frees (scripts/gpu_check.sh measures what each costs).
RECORDING = {"alloc": ("alloc", "python"), "all": ("all", "all")}


def available() -> bool:
    """Whether a CUDA GPU is visible. Asks the driver for a device count; creates no CUDA context."""
    return torch.cuda.is_available()


def unusable_reason() -> str | None:
    """None when torch can use a CUDA GPU here; otherwise why not, in a few words. A CPU build of torch and a
    CUDA build that the driver refuses (too old for it, no device) are different fixes: torch says which in
    the warning it gives when it cannot count devices. Creates no CUDA context."""
    if torch.version.cuda is None:
        return f"no CUDA GPU is visible (torch {torch.__version__} is a CPU build)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if available():
            return None
    said = next((str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()), None)
    return f"no CUDA GPU is usable (torch {torch.__version__} built for CUDA {torch.version.cuda}" + \
        (f": {said})" if said else "; the driver reports no device)")


def device_count() -> int:
    """Visible CUDA GPUs (CUDA_VISIBLE_DEVICES applied); creates no CUDA context."""
    return torch.cuda.device_count()


class CudaMeter:
    def __init__(self, capacity: int | None, recording: bool, notes: list[str]):
        self.capacity = capacity  # bytes the caching allocator may reserve when imposed, else None (the card's)
        self.recording = recording  # whether allocation history is recorded (a snapshot can be written)
        self.notes = notes  # what the row should say about how the point was measured

    def sync(self) -> None:
        torch.cuda.synchronize()

    def current(self) -> int:
        return torch.cuda.memory_allocated()

    def peaks(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats()
        return {
            "allocated": stats.get("allocated_bytes.all.peak", 0),  # == max_memory_allocated()
            "reserved": stats.get("reserved_bytes.all.peak", 0),  # segments cudaMalloc'd by the allocator
            "active": stats.get("active_bytes.all.peak", 0),  # allocated + blocks freed but awaiting their stream
        }

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()


def nvml_handle(pynvml, uuid: str | None, nvml_index):
    """The NVML handle of the device torch measures on. NVML numbers GPUs physically and ignores
    CUDA_VISIBLE_DEVICES, so the UUID CUDA reports decides: a whole GPU's is `GPU-<uuid>` to NVML, a MIG
    instance's `MIG-<uuid>`. Where neither is found, torch's NVML index of the device (which applies
    CUDA_VISIBLE_DEVICES, ordinals or UUIDs) is used; None when nothing resolves."""
    for name in ([f"GPU-{uuid}", f"MIG-{uuid}"] if uuid else []):
        with contextlib.suppress(Exception):  # NVMLError_NotFound, or anything a mismatched library raises
            return pynvml.nvmlDeviceGetHandleByUUID(name)
    with contextlib.suppress(Exception):
        return pynvml.nvmlDeviceGetHandleByIndex(nvml_index())
    return None


def nvml_usage(pynvml, uuid: str | None, nvml_index, pid: int) -> dict:
    """Device used bytes and process `pid`'s bytes per NVML, read now. A value NVML cannot give is empty,
    whatever NVML raises (not only NVMLError: a library older than the bindings raises others): no NVML
    library, a container whose PID namespace hides our PID from the driver, a driver without the call."""
    out = {"nvml_used_bytes": None, "nvml_process_bytes": None}
    try:
        pynvml.nvmlInit()
    except Exception:
        return out
    try:
        handle = nvml_handle(pynvml, uuid, nvml_index)
        if handle is None:
            return out
        with contextlib.suppress(Exception):
            out["nvml_used_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        with contextlib.suppress(Exception):
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    out["nvml_process_bytes"] = int(proc.usedGpuMemory)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def _device_uuid() -> str | None:
    with contextlib.suppress(Exception):
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid).removeprefix("GPU-")
    return None


def allocator_backend() -> str:
    """`native` (the caching allocator) or `cudaMallocAsync`, as PYTORCH_ALLOC_CONF chose when CUDA started."""
    return torch.cuda.memory.get_allocator_backend()


def imposed_fraction(capacity: int | None, total: int) -> float | None:
    """The fraction of the card set_per_process_memory_fraction gets so that the caching allocator may reserve
    at most `capacity` bytes (it allows total * fraction); None when the card has no more than that anyway."""
    if capacity is None or capacity >= total:
        return None
    return capacity / total


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    isolate = True

    @contextlib.contextmanager
    def session(self, capacity, record_history: str = "alloc", device=None, settings=None, allowed_maximum=None):
        torch.cuda.init()
        notes = []
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        total = props.total_memory
        other_card = device_profile.name_note(props.name, device)  # the profile names another card than this one
        if other_card:
            notes.append(other_card)
        fraction = imposed_fraction(capacity, total)
        if fraction is not None:
            # A smaller card, as far as the caching allocator goes: past total * fraction reserved bytes it
            # frees its cache, retries, then raises OutOfMemoryError, as it would on a card of that size
            # (the CUDA context is not counted: it lives outside the allocator on every card)
            torch.cuda.set_per_process_memory_fraction(fraction)
        elif capacity is not None:
            notes.append(f"capacity {capacity} B (measure.device_memory or the device profile's) not imposed: the "
                         f"card has only {total} B")
        recording = record_history != "off" and allocator_backend() == "native"
        if recording:
            # Kept in host memory; changes no device figure. cudaMallocAsync cannot record (it raises), so
            # points on it run without history and write no snapshot.
            context, stacks = RECORDING[record_history]
            torch.cuda.memory._record_memory_history(context=context, stacks=stacks, max_entries=SNAPSHOT_ENTRIES)
        elif record_history != "off":
            notes.append(f"no allocator history or snapshot: the {allocator_backend()} allocator backend "
                              f"does not record one")
        torch.cuda.reset_peak_memory_stats()
        yield CudaMeter(int(total * fraction) if fraction is not None else None, recording, notes)

    def select_device(self, local_rank):
        torch.cuda.set_device(local_rank)  # one GPU per rank of a launched job

    def write_snapshot(self, meter, path) -> bool:
        if not meter.recording:
            return False
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # made here: backends without snapshots leave no folder
        torch.cuda.memory._dump_snapshot(str(path))
        return True

    def oom_columns(self, meter, message: str) -> dict:
        """The block the allocator was asked for comes from the OOM entry of the recorded history (the
        request rounded to 512 B); CUDA's message gives only the segment size, formatted to 2 decimals."""
        block = None
        if meter.recording:
            with contextlib.suppress(Exception):
                trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
                block = next((e["size"] for e in reversed(trace) if e["action"] == "oom"), None)
        return {"oom_segment_bytes": segment_bytes_in_message(message), "oom_block_bytes": block}

    def final_stats(self, meter) -> dict:
        stats = torch.cuda.memory_stats()
        # Read after the measured steps, before anything is freed: the caching allocator keeps every segment
        # it reserved unless an allocation had to free cached blocks (num_alloc_retries > 0, and always
        # before an OOM), so NVML shows the reservation left at the end plus the CUDA context.
        return {
            "num_alloc_retries": stats.get("num_alloc_retries", 0),  # cudaMalloc failures that forced a cache flush
            "num_ooms": stats.get("num_ooms", 0),
            "allocator_backend": allocator_backend(),
            **self.nvml(),
        }

    def nvml(self) -> dict:
        try:
            import pynvml
        except Exception:
            return {"nvml_used_bytes": None, "nvml_process_bytes": None}
        index = lambda: torch.cuda._get_nvml_device_index(torch.cuda.current_device())  # noqa: E731
        return nvml_usage(pynvml, _device_uuid(), index, os.getpid())

    def describe(self) -> dict:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info = {
            "backend": self.name,
            "device_name": props.name,
            "device_total_memory_bytes": int(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "driver": None,
            # what the worker's allocator really runs with (the sweep sets both variables, or neither)
            "allocator_backend": allocator_backend(),
            "allocator_conf_effective": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        }
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        return info


BACKEND = CudaBackend()
