"""The supervised step (step=sft, the default): zero_grad -> forward (autocast) -> backward -> optimizer.step.

The same code runs on every backend; the backend's meter says how many bytes are live and what the peak
was (vlmprobe.steps.common: one peak window per phase).
"""

from __future__ import annotations

from vlmprobe.states import Phase
from vlmprobe.steps.common import Meter, PhaseClock, StepReport

__all__ = ["train_steps"]


def train_steps(spec, engine, batch, meter: Meter, steps: int, autocast, report: StepReport,
                accum: int = 1, hold_outputs: bool = False, replay=None) -> None:
    """Run `steps` optimizer steps of `accum` micro batches each, filling `report` as they go (so an
    out-of-memory leaves what was measured before it); `autocast` is a zero-arg factory of the forward's
    autocast context. Phase peaks are per micro step, the max over all of them. `engine`
    (vlmprobe.distributed) owns the model and optimizer: single GPU, DDP or a sharded engine.

    hold_outputs keeps each forward's outputs (the logits) alive until the next forward has returned, as a
    loop that writes `_, loss = model(...)` does (nanoVLM's measure_vram.py); otherwise they die with the
    forward, once autograd no longer needs them.

    replay (vlmprobe.estimate.replay.steps, the estimate's): runs the first forward and backward and replays the
    later ones from their allocations (not with accumulation), and replays the optimizer steps from an earlier
    point's where this process has logged them."""
    clock = PhaseClock(meter, report)
    held = loss = None

    def forward():
        # rebinding `loss` here lets the previous micro step's loss die inside autocast, before the division
        # allocates, where a loop that writes `loss = model(...)` drops it
        nonlocal loss
        with autocast():
            loss, outputs = spec.loss(engine.model, batch)
            if accum > 1:
                loss = loss / accum  # the mean over the effective batch, as accumulation loops do
        return loss, outputs

    backward, step = engine.backward, engine.step
    if replay is not None:
        forward, backward, step = replay.wrap(forward, backward, step, steps, accum)
    for _ in range(steps):
        started = clock.begin_step(engine)
        for _ in range(accum):
            before_forward = meter.current()
            clock.enter(Phase.FORWARD)
            loss, outputs = forward()
            kept = outputs if hold_outputs else None  # this reference is what keeps them alive
            del outputs  # unless kept, the outputs die here once autograd no longer needs them
            # read while the previous step's held outputs are still alive: they are in `before_forward` too,
            # so the difference is this forward's saved tensors, loss and (when held) outputs. The allocator
            # counts on the host as it hands out blocks, so no sync is needed for this figure.
            report.activations_bytes = meter.current() - before_forward
            held = kept  # rebinding lets the previous outputs die, as `_, loss = model(...)` does
            clock.close(Phase.FORWARD)
            clock.enter(Phase.BACKWARD)
            backward(loss)
            clock.close(Phase.BACKWARD)
        clock.end_step(engine, step, started)
    clock.finish(engine)
