"""The training step that is measured: zero_grad -> forward (autocast) -> backward -> optimizer.step.

The same code runs on every backend; the backend's meter says how many bytes are live and what the peak
was. Phase marks reset the peak at each boundary, so each phase has its own peak and the max over all
phases of all steps is the peak over the whole run (what measure_vram.py's max_memory_allocated reports).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

PHASES = ("forward", "backward", "optimizer")


class Meter(Protocol):
    def sync(self) -> None:
        """Wait until queued device work is done, so the figures below include it."""

    def current(self) -> int:
        """Bytes allocated now."""

    def peaks(self) -> dict[str, int]:
        """Peak figures since the last reset_peak(); 'allocated' is always there."""

    def reset_peak(self) -> None:
        """Start a new peak window at the current figures."""


@dataclass
class StepReport:
    peaks: dict[str, int] = field(default_factory=dict)  # each peak figure over all steps
    last_step_peaks: dict[str, int] = field(default_factory=dict)  # each peak figure over the last step
    phase_peaks: dict[str, int] = field(default_factory=dict)  # peak allocated per phase, max over steps
    peak_phase: str = ""  # the phase that holds the overall allocated peak
    activations_bytes: int = 0  # bytes the last forward left live for backward (saved tensors, logits, loss)
    after_step_bytes: int = 0  # allocated once the last optimizer step is done: what the loop carries into the next step
    grads_bytes: int = 0
    optimizer_state_bytes: int = 0
    optimizer_state_dtype: str = ""  # dtypes of the optimizer state tensors, e.g. "float32"
    step_time_s: float = 0.0  # wall time of the last step


def make_optimizer(partial, params) -> tuple[torch.optim.Optimizer, str]:
    """Instantiate the optimizer with the implementation CUDA would pick, and a label for the row.

    torch picks foreach kernels by default only for CUDA tensors; to make every backend run what CUDA runs,
    an optimizer that takes `foreach` and is given neither `foreach` nor `fused` gets foreach=True.
    """
    accepted = inspect.signature(partial.func).parameters
    chosen = {k: partial.keywords.get(k) for k in ("foreach", "fused") if k in accepted}
    if "foreach" in chosen and all(v is None for v in chosen.values()):
        partial.keywords["foreach"] = True
        chosen["foreach"] = True
    impl = next((k for k, v in chosen.items() if v), "single_tensor" if chosen else "")  # foreach=False: one at a time
    name = partial.func.__name__
    return partial(params), f"{name}({impl})" if impl else name


def state_tensors(optimizer: torch.optim.Optimizer, device_type: str) -> list[torch.Tensor]:
    """Optimizer state tensors (not AdamW's scalar `step` counters, which CUDA keeps on the CPU)."""
    return [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.device.type == device_type and t.dim() > 0
    ]


def train_steps(spec, engine, batch, meter: Meter, steps: int, autocast, report: StepReport,
                accum: int = 1, hold_outputs: bool = False) -> None:
    """Run `steps` optimizer steps of `accum` micro batches each, filling `report` as they go (so an
    out-of-memory leaves what was measured before it); `autocast` is a zero-arg factory of the forward's
    autocast context. Phase peaks are per micro step, the max over all of them. `engine`
    (vlmprobe.distributed.engines) owns the model and optimizer: single GPU, DDP or a sharded engine.

    hold_outputs keeps each forward's outputs (the logits) alive until the next forward has returned, as a
    loop that writes `_, loss = model(...)` does (nanoVLM's measure_vram.py); otherwise they die with the
    forward, once autograd no longer needs them."""
    meter.sync()
    meter.reset_peak()  # the peak window opens after load: the model and batch are in `current`

    def close_phase(step_peaks: dict[str, int], phase: str) -> None:
        meter.sync()  # kernels queued in this phase must be done before the peak is read
        peaks = meter.peaks()
        report.phase_peaks[phase] = max(report.phase_peaks.get(phase, 0), peaks["allocated"])
        for key, value in peaks.items():
            step_peaks[key] = max(step_peaks.get(key, 0), value)
        meter.reset_peak()

    held = None
    for _ in range(steps):
        step_peaks: dict[str, int] = {}
        started = time.perf_counter()
        engine.zero_grad()
        for _ in range(accum):
            before_forward = meter.current()
            with autocast():
                loss, outputs = spec.loss(engine.model, batch)
                if accum > 1:
                    loss = loss / accum  # the mean over the effective batch, as accumulation loops do
            kept = outputs if hold_outputs else None  # this reference is what keeps them alive
            del outputs  # unless kept, the outputs die here once autograd no longer needs them
            # read while the previous step's held outputs are still alive: they are in `before_forward` too,
            # so the difference is this forward's saved tensors, loss and (when held) outputs. The allocator
            # counts on the host as it hands out blocks, so no sync is needed for this figure.
            report.activations_bytes = meter.current() - before_forward
            held = kept  # rebinding lets the previous outputs die, as `_, loss = model(...)` does
            close_phase(step_peaks, "forward")
            engine.backward(loss)
            close_phase(step_peaks, "backward")
        report.grads_bytes = engine.grads_bytes()
        engine.step()
        close_phase(step_peaks, "optimizer")
        report.step_time_s = time.perf_counter() - started
        report.last_step_peaks = step_peaks
        for key, value in step_peaks.items():
            report.peaks[key] = max(report.peaks.get(key, 0), value)
    # what stays between steps (weights, optimizer state, gradients not yet zeroed, the engine's persistent
    # buffers, held outputs): read after the last step, once its queued kernels are done
    meter.sync()
    report.after_step_bytes = meter.current()
    report.peak_phase = max(PHASES, key=lambda p: report.phase_peaks[p])
    state = engine.state_tensors()
    report.optimizer_state_bytes = sum(t.untyped_storage().nbytes() for t in state)
    report.optimizer_state_dtype = ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in state}))


def autocast_factory(device_type: str, dtype: torch.dtype | None):
    """A zero-arg factory of the forward's autocast context (a no-op context without autocast)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type, dtype=dtype)
