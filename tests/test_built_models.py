"""A process keeps the model an estimate point built for later points with the same model and knobs, and replays the
build into each one's allocator model (vlmprobe.estimate.replay.built_models). Checked against building every point's
model: with nothing kept, the same figures."""

import gc
import weakref

import pytest
import torch
from torch import nn

from vlmprobe import backends
from vlmprobe.distributed.base import Engine
from vlmprobe.estimate.replay.built_models import BUILT_MODELS
from vlmprobe.point.build import model_key
from vlmprobe.point.measure import measure


@pytest.fixture
def builds(monkeypatch):
    """How many models the points built."""
    count = [0]
    build = Engine.build

    def counted(self, spec, dtype):
        count[0] += 1
        return build(self, spec, dtype)

    monkeypatch.setattr(Engine, "build", counted)
    return count


def without_time(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "step_time_s"}


@pytest.mark.parametrize("model", ["nanovlm_tiny", "qwen2_vl_tiny"])
def test_points_with_one_model_and_knobs_build_it_once_and_give_the_rows_of_building_each(point, builds, model):
    knobs = [[], ["train.grad_ckpt.lm=true", "train.lora_r=4"]]
    data = [["data.batch_size=1", "data.lm_max_length=48"], ["data.batch_size=3", "data.lm_max_length=80"]]
    points = [point([f"model={model}", "measure.backend=estimate", *k, *d]) for d in data for k in knobs]
    kept = [measure(p) for p in points]
    assert builds[0] == 2  # one a knob set: the second data shape took the models the first built
    fresh = []
    for p in points:
        BUILT_MODELS.clear()
        fresh.append(measure(p))
    assert builds[0] == 2 + 4
    assert {r["status"] for r in kept} == {"ok"}
    assert [without_time(r) for r in kept] == [without_time(r) for r in fresh]


def test_a_replayed_build_runs_out_of_memory_where_building_it_would(point, builds):
    overrides = ["model=nanovlm_tiny", "measure.backend=estimate", "data.batch_size=1", "data.lm_max_length=48"]
    first = measure(point(overrides))
    small = point(overrides + [f"measure.device_memory={first['build_peak_bytes'] // 2}"])
    replayed = measure(small)
    BUILT_MODELS.clear()
    built = measure(small)
    assert builds[0] == 2  # the small one built only when nothing was kept
    assert replayed["status"] == "oom" and "Tried to allocate" in replayed["error"]
    assert without_time(replayed) == without_time(built)


def test_the_key_is_the_model_and_train_config_of_a_single_device_sft_point(point):
    base = ["model=nanovlm_tiny", "measure.backend=estimate"]
    key = model_key(point(base))
    assert key == model_key(point(base + ["data.batch_size=7", "data.lm_max_length=96", "measure.steps=3"]))
    assert key != model_key(point(base + ["train.freeze_vision=true"]))
    assert key != model_key(point(["model=qwen2_vl_tiny", "measure.backend=estimate"]))
    assert model_key(point(base + ["dist=fsdp2", "dist.world_size=2"])) is None


class Caching(nn.Module):
    """A module whose forward changes it as models do: a tensor cached on its first call, a buffer replaced, a
    hook registered, an attribute added."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("scale", torch.ones(64))
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.zeros(256, 64)
        self.scale = torch.ones(128)
        self.register_forward_hook(lambda *args: None)
        self.calls = 1
        return self.linear(x) * self.scale[:64]


def figures(tracker) -> tuple:
    model = tracker.allocator
    return model.allocated, model.reserved, model.peak_allocated, model.peak_reserved


def load(tracker, build=None):
    """BUILT_MODELS.load of a Caching model, charged to `tracker`; build: what builds it."""
    def built(mark):
        model = (build or Caching)()
        peak = tracker.allocator.peak_allocated
        mark()
        model.linear.requires_grad_(False)  # a knob
        return model, peak

    return BUILT_MODELS.load(tracker, "caching", built)


def run(model):
    model(torch.randn(4, 64)).sum()


def test_a_kept_model_is_put_back_as_built_and_charged_as_a_fresh_build():
    backend = backends.get("estimate")
    with backend.session(None) as meter:
        model, first_peak = load(meter.tracker)
        run(model)
    with backend.session(None) as meter:
        kept, kept_peak = load(meter.tracker)
        after_load = figures(meter.tracker)
        assert kept is model
        assert kept.cache is None and kept.scale.shape == (64,) and not hasattr(kept, "calls")
        assert not kept._forward_hooks and not kept.linear.weight.requires_grad
        run(kept)
        after_run = figures(meter.tracker)
    BUILT_MODELS.clear()
    with backend.session(None) as meter:
        fresh, fresh_peak = load(meter.tracker)
        assert fresh is not model
        assert figures(meter.tracker) == after_load and fresh_peak == kept_peak == first_peak
        run(fresh)
        assert figures(meter.tracker) == after_run
    # the kept model's storages are freed into the session that took it when they die
    with backend.session(None) as meter:
        kept, _ = load(meter.tracker)
        assert meter.tracker.current > 0
        BUILT_MODELS.clear()
        del kept, model, fresh
        gc.collect()
        assert meter.tracker.current == 0


def test_a_build_that_leaves_a_block_its_model_does_not_hold_is_built_again():
    outside = []

    def build():
        outside.append(torch.empty(1000))
        return Caching()

    backend = backends.get("estimate")
    with backend.session(None) as meter:
        model, _ = load(meter.tracker, build)
    with backend.session(None) as meter:
        again, _ = load(meter.tracker, build)
    assert again is not model and len(outside) == 2


def test_a_kept_model_whose_modules_changed_is_built_again():
    backend = backends.get("estimate")
    with backend.session(None) as meter:
        model, _ = load(meter.tracker)
        model.extra = nn.Linear(4, 4)
    with backend.session(None) as meter:
        again, _ = load(meter.tracker)
    assert again is not model


def test_a_session_is_not_kept_alive_by_the_model_it_built():
    backend = backends.get("estimate")
    with backend.session(None) as meter:
        model, _ = load(meter.tracker)
        tracker = weakref.ref(meter.tracker)
    del meter
    gc.collect()
    assert tracker() is None and model is not None
