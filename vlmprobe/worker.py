"""One point, measured: build the model on the backend's device, make the batch and the optimizer, run the
steps, read memory. `python -m vlmprobe.worker` does it in a fresh process: it reads the point (JSON) on
stdin and prints its result as the last stdout line, `ROW_PREFIX{json}`. An out-of-memory is a result
(status `oom`); anything else that goes wrong is the sweep's to record from the exit code and stderr.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from pathlib import Path
import traceback

import torch

from vlmprobe import backends
from vlmprobe.estimate import alloc_conf, device_profile
from vlmprobe import quantization
from vlmprobe.knobs import apply_knobs
from vlmprobe.models.base import DataShape
from vlmprobe.distributed import engines
from vlmprobe.estimate.block_replay import Mismatch
from vlmprobe.steps.common import StepReport
from vlmprobe.steps.sft import train_steps

ROW_PREFIX = "VLMPROBE_ROW "
TAIL = 2000  # characters of a traceback or of stderr kept in a failed row
PHASES = ("generate", "reference", "forward", "backward", "optimizer")  # every step's phases, as row columns
RAISED = 3  # exit code when the measurement raised: the sweep records status `error` with the traceback
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_spec(model_cfg):
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from vlmprobe.errors import ConfigError

    try:
        return instantiate(model_cfg, _convert_="all")
    except InstantiationException as exc:
        if isinstance(exc.__cause__, ConfigError):  # the family's own one line (e.g. a model.config that is missing)
            raise exc.__cause__ from None
        raise


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says the device ran out of memory. The caching allocator raises OutOfMemoryError; memory
    taken outside it fails as a RuntimeError whose message says so: "CUDA error: out of memory" from a
    driver call, CUBLAS_STATUS_ALLOC_FAILED / CUDNN_STATUS_ALLOC_FAILED when a library cannot get its
    workspace. measure_vram.py matches "out of memory" in the message; the ALLOC_FAILED statuses are the
    libraries' words for the same event."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in message.lower() or "_ALLOC_FAILED" in message)


def measure(point: dict) -> dict:
    """Outputs of one point (the sweep adds the inputs). `point` is the resolved config as plain data,
    with measure.backend already resolved to cuda, cpu or estimate."""
    try:
        return _measure(point, replay_blocks=True)
    except Mismatch:  # the blocks did not repeat the first one's program as the replay needs: run every block
        return _measure(point, replay_blocks=False)


def _measure(point: dict, replay_blocks: bool) -> dict:
    from hydra.utils import instantiate

    backend = backends.get(point["measure"]["backend"])
    train = point["train"]
    spec = build_spec(point["model"])
    data = DataShape.from_config(point["data"])
    report = StepReport()
    out: dict = {"backend": backend.name, "status": "ok"}
    device = device_profile.from_config(point.get("device"))  # the target card, or None
    capacity = device_profile.capacity(point["measure"].get("device_memory"), device)
    settings = alloc_conf.parse(point["measure"].get("alloc_conf"))
    allowed = alloc_conf.allowed_maximum(settings, capacity, imposed=point["measure"].get("device_memory") is not None)
    with backend.session(capacity, point["measure"]["record_history"], device, settings, allowed) as meter, \
            contextlib.ExitStack() as host_memory:
        try:
            engine = engines.make(point, backend.device())  # single GPU, DDP or sharded
            # offload off cuda: host buffers counted apart, from the build on (zero.Init partitions to the host)
            host_memory.enter_context(engine.host_memory())
            model, out["build_peak_bytes"] = backend.load_model(
                meter, model_key(point), lambda mark: built(spec, engine, train, backend.name, meter, mark))
            step = point["step"]["name"]
            # GRPO and DPO make their prompt + completion batches themselves
            batch = spec.batch(data, backend.device()) if step == "sft" else None
            engine.prepare(spec, model, instantiate(point["optimizer"], _convert_="all"))
            settings = step_settings(point, data, spec)
            reference = reference_model(spec, point, engine, settings)
            meter.sync()
            out["after_load_bytes"] = meter.current()
            out["load_peak_bytes"] = meter.peaks()["allocated"]  # the build and prepare (the session's start on)
            out["params_bytes"] = engine.params_bytes()
            autocast = backend.autocast(DTYPES.get(train.get("autocast_dtype") or ""))
            if step == "sft":
                train_steps(spec, engine, batch, meter, point["measure"]["steps"], autocast, report,
                            accum=train["grad_accum_steps"], hold_outputs=point["measure"]["hold_outputs"],
                            replay=backend.step_replay(meter, engine,
                                                       spec.repeated_blocks(model) if replay_blocks else ()))
            else:
                from vlmprobe.knobs import adapters_disabled
                from vlmprobe.steps.dpo import dpo_steps
                from vlmprobe.steps.grpo import grpo_steps

                run = grpo_steps if step == "grpo" else dpo_steps
                run(spec, engine, reference, data, backend.device(), meter, point["measure"]["steps"], autocast, report,
                    train["grad_accum_steps"], settings, lambda: adapters_disabled(engine.model))
                if step == "grpo" and settings.use_vllm:
                    meter.notes.append("use_vllm: a vLLM server generates the completions; no generate phase on this GPU")
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            message = str(exc)
            out.update(status="oom", error=message.strip().splitlines()[0][:500], **backend.oom_columns(meter, message))
            # the window the OOM ended (step windows fold into the report only when a step finishes)
            for key, value in meter.peaks().items():
                report.peaks[key] = max(report.peaks.get(key, 0), value)
        meter.notes.extend(quantization.notes(train, backend.name))
        out.update(_report_columns(report))
        out["imposed_capacity_bytes"] = meter.capacity
        out.update(backend.final_stats(meter))
        if out["status"] == "ok":  # an oom row's reservation is the capacity it ran into, not a prediction
            out["predicted_device_bytes"] = backend.predicted_device_bytes(meter, device)
        out["notes"] = "; ".join(meter.notes) or None
        path = point["measure"].get("snapshot_file")
        if path and (point["measure"]["snapshot"] or out["status"] == "oom"):
            out["snapshot_file"] = path if backend.write_snapshot(meter, path) else None
    return out


def built(spec, engine, train: dict, backend_name: str, meter, mark) -> tuple[torch.nn.Module, int]:
    """The point's model, knobs applied, in training mode, and the build's peak allocated bytes (the model's
    construction and its weights' fill), read before `mark()`."""
    model = engine.build(spec, DTYPES[train["param_dtype"]])
    # What the build left to reference cycles is freed before training: between a model's load and
    # its first step a real run allocates Python objects by the million, so a full collection has
    # run. (Under zero.Init, a tied LM head's first weight, replaced by the embedding's, is held by
    # DeepSpeed's per-parameter closures, pinned host piece and all.) The estimate and cpu sessions
    # run with the collector off from a full collection on (vlmprobe.estimate.tracked), so everything
    # made since is in the youngest generation: collecting that one is collecting the build's garbage,
    # without walking the whole heap again. On cuda the collector runs as usual.
    gc.collect(0)
    build_peak = meter.peaks()["allocated"]
    mark()  # a kept model's build is replayed to here for this peak (vlmprobe.estimate.built_models)
    quantization.quantize(model, train, backend_name)  # QLoRA's base, before its adapters
    apply_knobs(spec, model, train)
    model.train()
    return model, build_peak


def model_key(point: dict) -> str | None:
    """What decides the model a point builds, knobs applied: its model and train config, for a backend that keeps
    built models for later points (vlmprobe.estimate.built_models). None where it is not kept: an engine other
    than the single device's wraps or shards it (dist), GRPO and DPO build a reference model beside it."""
    if point["dist"]["name"] != "none" or point["step"]["name"] != "sft":
        return None
    return json.dumps([point["model"], point["train"]], sort_keys=True)


def step_settings(point: dict, data: DataShape, spec):
    """The step's validated settings: GRPOSettings, DPOSettings, or None for sft."""
    if point["step"]["name"] == "grpo":
        from vlmprobe.steps.grpo import GRPOSettings

        return GRPOSettings.from_point(point, data, spec)
    if point["step"]["name"] == "dpo":
        from vlmprobe.steps.dpo import DPOSettings

        return DPOSettings.from_point(point, data, spec)
    return None


def reference_model(spec, point: dict, engine, settings):
    """The frozen reference model of GRPO (beta > 0) and DPO: a copy of the policy in its weight dtype (TRL
    loads it with the policy's model_init_kwargs), no gradients, eval mode, prepared as TRL prepares it beside
    the engine; None where there is none or the policy is its own reference (LoRA: both trainers disable the
    adapters)."""
    if settings is None or not settings.reference or point["train"]["lora_r"]:
        return None
    model = engine.build(spec, DTYPES[point["train"]["param_dtype"]])
    return engine.prepare_reference(spec, model.requires_grad_(False).eval())


def _report_columns(report: StepReport) -> dict:
    done = bool(report.last_step_peaks)
    return {
        "peak_allocated_bytes": report.peaks.get("allocated"),
        "peak_reserved_bytes": report.peaks.get("reserved"),
        "peak_active_bytes": report.peaks.get("active"),
        "last_step_peak_allocated_bytes": report.last_step_peaks.get("allocated"),
        "last_step_peak_reserved_bytes": report.last_step_peaks.get("reserved"),
        **{f"{phase}_peak_bytes": report.phase_peaks.get(phase) for phase in PHASES},
        "peak_phase": report.peak_phase or None,
        "activations_bytes": report.activations_bytes if done else None,
        "after_step_bytes": report.after_step_bytes if done else None,
        "grads_bytes": report.grads_bytes if done else None,
        "optimizer_state_bytes": report.optimizer_state_bytes if done else None,
        "optimizer_state_dtype": report.optimizer_state_dtype or None,
        "step_time_s": round(report.step_time_s, 4) if done else None,
    }


def error_row(exc: Exception) -> dict:
    """The row of a point whose measurement raised `exc` (being handled): its last line, then the traceback."""
    tail = "".join(traceback.format_exception_only(exc)).strip()
    return {"status": "error", "error": f"{tail}\n{traceback.format_exc()[-TAIL:]}"}


def describe(backend_name: str) -> dict:
    return backends.get(backend_name).describe()


def serve() -> None:
    """A serving worker (vlmprobe.sweep.ServingWorker): one point per stdin line,
    measured one after another in this process, each result printed as soon as it is known. A point that raises
    is an `error` row, as when the sweep process measures it (vlmprobe.sweep.run_point), and the next line is
    read."""
    for line in sys.stdin:
        try:
            result = measure(json.loads(line))
        except Exception as exc:
            result = error_row(exc)
        _print_row(result)


def _print_row(result: dict) -> None:
    # on a line of its own, whatever a library printed before it without a newline
    sys.stdout.write("\n" + ROW_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def main() -> None:
    if sys.argv[1:] == ["--serve"]:  # a serving worker where it cannot be forked (child.FORKS)
        serve()
        return
    if len(sys.argv) > 1:  # one rank of a distributed point: torchrun started it with the request's path
        from vlmprobe.distributed.launcher import run_rank

        sys.exit(run_rank(Path(sys.argv[1]), measure))
    request = json.loads(sys.stdin.read())
    _print_row(describe(request["describe"]) if "describe" in request else measure(request))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(RAISED)
