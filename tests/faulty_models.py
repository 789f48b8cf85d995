"""Model targets that fail on purpose in the worker (in `batch`, which the parent never calls), to make a
real worker process die, hang or raise. Tests put this folder on PYTHONPATH and set model._target_."""

import os
import signal
import sys
import time

from vlmprobe.models.nanovlm import NanoVLMSpec


class CrashingSpec(NanoVLMSpec):
    def batch(self, data, device):
        print("about to crash", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)


class HangingSpec(NanoVLMSpec):
    def batch(self, data, device):
        time.sleep(600)


class RaisingSpec(NanoVLMSpec):
    def batch(self, data, device):
        raise RuntimeError("broken on purpose")


class DyingAtExitSpec(NanoVLMSpec):
    """Measures normally, then dies at interpreter exit (after the row is printed), as a CUDA teardown can."""

    def batch(self, data, device):
        import atexit

        atexit.register(lambda: os.kill(os.getpid(), signal.SIGSEGV))
        return super().batch(data, device)


class OutOfLibraryMemorySpec(NanoVLMSpec):
    """Fails as a library does when it cannot get device memory outside the caching allocator."""

    def loss(self, model, batch):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
