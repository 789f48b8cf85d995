"""Shared test helpers: compose configs the way `python -m vlmprobe` does, and run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
import torch
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from vlmprobe.plan import plan

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def nothing_kept_from_other_tests():
    """Every test starts with no optimizer step logs (vlmprobe.estimate.step_replay) and no built models
    (vlmprobe.estimate.built_models) kept from another's points: a process keeps both across the points it
    measures; a test that measures a point after another says so."""
    from vlmprobe.estimate.built_models import BUILT_MODELS
    from vlmprobe.estimate.step_replay import OPTIMIZER_PLANS

    OPTIMIZER_PLANS.clear()
    BUILT_MODELS.clear()
    yield
    OPTIMIZER_PLANS.clear()
    BUILT_MODELS.clear()


@pytest.fixture
def compose():
    """compose(overrides) -> DictConfig, from conf/ as the CLI composes it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda overrides: hydra.compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def plan_points(compose):
    """plan_points(overrides) -> the planned points of that command line."""

    def _plan(overrides):
        base = OmegaConf.to_container(compose(overrides), resolve=True)
        return plan(compose, list(overrides), base)

    return _plan


@pytest.fixture
def point(plan_points):
    """point(overrides) -> the composed, validated config dict of a single-point command line."""

    def _point(overrides):
        (planned,) = plan_points(overrides)
        return planned.config

    return _point


def run_cli(args, cwd, env_extra=None, timeout=600):
    """`python -m vlmprobe ARGS` in a subprocess, as a user runs it."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "vlmprobe", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
