"""One point, measured in this process: open the backend's session, load the model (build, knobs, engine,
optimizer, batch), run the step, read the row's figures. An out-of-memory is a result (status `oom`, with what
was measured up to it); anything else raises, for the caller to record. With data.source a dataset's batches run
step after step instead of the synthetic batch (vlmprobe.point.dataset_steps); their records leave under `steps`.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass

import torch
from hydra.utils import instantiate

from vlmprobe import backends, quantization
from vlmprobe.distributed import engines
from vlmprobe.distributed.process_group import rank
from vlmprobe.estimate.replay.blocks import Mismatch
from vlmprobe.gpu import alloc_conf, device_profile
from vlmprobe.kernels import liger
from vlmprobe.knobs import adapters_disabled
from vlmprobe.models.base import DataShape
from vlmprobe.point.dataset_steps import DatasetRun, world_size
from vlmprobe.point.dataset_steps import plan as plan_dataset
from vlmprobe.point.build import DTYPES, build_spec, built, model_key, reference_model, step_settings
from vlmprobe.states import Phase, Status
from vlmprobe.steps.common import StepReport
from vlmprobe.steps.dpo import dpo_steps
from vlmprobe.steps.grpo import grpo_steps
from vlmprobe.steps.sft import train_steps

__all__ = ["TAIL", "error_row", "is_out_of_memory", "measure"]

TAIL = 2000  # characters of a traceback or of stderr kept in a failed row


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says the device ran out of memory. The caching allocator raises OutOfMemoryError; memory
    taken outside it fails as a RuntimeError whose message says so: "CUDA error: out of memory" from a
    driver call, CUBLAS_STATUS_ALLOC_FAILED / CUDNN_STATUS_ALLOC_FAILED when a library cannot get its
    workspace (the libraries' words for the same event)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in message.lower() or "_ALLOC_FAILED" in message)


def error_row(exc: Exception) -> dict:
    """The row of a point whose measurement raised `exc` (being handled): its last line, then the traceback."""
    tail = "".join(traceback.format_exception_only(exc)).strip()
    return {"status": Status.ERROR, "error": f"{tail}\n{traceback.format_exc()[-TAIL:]}"}


def measure(point: dict) -> dict:
    """Outputs of one point (the sweep adds the inputs). `point` is the resolved config as plain data,
    with measure.backend already resolved to cuda, cpu or estimate."""
    try:
        return measure_once(point, replay_blocks=True)
    except Mismatch:  # the blocks did not repeat the first one's program as the replay needs: run every block
        return measure_once(point, replay_blocks=False)


@dataclass
class Loaded:
    """What a point's step runs on, once loaded."""

    engine: object  # vlmprobe.distributed: the model (wrapped or sharded) and its optimizer
    model: torch.nn.Module  # the model as built, knobs applied
    batch: dict | None  # the SFT batch (GRPO and DPO make their prompt + completion batches themselves)
    settings: object  # the step's settings (GRPOSettings, DPOSettings, None for sft)
    reference: torch.nn.Module | None  # GRPO's or DPO's frozen reference model, where there is one


def measure_once(point: dict, replay_blocks: bool) -> dict:
    """measure(), with the estimate's replay of a tower's blocks on or off."""
    backend = backends.get(point["measure"]["backend"])
    spec = build_spec(point["model"])
    data = DataShape.from_config(point["data"])
    report = StepReport()
    out: dict = {"backend": backend.name, "status": Status.OK}
    card = device_profile.from_config(point.get("device"))  # the target card, or None
    dataset = (DatasetRun(*plan_dataset(point, spec, data, rank()), world=world_size(point), packing=data.packing)
               if data.source is not None else None)
    with session(backend, point, card) as meter, contextlib.ExitStack() as host_memory:
        loaded, held = None, {}
        try:
            loaded = load(backend, meter, point, spec, data, host_memory, out)
            if dataset is not None:
                autocast = backend.autocast(DTYPES.get(point["train"].get("autocast_dtype") or ""))
                dataset.run(backend, meter, point, spec, data, loaded.engine, autocast, report)
            else:
                train(backend, meter, point, spec, data, loaded, report, replay_blocks)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            if dataset is not None:
                dataset.ran_out(backend, meter)
            ran_out(backend, meter, report, out, str(exc))
            out["oom_filled"] = backend.oom_filled(meter, loaded.engine if loaded is not None else None)
            held = held_when_out(loaded)
        if dataset is not None:  # its records (steps.csv, vlmprobe.run.sweep) and the row's notes on them
            out["steps"] = dataset.rows()
            meter.notes.extend(dataset.notes)
            out["dataset_steps"] = dataset.note()
        read_figures(backend, meter, point, card, report, out)
        out.update(held)
    return out


def held_when_out(loaded: Loaded | None) -> dict:
    """An out-of-memory row's gradients and optimizer state as they stood when it ran out (the weights are
    params_bytes already; the rest of its peak is activations, the loss and workspaces): what filled the memory,
    in the row's own columns. Nothing where it ran out while loading."""
    if loaded is None:
        return {}
    state = loaded.engine.state_tensors()
    return {"grads_bytes": loaded.engine.grads_bytes(),
            "optimizer_state_bytes": sum(t.untyped_storage().nbytes() for t in state)}


def session(backend, point: dict, card):
    """The backend's session for this point: the capacity it may use (the card's, or measure.device_memory),
    allocation history, and the allocator settings (measure.alloc_conf)."""
    measure = point["measure"]
    capacity = device_profile.capacity(measure.get("device_memory"), card)
    settings = alloc_conf.parse(measure.get("alloc_conf"))
    allowed = alloc_conf.allowed_maximum(settings, capacity, imposed=measure.get("device_memory") is not None)
    return backend.session(capacity, measure["record_history"], card, settings, allowed)


