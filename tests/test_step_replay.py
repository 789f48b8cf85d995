"""The estimate replays a plain point's later forward and backward from the first step's allocations
(vlmprobe.estimate.step_replay). Checked against running every step: on fake tensors with the replay off, and on
the cpu backend's real tensors, which never replay (tests/test_estimate.py compares that backend on the real
families' configs)."""

import contextlib
import dataclasses
import functools

import pytest
import torch
from torch import nn

from vlmprobe import backends
from vlmprobe.distributed.engines import Engine
from vlmprobe.estimate import step_replay
from vlmprobe.estimate.tracked import TrackedBackend
from vlmprobe.steps.common import StepReport
from vlmprobe.steps.sft import train_steps
from vlmprobe.worker import measure

from test_estimate import BYTE_COLUMNS


@pytest.fixture
def plans(monkeypatch):
    """Whether each point's log became a replay plan (True) or why not, in order."""
    made = []
    of = step_replay._Plan.of.__func__

    def spy(cls, *args):
        plan, refused = of(cls, *args)
        made.append(plan is not None or refused)
        return plan, refused

    monkeypatch.setattr(step_replay._Plan, "of", classmethod(spy))
    return made


@pytest.mark.parametrize("model", ["nanovlm_tiny", "qwen2_vl_tiny"])
@pytest.mark.parametrize("hold", ["true", "false"])
def test_replayed_steps_give_the_figures_of_running_every_step(point, monkeypatch, plans, model, hold):
    overrides = [f"model={model}", "data.batch_size=2", "data.lm_max_length=48", "measure.steps=3",
                 f"measure.hold_outputs={hold}", "measure.backend=estimate"]
    replayed = measure(point(overrides))
    assert plans == [True]  # the plain step is replayed, not quietly run: the speed-up is there
    monkeypatch.setattr(TrackedBackend, "step_replay", lambda self, meter, engine: None)
    run = measure(point(overrides))
    assert replayed["status"] == run["status"] == "ok"
    assert {k: replayed[k] for k in BYTE_COLUMNS} == {k: run[k] for k in BYTE_COLUMNS}


@pytest.mark.parametrize("knobs", [["train.grad_ckpt.lm=true"], ["train.lora_r=4"], ["train.freeze_vision=true"],
                                   # with both, a reference cycle keeps a hidden state of each step (the session's
                                   # collector is off): a log that does not account for it is not replayed
                                   ["train.grad_ckpt.lm=true", "train.lora_r=4"]])
def test_knobs_replay_where_the_log_accounts_for_every_block_and_equal_the_cpu_backend(point, plans, knobs):
    overrides = ["model=qwen2_vl_tiny", "data.batch_size=2", "data.lm_max_length=48", *knobs]
    estimate = measure(point(overrides + ["measure.backend=estimate"]))
    cpu = measure(point(overrides + ["measure.backend=cpu"]))
    if len(knobs) == 1:
        assert plans == [True]
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


class ToySpec:
    """A two-layer model whose forward returns (loss, outputs) in one of the ways a real one may: outputs autograd
    saves (freed in the backward), outputs it does not (freed by Python after the forward unless held), and a
    forward that keeps a tensor of its first call (a cache), which no replay may repeat."""

    def __init__(self, outputs: str):
        self.outputs = outputs
        self.cache = []

    def loss(self, model, batch):
        hidden = model(batch)
        if self.outputs == "cached" and not self.cache:
            self.cache.append(hidden.detach() * 2)
        loss = hidden.square().mean()
        return loss, (hidden if self.outputs == "saved" else hidden.detach() + 1)


def toy_run(backend_name: str, outputs: str, hold: bool, replay: bool) -> dict:
    """Every figure of three steps: the report's (the wall time aside) and the meter's at the end."""
    backend = backends.get(backend_name)
    spec, report = ToySpec(outputs), StepReport()
    with backend.session(None) as meter:
        engine = Engine({"dist": {}}, backend.device())
        model = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 96))
        engine.prepare(spec, model, functools.partial(torch.optim.AdamW, lr=1e-3))
        batch = torch.randn(24, 96)
        train_steps(spec, engine, batch, meter, 3, contextlib.nullcontext, report, hold_outputs=hold,
                    replay=backend.step_replay(meter, engine) if replay else None)
        figures = {**meter.peaks(), "current": meter.current()}
    return {**figures, **dataclasses.asdict(report), "step_time_s": None}


@pytest.mark.parametrize("outputs", ["saved", "unsaved", "cached"])
@pytest.mark.parametrize("hold", [True, False])
def test_a_replay_frees_what_python_and_autograd_freed_and_refuses_a_forward_that_keeps_a_tensor(plans, outputs, hold):
    replayed = toy_run("estimate", outputs, hold, replay=True)
    assert plans == [True] if outputs != "cached" else plans[0].startswith(
        "a block of 9216 B outlives the step")  # the cache: 24 x 96 fp32
    assert replayed == toy_run("estimate", outputs, hold, replay=False)
    assert replayed == toy_run("cpu", outputs, hold, replay=False)
