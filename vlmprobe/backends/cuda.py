"""cuda: real measurements. The only module that touches torch.cuda memory APIs and NVML.

Each point runs in a fresh worker process (the sweep spawns it; the parent never initialises CUDA), so
one point's cached blocks, cuBLAS workspaces and autocast caches never leak into the next.
"""

from __future__ import annotations

import contextlib
import os

import torch

from vlmprobe.backends.base import Backend

SNAPSHOT_ENTRIES = 200_000  # allocation events kept for a snapshot (the oldest are dropped past this)


def available() -> bool:
    """Whether a CUDA GPU is visible. Asks the driver for a device count; creates no CUDA context."""
    return torch.cuda.is_available()


def device_count() -> int:
    """Visible CUDA GPUs (CUDA_VISIBLE_DEVICES applied); creates no CUDA context."""
    return torch.cuda.device_count()


class CudaMeter:
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


def _nvml_handle(pynvml):
    """The NVML handle of torch's current device (NVML numbers GPUs physically, ignoring CUDA_VISIBLE_DEVICES)."""
    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except (pynvml.NVMLError, AttributeError):
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())


def nvml_usage() -> dict:
    """Device used bytes and this process's bytes per NVML, read now; empty values when NVML cannot tell
    (no NVML library, or a container whose PID namespace hides our PID from the driver)."""
    out = {"nvml_used_bytes": None, "nvml_process_bytes": None}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NVML missing or unusable: the allocator columns still stand
        return out
    try:
        handle = _nvml_handle(pynvml)
        out["nvml_used_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                out["nvml_process_bytes"] = int(proc.usedGpuMemory)
    except pynvml.NVMLError:
        pass
    finally:
        pynvml.nvmlShutdown()
    return out


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    isolate = True

    @contextlib.contextmanager
    def session(self, capacity):
        torch.cuda.init()
        # Allocation history is recorded for every point so that one that runs out of memory can leave a
        # snapshot; it is kept in host memory and changes no device figure.
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        torch.cuda.reset_peak_memory_stats()
        yield CudaMeter()

    def select_device(self, local_rank):
        torch.cuda.set_device(local_rank)  # one GPU per rank of a launched job

    def write_snapshot(self, path) -> bool:
        torch.cuda.memory._dump_snapshot(str(path))
        return True

    def final_stats(self, meter) -> dict:
        stats = torch.cuda.memory_stats()
        # Read after the measured steps, before anything is freed: the caching allocator keeps every segment
        # it reserved, so NVML's figures here include the step's peak reservation plus the CUDA context.
        return {
            "num_alloc_retries": stats.get("num_alloc_retries", 0),  # cudaMalloc failures that forced a cache flush
            "num_ooms": stats.get("num_ooms", 0),
            **nvml_usage(),
        }

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
        }
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        return info


BACKEND = CudaBackend()