def load(backend, meter, point: dict, spec, data: DataShape, host_memory: contextlib.ExitStack, out: dict) -> Loaded:
    """Build the model (knobs applied), the batch, the engine's wrapping and optimizer and the reference model,
    in that order, noting the load's figures in `out` as they are known."""
    train = point["train"]
    engine = engines.make(point, backend.device())  # single GPU, DDP or sharded
    # offload off cuda: host buffers counted apart, from the build on (zero.Init partitions to the host)
    host_memory.enter_context(engine.host_memory())
    model, out["build_peak_bytes"] = backend.load_model(
        meter, model_key(point), lambda mark: built(spec, engine, train, backend.name, meter, mark))
    # a dataset's batches are made step by step (vlmprobe.point.dataset_steps)
    batch = spec.batch(data, backend.device()) if point["step"]["name"] == "sft" and data.source is None else None
    engine.prepare(spec, model, instantiate(point["optimizer"], _convert_="all"))
    settings = step_settings(point, data, spec)
    reference = reference_model(spec, point, engine, settings)
    meter.sync()
    out["after_load_bytes"] = meter.current()
    out["load_peak_bytes"] = meter.peaks()["allocated"]  # the build and prepare (the session's start on)
    out["params_bytes"] = engine.params_bytes()
    return Loaded(engine, model, batch, settings, reference)


def train(backend, meter, point: dict, spec, data: DataShape, loaded: Loaded, report: StepReport,
          replay_blocks: bool) -> None:
    """The point's measured steps (measure.steps of them), filling `report`."""
    train_cfg, steps, engine = point["train"], point["measure"]["steps"], loaded.engine
    autocast = backend.autocast(DTYPES.get(train_cfg.get("autocast_dtype") or ""))
    step = point["step"]["name"]
    if step == "sft":
        towers = spec.repeated_blocks(loaded.model) if replay_blocks else ()
        train_steps(spec, engine, loaded.batch, meter, steps, autocast, report, accum=train_cfg["grad_accum_steps"],
                    hold_outputs=point["measure"]["hold_outputs"], replay=backend.step_replay(meter, engine, towers))
        return
    run = grpo_steps if step == "grpo" else dpo_steps
    run(spec, engine, loaded.reference, data, backend.device(), meter, steps, autocast, report,
        train_cfg["grad_accum_steps"], loaded.settings, lambda: adapters_disabled(engine.model))
    if step == "grpo" and loaded.settings.use_vllm:
        meter.notes.append("use_vllm: a vLLM server generates the completions; no generate phase on this GPU")


def ran_out(backend, meter, report: StepReport, out: dict, message: str) -> None:
    """An out-of-memory row: its message, what it asked for, and the peaks of the window it ended (step
    windows fold into the report only when a step finishes)."""
    out.update(status=Status.OOM, error=message.strip().splitlines()[0],
               **backend.oom_columns(meter, message))
    report.peak_phase = report.running  # where it ran out: the row's peak is that phase's
    for key, value in meter.peaks().items():
        report.peaks[key] = max(report.peaks.get(key, 0), value)


def read_figures(backend, meter, point: dict, card, report: StepReport, out: dict) -> None:
    """The row's figures from the report and the backend, its notes, and its snapshot where one is written."""
    meter.notes.extend(quantization.notes(point["train"], backend.name) + quantization.optimizer_notes(point["optimizer"])
                       + liger.notes(point["train"]) + recipe_notes(point.get("recipe")))
    out.update(report_columns(report))
    out["imposed_capacity_bytes"] = meter.capacity
    out.update(backend.final_stats(meter))
    if (timeline := backend.timeline(meter)) is not None:  # not a column: vlmprobe.run.sweep writes it apart
        out["timeline"] = timeline
    if out["status"] == Status.OK:  # an oom row's reservation is the capacity it ran into, not a prediction
        out["predicted_device_bytes"] = backend.predicted_device_bytes(meter, card)
        if out["predicted_device_bytes"] is not None and (note := device_profile.context_note(card)):
            meter.notes.append(note)
    out["notes"] = "; ".join(meter.notes) or None
    path = point["measure"].get("snapshot_file")
    if path and (point["measure"]["snapshot"] or out["status"] == Status.OOM):
        out["snapshot_file"] = path if backend.write_snapshot(meter, path) else None


def recipe_notes(recipe: dict | None) -> list[str]:
    """What the point's recipe (conf/recipe/) does that the estimate does not model, each said in the row's notes."""
    if not recipe:
        return []
    return [f"recipe {recipe['name']} does, not modelled here: {item}" for item in recipe.get("not_modelled") or []]


def report_columns(report: StepReport) -> dict:
    """The row's columns from what the steps measured; the figures of a step that never finished are empty."""
    done = bool(report.last_step_peaks)
    return {
        "peak_allocated_bytes": report.peaks.get("allocated"),
        "peak_reserved_bytes": report.peaks.get("reserved"),
        "peak_active_bytes": report.peaks.get("active"),
        "last_step_peak_allocated_bytes": report.last_step_peaks.get("allocated"),
        "last_step_peak_reserved_bytes": report.last_step_peaks.get("reserved"),
        **{f"{phase}_peak_bytes": report.phase_peaks.get(phase) for phase in Phase},
        "peak_phase": report.peak_phase or None,
        "activations_bytes": report.activations_bytes if done else None,
        "after_step_bytes": report.after_step_bytes if done else None,
        "grads_bytes": report.grads_bytes if done else None,
        "optimizer_state_bytes": report.optimizer_state_bytes if done else None,
        "optimizer_state_dtype": report.optimizer_state_dtype or None,
        "step_time_s": round(report.step_time_s, 4) if done else None,
    }
