"""The string enums of a row: how a point ended (`status`) and the phases a step's peaks are read in.

Their values are the CSV's words, so a row written with an enum reads back as the same text; members compare
equal to those strings (`Status.OK == "ok"`), which keeps rows read from disk and rows just made alike.
"""

from __future__ import annotations

import enum
import sys

__all__ = ["Phase", "Status"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: the same behaviour (str() and format() give the value)
    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class Status(StrEnum):
    """How a point ended. Only `ok` and `oom` are answers about memory; the others say why there is none."""

    OK = "ok"  # it ran to the end: every figure is there
    OOM = "oom"  # it ran out of device memory: a result (the figures up to that moment, what it asked for)
    ERROR = "error"  # its measurement raised: the traceback's last lines are the row's error
    CRASH = "crash"  # its process died (a signal, another exit code) before printing its row
    TIMEOUT = "timeout"  # it outlived measure.timeout_s and was killed
    SKIPPED = "skipped"  # it cannot run here (an optional package missing, a kernel without a CPU path)

    @property
    def answered(self) -> bool:
        """Whether the row says something about memory (the point fit, or it did not)."""
        return self in (Status.OK, Status.OOM)


class Phase(StrEnum):
    """A step's phases, in the order they run; each has a peak column (`<phase>_peak_bytes`)."""

    GENERATE = "generate"  # GRPO's rollout
    REFERENCE = "reference"  # the frozen reference model's scoring (GRPO, DPO)
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
