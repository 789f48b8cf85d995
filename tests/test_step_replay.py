"""The estimate replays a plain point's later forward and backward from the first step's allocations
(vlmprobe.estimate.replay.steps). Checked against running every step: on fake tensors with the replay off, and on
the cpu backend's real tensors, which never replay (tests/test_estimate.py compares that backend on the real
families' configs)."""

import contextlib
import dataclasses
import functools

import pytest
import torch
from torch import nn

from vlmprobe import backends
from vlmprobe.backends.estimate import EstimateBackend
from vlmprobe.distributed.base import Engine
from vlmprobe.estimate.replay import steps as step_replay
from vlmprobe.point.measure import measure
from vlmprobe.steps.common import StepReport
from vlmprobe.steps.sft import train_steps

from test_estimate import BYTE_COLUMNS


@pytest.fixture
def optimizer_replays(monkeypatch):
    """Whether each point's optimizer steps were replayed from an earlier point's logs, in order."""
    seen = []
    every = step_replay.OptimizerPlans.every

    def spy(self, key, steps):
        plans = every(self, key, steps)
        seen.append(plans is not None)
        return plans

    monkeypatch.setattr(step_replay.OptimizerPlans, "every", spy)
    return seen


def plans_made(monkeypatch, plan_class) -> list:
    """Whether each log `plan_class.of` is given becomes a plan (True) or why not, in order."""
    made = []
    of = plan_class.of.__func__

    def spy(cls, *args):
        plan, refused = of(cls, *args)
        made.append(plan is not None or refused)
        return plan, refused

    monkeypatch.setattr(plan_class, "of", classmethod(spy))
    return made


@pytest.fixture
def optimizer_logs(monkeypatch):
    """Whether each logged optimizer step became a plan (True) or why not, in order."""
    return plans_made(monkeypatch, step_replay._OptimizerPlan)


@pytest.fixture
def plans(monkeypatch):
    """Whether each point's log of its first forward and backward became a replay plan (True) or why not."""
    return plans_made(monkeypatch, step_replay._Plan)


@pytest.mark.parametrize("model", ["nanovlm_tiny", "qwen2_vl_tiny"])
@pytest.mark.parametrize("hold", ["true", "false"])
def test_replayed_steps_give_the_figures_of_running_every_step(point, monkeypatch, plans, model, hold):
    overrides = [f"model={model}", "data.batch_size=2", "data.lm_max_length=48", "measure.steps=3",
                 f"measure.hold_outputs={hold}", "measure.backend=estimate"]
    replayed = measure(point(overrides))
    assert plans == [True]  # the plain step is replayed, not quietly run: the speed-up is there
    monkeypatch.setattr(EstimateBackend, "step_replay", lambda self, meter, engine, towers=(): None)
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


def toy_run(backend_name: str, outputs: str, hold: bool, replay: bool, optimizer=torch.optim.AdamW) -> dict:
    """Every figure of three steps: the report's (the wall time aside) and the meter's at the end."""
    backend = backends.get(backend_name)
    spec, report = ToySpec(outputs), StepReport()
    with backend.session(None) as meter:
        engine = Engine({"dist": {}}, backend.device())
        model = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 96))
        engine.prepare(spec, model, functools.partial(optimizer, lr=1e-3))
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


@pytest.mark.parametrize("model,knobs", [
    ("nanovlm_tiny", []),
    ("nanovlm_tiny", ["optimizer=adamw_fused", "train.freeze_vision=true"]),
    ("nanovlm_tiny", ["optimizer=adamw_single_tensor", "train.grad_accum_steps=2"]),
    ("qwen2_vl_tiny", ["optimizer=sgd_momentum", "train.lora_r=4"]),
    ("qwen2_vl_tiny", ["optimizer=adafactor", "train.param_dtype=bfloat16", "train.autocast_dtype=null"]),
])
def test_a_point_after_one_with_the_same_optimizer_replays_its_steps_with_the_figures_of_running_them(
        point, optimizer_replays, model, knobs):
    base = [f"model={model}", *knobs, "measure.steps=3", "measure.backend=estimate"]
    measure(point(base + ["data.batch_size=2", "data.lm_max_length=48"]))  # runs and logs each optimizer step
    later = point(base + ["data.batch_size=3", "data.lm_max_length=64", "measure.hold_outputs=true"])
    replayed = measure(later)
    step_replay.OPTIMIZER_PLANS.clear()
    run = measure(later)
    assert optimizer_replays == [False, True, False]
    assert replayed["status"] == run["status"] == "ok"
    assert {k: replayed[k] for k in BYTE_COLUMNS} == {k: run[k] for k in BYTE_COLUMNS}
    assert replayed["optimizer_state_dtype"] == run["optimizer_state_dtype"]


