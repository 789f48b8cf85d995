"""The DPO step (step=dpo): a preference pair's chosen and rejected completions scored by the policy and by a
frozen reference, the sigmoid loss on the difference of their log-ratios, backward, optimizer. Two trainers'
programs, which differ in how the log-probabilities are made (`step.logits`):
- `chunked`: TRL's DPOTrainer (trl 1.16, trainer/dpo_trainer.py), through fused LM heads: no [tokens, vocab]
  tensor ever lives.
- `full_fp32`: LLaMA-Factory's CustomDPOTrainer (src/llamafactory/train/dpo/trainer.py): the float32 logits of
  every position stay alive until the loss is made.
Both, per micro batch: the policy's forward over 2 x batch_size rows ([chosen..., rejected...]); while all it keeps
for backward is alive, the reference's forward of the same rows under no_grad; the loss; backward; the optimizer
step after the last micro batch. Both pad the completions to one length: `step.completion_length`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vlmprobe.errors import ConfigError, require_counts, require_flags
from vlmprobe.states import Phase
from vlmprobe.steps import logprob
from vlmprobe.steps.common import Meter, PhaseClock, StepReport, completion_batch

__all__ = ["dpo_steps", "DPOSettings", "sequence_log_probs"]

if TYPE_CHECKING:  # steps sit below models in the layering: the shape is passed in, never built here
    from vlmprobe.models.base import DataShape

LOGITS_PATHS = ("chunked", "full_fp32")
POLICY_OUTPUTS = ("entropy", "mean_logits", "is_top1")  # what TRL's DPOTrainer asks the policy's fused head for
BETA = 0.1  # both trainers' default; the loss's value changes no memory


@dataclass(frozen=True)
class DPOSettings:
    """conf/step/dpo.yaml, validated (`from_point`)."""

    completion_length: int
    reference: bool
    logits: str
    compact: bool

    @classmethod
    def from_point(cls, point: dict, data: "DataShape", spec) -> "DPOSettings":
        """One ConfigError line per value the trainers (or vlmprobe) refuse, before anything is built."""
        step = point["step"]
        values = {f.name: step[f.name] for f in dataclasses.fields(cls)}
        require_counts("step", values, ("completion_length",))
        require_flags("step", values, ("reference", "compact"))
        if values["logits"] not in LOGITS_PATHS:
            raise ConfigError(f"step.logits={values['logits']!r} is not allowed with step=dpo: use one of "
                              f"{', '.join(LOGITS_PATHS)} (chunked: TRL's DPOTrainer; full_fp32: LLaMA-Factory's)")
        if values["logits"] == "chunked" and not values["reference"]:
            raise ConfigError("step.reference=false is not allowed with step.logits=chunked: TRL's DPOTrainer always "
                              "scores a reference (its precompute_ref_log_probs is refused for vision datasets); the "
                              "reference-free losses (ORPO, SimPO) are LLaMA-Factory's: step.logits=full_fp32")
        return cls(**values)


def sequence_log_probs(settings: DPOSettings, model, batch: dict, policy: bool):
    """(per-row summed log-probabilities of the completion [rows] float32, what the trainer keeps alive
    beside them until its loss is made). `policy`: the trained model's forward (TRL asks its head for the
    metrics' outputs too)."""
    if settings.logits == "chunked":
        per_token = logprob.chunked(model, batch, settings.completion_length, settings.compact,
                                    POLICY_OUTPUTS if policy else ())
        return per_token[0].sum(dim=1), per_token  # `outputs`: alive until _compute_loss returns
    return logprob.full_fp32(model, batch, clone=settings.reference)  # the logits: chosen_logits / rejected_logits


def dpo_loss(logps, ref_logps) -> torch.Tensor:
    """The sigmoid loss: -log sigmoid(beta x (chosen log-ratio - rejected log-ratio)); without a reference
    (LLaMA-Factory's SimPO / ORPO) on the policy's log-probabilities alone."""
    chosen, rejected = logps.chunk(2)
    delta = chosen - rejected
    if ref_logps is not None:
        ref_chosen, ref_rejected = ref_logps.chunk(2)
        delta = delta - (ref_chosen - ref_rejected)
    return -F.logsigmoid(BETA * delta).mean()


def dpo_steps(spec, engine, reference, data: "DataShape", device, meter: Meter, steps: int, autocast,
              report: StepReport, accum: int, settings: DPOSettings, disabled_adapters) -> None:
    """`reference`: the frozen reference model, or None (no reference, or LoRA: `disabled_adapters()` is the
    context in which the policy is its own reference). The batch is made once, as step=sft's: a data loader
    hands every micro batch the same shapes."""
    clock = PhaseClock(meter, report)
    batch = completion_batch(spec, 2 * data.batch_size, data, settings.completion_length, device)
    for _ in range(steps):
        started = clock.begin_step(engine)
        for _ in range(accum):
            before_forward = meter.current()
            clock.enter(Phase.FORWARD)
            # the HF Trainer's compute_loss runs under accelerate's autocast, the reference's forward included
            with autocast():
                logps, kept = sequence_log_probs(settings, engine.model, batch, policy=True)
                clock.close(Phase.FORWARD)
                ref_logps = None
                clock.enter(Phase.REFERENCE if settings.reference else Phase.FORWARD)
                if settings.reference:
                    scorer = reference if reference is not None else engine.model
                    with torch.no_grad(), (disabled_adapters() if reference is None else contextlib.nullcontext()):
                        # TRL's LoRA reference is the policy's own forward, its fused head's outputs with it
                        ref_logps = sequence_log_probs(settings, scorer, batch, policy=reference is None)[0]
                loss = dpo_loss(logps, ref_logps) / accum  # the HF Trainer divides by the accumulation steps
                clock.close(Phase.REFERENCE if settings.reference else Phase.FORWARD)
            del logps, kept, ref_logps  # the trainer's locals die as its compute_loss returns
            report.activations_bytes = meter.current() - before_forward
            clock.enter(Phase.BACKWARD)
            engine.backward(loss)
            del loss
            clock.close(Phase.BACKWARD)
        clock.end_step(engine, engine.step, started)
    clock.finish(engine)
