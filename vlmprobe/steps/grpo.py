"""The GRPO step (step=grpo), as TRL's GRPOTrainer runs it (trl 1.16, trainer/grpo_trainer.py; the logits
path of TRL 0.17, which VLM-R1 pins, is `step.logits=logits_to_keep`, and VLM-R1's own trainer's is
`full_sequence`). Per optimizer step: generate the whole generation batch under no_grad (vlmprobe.steps.rollout;
absent with use_vllm); with beta > 0 the frozen reference scores the completions; forward / backward per micro
batch through the logits path (vlmprobe.steps.logprob) with loss_type grpo; the optimizer step.
Gradients are zeroed before the rollout, as the HF Trainer zeroes them right after each optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlmprobe.errors import ConfigError, require_counts, require_flags
from vlmprobe.states import Phase
from vlmprobe.steps import logprob
from vlmprobe.steps.common import Meter, PhaseClock, StepReport, completion_batch
from vlmprobe.steps.rollout import ROLLOUTS, rollout

__all__ = ["grpo_steps", "GRPOSettings"]

if TYPE_CHECKING:  # steps sit below models in the layering: the shape is passed in, never built here
    from vlmprobe.models.base import DataShape

LOGITS_PATHS = ("chunked", "logits_to_keep", "full_sequence")  # vlmprobe.steps.logprob's, for GRPO
VLLM_MODES = ("server", "colocate")  # TRL's vllm_mode
EPSILON = 0.2  # TRL's clipping range (epsilon, epsilon_high default to it)


@dataclass(frozen=True)
class GRPOSettings:
    """conf/step/grpo.yaml, validated (`from_config`)."""

    num_generations: int
    max_completion_length: int
    beta: float
    use_vllm: bool
    vllm_mode: str
    num_processes: int
    logits: str
    compact: bool
    rollout: str
    ds3_gather_for_generation: bool

    @property
    def reference(self) -> bool:
        """Whether a frozen reference scores the completions: TRL builds none at beta 0."""
        return bool(self.beta)

    @classmethod
    def from_point(cls, point: dict, data: "DataShape", spec) -> "GRPOSettings":
        """The settings of a point's config (the planner validates with it, the worker runs with it)."""
        dist = point["dist"]
        return cls.from_config(point["step"], data, point["train"]["grad_accum_steps"], point["measure"]["backend"],
                               spec, world_size=dist["world_size"] if dist["name"] != "none" else None)

    @classmethod
    def from_config(cls, step: dict, data: "DataShape", accum: int, backend: str, spec,
                    world_size: int | None = None) -> "GRPOSettings":
        """One ConfigError line per value TRL (or vlmprobe) refuses, before anything is built. `world_size`:
        dist.world_size where the point is sharded (dist != none): the processes TRL counts are its ranks."""
        values = {f.name: step[f.name] for f in dataclasses.fields(cls)}
        require_counts("step", values, ("num_generations", "max_completion_length", "num_processes"))
        if world_size is not None:
            if values["num_processes"] not in (1, world_size):
                raise ConfigError(f"step.num_processes={values['num_processes']} is not allowed with dist.world_size="
                                  f"{world_size}: a sharded point's processes are its ranks; leave it at 1")
            values["num_processes"] = world_size
        if values["num_generations"] < 2:
            raise ConfigError(f"step.num_generations={values['num_generations']} is not allowed: TRL's GRPOConfig "
                              f"requires at least 2 (\"GRPO requires at least 2 generations per prompt to calculate "
                              f"the advantages\")")
        generation_batch = data.batch_size * values["num_processes"] * accum
        if generation_batch % values["num_generations"]:
            raise ConfigError(
                f"step.num_generations={values['num_generations']} is not allowed with data.batch_size="
                f"{data.batch_size} (per_device_train_batch_size), train.grad_accum_steps={accum} and "
                f"step.num_processes={values['num_processes']}: TRL's GRPOConfig says \"generation_batch_size "
                f"({generation_batch}) must be divisible by num_generations ({values['num_generations']})\" "
                f"(generation_batch_size = per_device_train_batch_size x processes x steps_per_generation, which "
                f"defaults to gradient_accumulation_steps)")
        beta = values["beta"]
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or beta < 0:
            raise ConfigError(f"step.beta={beta!r} is not allowed: the KL coefficient must be a number >= 0")
        require_flags("step", values, ("use_vllm", "compact", "ds3_gather_for_generation"))
        if values["vllm_mode"] not in VLLM_MODES:
            raise ConfigError(f"step.vllm_mode={values['vllm_mode']!r} is not allowed: use server")
        if values["use_vllm"] and values["vllm_mode"] == "colocate":
            raise ConfigError(f"step.vllm_mode=colocate is not allowed (backend {backend}): colocated vLLM shares the "
                              f"training GPU through its own allocator (gpu_memory_utilization x the card), which "
                              f"no backend here can tell; use vllm_mode=server (generation on other GPUs)")
        if values["logits"] not in LOGITS_PATHS:
            raise ConfigError(f"step.logits={values['logits']!r} is not allowed: use one of {', '.join(LOGITS_PATHS)}")
        if values["rollout"] not in ROLLOUTS:
            raise ConfigError(f"step.rollout={values['rollout']!r} is not allowed: use one of {', '.join(ROLLOUTS)}")
        if not spec.can_generate:
            spec.generation_inputs(None, data, None)  # raises the family's one line
        return cls(**values)


