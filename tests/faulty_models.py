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