def test_a_point_with_a_step_no_log_is_kept_of_runs_every_step_and_logs_that_one(point, optimizer_replays):
    base = ["model=nanovlm_tiny", "data.batch_size=2", "data.lm_max_length=48", "measure.backend=estimate"]
    measure(point(base + ["measure.steps=2"]))
    run = measure(point(base + ["measure.steps=3"]))  # no log of a third step: all three run, the third is logged
    replayed = measure(point(base + ["measure.steps=3"]))
    assert optimizer_replays == [False, False, True]
    assert {k: replayed[k] for k in BYTE_COLUMNS} == {k: run[k] for k in BYTE_COLUMNS}


def test_an_optimizer_step_out_of_memory_in_a_replay_is_the_row_of_running_it(point, optimizer_replays):
    # nanoVLM-222M at batch 1: the optimizer step holds the peak (AdamW's state on top of weights and gradients)
    base = ["model=nanovlm_222m", "data.batch_size=1", "data.lm_max_length=128", "measure.backend=estimate"]
    fits = measure(point(base))
    assert fits["peak_phase"] == "optimizer"
    # a card the forward and backward fit on and the first optimizer step does not
    small = point(base + [f"measure.device_memory={(fits['backward_peak_bytes'] + fits['optimizer_peak_bytes']) // 2}"])
    replayed = measure(small)
    step_replay.OPTIMIZER_PLANS.clear()
    run = measure(small)
    assert optimizer_replays == [False, True, False]
    assert replayed["status"] == run["status"] == "oom" and replayed["error"] == run["error"]
    assert {k: replayed.get(k) for k in BYTE_COLUMNS} == {k: run.get(k) for k in BYTE_COLUMNS}


class CachingSGD(torch.optim.SGD):
    """SGD that keeps a tensor of its first step outside its state, as a cache: no log of it may be replayed."""

    def step(self, closure=None):
        if not hasattr(self, "cache"):
            self.cache = torch.zeros(48, device=self.param_groups[0]["params"][0].device)
        return super().step(closure)


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, CachingSGD])
def test_an_optimizer_step_is_replayed_only_where_its_log_accounts_for_every_block(optimizer_logs, optimizer):
    logged = toy_run("estimate", "saved", True, replay=True, optimizer=optimizer)
    again = toy_run("estimate", "saved", True, replay=True, optimizer=optimizer)
    if optimizer is CachingSGD:  # the first step's log is refused; the next two are kept
        assert optimizer_logs == ["a block of 192 B outlives the optimizer step, not its state", True, True]
    else:
        assert optimizer_logs == [True, True, True]  # and the second run logs nothing: it replays every step
    assert logged == again == toy_run("cpu", "saved", True, replay=False, optimizer=optimizer)


def test_the_optimizer_key_holds_what_changes_its_blocks_and_not_the_batch():
    def key(dtype=torch.float32, grads=True, **settings):
        model = nn.Linear(8, 4).to(dtype)
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if grads else None
        return step_replay.OptimizerPlans.key(torch.optim.AdamW(model.parameters(), **settings))

    assert key() == key()  # another model of the same shapes (a point with another batch builds its own)
    assert len({key(), key(dtype=torch.bfloat16), key(grads=False), key(foreach=True), key(weight_decay=0.0)}) == 5
    assert key(lr=torch.tensor(1e-3)) is None  # a tensor setting: never replayed