def log_probs(settings: GRPOSettings, model, batch: dict, completion: int, with_entropy: bool):
    if settings.logits == "chunked":
        return logprob.chunked(model, batch, completion, settings.compact, ("entropy",) if with_entropy else ())[:2]
    if settings.logits == "full_sequence":
        return logprob.full_sequence(model, batch, completion)
    return logprob.logits_to_keep(model, batch, completion)


def grpo_loss(settings: GRPOSettings, logps, ref_logps, mask, advantages, accum: int) -> torch.Tensor:
    """_compute_loss, loss_type grpo, token-level importance sampling, num_iterations 1 (old = current)."""
    old = logps.detach()
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    if settings.beta:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + settings.beta * kl
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return loss / accum


def grpo_steps(spec, engine, reference, data: "DataShape", device, meter: Meter, steps: int, autocast,
               report: StepReport, accum: int, settings: GRPOSettings, disabled_adapters) -> None:
    """`reference`: the frozen reference model, or None (beta = 0, or LoRA: `disabled_adapters()` is the
    context in which the policy is its own reference)."""
    clock = PhaseClock(meter, report)
    rows, completion = data.batch_size, settings.max_completion_length
    buffered = None  # TRL's _buffered_inputs: one step's scored rollout, alive until the next one replaces it
    for _ in range(steps):
        started = clock.begin_step(engine)
        if not settings.use_vllm:
            clock.enter(Phase.GENERATE)
            # accelerate wraps the prepared model's forward in autocast, generate included
            with autocast(), engine.generating() as policy:
                # the ids die here: TRL turns them into lists and pads them again below
                rollout(spec, policy, dataclasses.replace(data, batch_size=rows * accum), device, completion,
                        settings.rollout)
            clock.close(Phase.GENERATE)
        clock.enter(Phase.REFERENCE if settings.beta else Phase.FORWARD)
        batches = [completion_batch(spec, rows, data, completion, device) for _ in range(accum)]
        mask = torch.ones(rows * accum, completion, dtype=torch.int32, device=device).split(rows)
        advantages = torch.zeros(rows * accum, dtype=torch.float32, device=device).split(rows)
        ref_logps = [None] * accum
        if settings.beta:
            scorer = reference if reference is not None else engine.model
            with torch.no_grad(), autocast(), (disabled_adapters() if reference is None else contextlib.nullcontext()):
                ref_logps = [log_probs(settings, scorer, b, completion, with_entropy=False)[0] for b in batches]
            clock.close(Phase.REFERENCE)
        buffered = (batches, mask, advantages, ref_logps)  # the previous step's rollout dies here
        for i in range(accum):
            before_forward = meter.current()
            clock.enter(Phase.FORWARD)
            with autocast():
                logps, entropy = log_probs(settings, engine.model, batches[i], completion, with_entropy=True)
                loss = grpo_loss(settings, logps, ref_logps[i], mask[i], advantages[i], accum)
            del logps, entropy
            report.activations_bytes = meter.current() - before_forward
            clock.close(Phase.FORWARD)
            clock.enter(Phase.BACKWARD)
            engine.backward(loss)
            del loss
            clock.close(Phase.BACKWARD)
        clock.end_step(engine, engine.step, started)
        del batches, mask, advantages, ref_logps  # `buffered` keeps them
    clock.finish(engine)
    del buffered
