"""The CUDA backend's decisions that need no GPU: which NVML device a worker reads, what NVML failures
leave behind, and how a memory budget becomes a limit on the caching allocator."""

from types import SimpleNamespace

import pytest

from vlmprobe.backends.cuda import imposed_fraction, nvml_usage

UUID = "58574f25-1b2c-4d3e-8f9a-0b1c2d3e4f50"


class NVMLError(Exception):
    pass


class FakeNVML:
    """pynvml with devices known by UUID and by physical index; records what was asked."""

    def __init__(self, uuids=(), indices=(), processes=None, used=7):
        self.uuids, self.indices, self.processes, self.used = set(uuids), set(indices), processes, used
        self.asked = []

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.asked.append(uuid)
        if uuid not in self.uuids:
            raise NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetHandleByIndex(self, index):
        self.asked.append(index)
        if index not in self.indices:
            raise NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if isinstance(self.processes, Exception):
            raise self.processes
        return self.processes or []


def test_a_whole_gpu_is_found_by_its_uuid_whatever_cuda_visible_devices_renumbered():
    nvml = FakeNVML(uuids={f"GPU-{UUID}"}, indices={0}, processes=[SimpleNamespace(pid=42, usedGpuMemory=5)])
    out = nvml_usage(nvml, UUID, lambda: 0, pid=42)
    assert out == {"nvml_used_bytes": 7, "nvml_process_bytes": 5}
    assert nvml.asked == [f"GPU-{UUID}"]


def test_a_mig_instance_is_found_by_its_mig_uuid_not_its_parent_gpu():
    nvml = FakeNVML(uuids={f"MIG-{UUID}"}, indices={0})
    nvml_usage(nvml, UUID, lambda: 0, pid=42)
    assert nvml.asked == [f"GPU-{UUID}", f"MIG-{UUID}"]


def test_without_a_uuid_match_the_index_goes_through_cuda_visible_devices():
    # CUDA_VISIBLE_DEVICES=3: torch's device 0 is NVML's device 3 (torch.cuda._get_nvml_device_index)
    nvml = FakeNVML(indices={3})
    assert nvml_usage(nvml, UUID, lambda: 3, pid=42)["nvml_used_bytes"] == 7
    assert nvml.asked[-1] == 3


@pytest.mark.parametrize("failure", [NVMLError("Function Not Found"), AttributeError("no such symbol"),
                                     TypeError("struct version mismatch")])
def test_a_failing_process_list_leaves_its_column_empty_and_keeps_the_others(failure):
    out = nvml_usage(FakeNVML(uuids={f"GPU-{UUID}"}, processes=failure), UUID, lambda: 0, pid=42)
    assert out == {"nvml_used_bytes": 7, "nvml_process_bytes": None}


def test_no_nvml_device_at_all_leaves_both_columns_empty():
    def index():
        raise RuntimeError("Can't get device UUIDs")

    assert nvml_usage(FakeNVML(), UUID, index, pid=42) == {"nvml_used_bytes": None, "nvml_process_bytes": None}


def test_a_budget_is_imposed_as_the_fraction_of_the_card_that_allows_exactly_it():
    total = 81_559_191_552  # an H100 80GB HBM3's total_memory
    budget = 24 * 2**30
    fraction = imposed_fraction(budget, total)
    assert int(total * fraction) == budget  # the allocator allows total * fraction bytes
    assert imposed_fraction(None, total) is None
    assert imposed_fraction(total, total) is None  # the whole card: nothing to impose
    assert imposed_fraction(2 * total, total) is None


def test_a_cuda_build_the_driver_refuses_is_told_apart_from_a_cpu_build(monkeypatch):
    import warnings

    import torch

    from vlmprobe.backends import cuda

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is a CPU build" in cuda.unusable_reason()

    def refused():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).")
        return False

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda, "available", refused)
    reason = cuda.unusable_reason()
    assert "built for CUDA 13.0" in reason and "driver on your system is too old" in reason
