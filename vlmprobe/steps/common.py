"""What every measured step shares: the two things it is driven through (a Meter that reads memory, an Engine
that owns the model and optimizer), the report it fills, and the phase clock that closes each phase's peak window.

A phase mark resets the peak at each boundary, so each phase has its own peak and the max over all phases
of all steps is the peak over the whole run (what measure_vram.py's max_memory_allocated reports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from vlmprobe.states import Phase

__all__ = ["Engine", "Meter", "PhaseClock", "StepReport", "completion_batch"]


class Meter(Protocol):
    def sync(self) -> None:
        """Wait until queued device work is done, so the figures below include it."""

    def current(self) -> int:
        """Bytes allocated now."""

    def peaks(self) -> dict[str, int]:
        """Peak figures since the last reset_peak(); 'allocated' is always there."""

    def reset_peak(self) -> None:
        """Start a new peak window at the current figures."""

    # optional: mark_phase(phase, started) is told where each phase starts and ends (the estimate's timeline)


class Engine(Protocol):
    """What a step asks of the engine that owns the model and optimizer of one rank (single GPU, DDP, FSDP2,
    DeepSpeed: vlmprobe.distributed); the step never asks which one it is."""

    model: nn.Module  # the model as the step calls it (wrapped or sharded by the engine)

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...

    def grads_bytes(self) -> int:
        """Device bytes of the gradients this rank holds now."""

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer state tensors this rank holds on the device."""

    def generating(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The model generate runs on (GRPO's rollout), its parameters as the framework leaves them."""


@dataclass
class StepReport:
    peaks: dict[str, int] = field(default_factory=dict)  # each peak figure over all steps
    last_step_peaks: dict[str, int] = field(default_factory=dict)  # each peak figure over the last step
    phase_peaks: dict[str, int] = field(default_factory=dict)  # peak allocated per phase, max over steps
    peak_phase: str = ""  # the phase that holds the overall allocated peak
    running: str = "load"  # the phase running now (where an out-of-memory stops the point): load until a step begins
    activations_bytes: int = 0  # bytes the last forward left live for backward (saved tensors, logits, loss)
    after_step_bytes: int = 0  # allocated once the last optimizer step is done: what the loop carries into the next step
    grads_bytes: int = 0
    optimizer_state_bytes: int = 0
    optimizer_state_dtype: str = ""  # dtypes of the optimizer state tensors, e.g. "float32"
    step_time_s: float = 0.0  # wall time of the last step


class PhaseClock:
    """Closes phases of one run: each close reads the peak since the last one into the report's phase peak
    (max over steps) and the current step's peaks, then opens a new window."""

    def __init__(self, meter: Meter, report: StepReport):
        self.meter, self.report = meter, report
        self.step_peaks: dict[str, int] = {}
        self.mark = getattr(meter, "mark_phase", None)  # a meter that keeps a timeline (Meter's optional method)
        meter.sync()
        meter.reset_peak()  # the first window opens after load: the model and batch are in `current`

    def begin_step(self, engine) -> float:
        """zero_grad, then the step's first window; the step's start time. Until zero_grad the previous step's
        gradients were alive (the optimizer phase's figure has them); from here the first phase's peak is its
        own. Nothing is allocated in between, so no peak is lost."""
        started = time.perf_counter()
        engine.zero_grad()
        self.meter.sync()
        self.meter.reset_peak()
        return started

    def enter(self, phase: Phase) -> None:
        """Say which phase runs from here (the row's peak_phase if memory runs out in it); opens no window."""
        self.report.running = phase
        if self.mark is not None:
            self.mark(phase, True)

    def close(self, phase: Phase) -> None:
        self.meter.sync()  # kernels queued in this phase must be done before the peak is read
        if self.mark is not None:
            self.mark(phase, False)
        peaks = self.meter.peaks()
        self.report.phase_peaks[phase] = max(self.report.phase_peaks.get(phase, 0), peaks["allocated"])
        for key, value in peaks.items():
            self.step_peaks[key] = max(self.step_peaks.get(key, 0), value)
        self.meter.reset_peak()

    def end_step(self, engine, step, started: float) -> None:
        """After the last micro batch: the gradients' bytes, the optimizer step (`step`: the engine's, or the
        estimate's replay of it) in its window; its peaks become the last step's, and count toward the run's."""
        self.report.grads_bytes = engine.grads_bytes()
        self.enter(Phase.OPTIMIZER)
        step()
        self.close(Phase.OPTIMIZER)
        self.report.step_time_s = time.perf_counter() - started
        self.report.last_step_peaks = self.step_peaks
        for key, value in self.step_peaks.items():
            self.report.peaks[key] = max(self.report.peaks.get(key, 0), value)
        self.step_peaks = {}

    def finish(self, engine) -> None:
        """What stays between steps (weights, optimizer state, gradients not yet zeroed, the engine's
        persistent buffers, held outputs), read after the last step once its queued kernels are done; the
        phase of the peak; the optimizer state."""
        report = self.report
        self.meter.sync()
        report.after_step_bytes = self.meter.current()
        report.peak_phase = max(report.phase_peaks, key=lambda p: report.phase_peaks[p])
        state = engine.state_tensors()
        report.optimizer_state_bytes = sum(t.untyped_storage().nbytes() for t in state)
        report.optimizer_state_dtype = ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in state}))


def completion_batch(spec, rows: int, data, completion: int, device) -> dict:
    """Prompt + completion rows as a trainer's forward gets them (step=grpo, step=dpo), with TRL's labels: the
    input ids with every prompt position set to -100. `data` (a DataShape) gives the prompt: lm_max_length
    tokens, its images and videos among them."""
    batch = spec.batch(dataclasses.replace(data, batch_size=rows, lm_max_length=data.lm_max_length + completion), device)
    labels = batch["input_ids"].clone()
    labels[:, :-completion] = -100
    batch["labels"] = labels
    return batch
