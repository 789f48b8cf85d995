"""Sharded multi-GPU points (vlmprobe.distributed): the FSDP2 estimate against real ranks on gloo, to the
byte and per rank; model states against a hand computation of the shards; the rows and ranks.csv; bad input."""

import json
import math

import pandas as pd
import pytest
import torch
from hydra.utils import instantiate

from conftest import real_run_that_agrees, run_cli
from vlmprobe.distributed import options
from vlmprobe.errors import ConfigError
from vlmprobe.point.build import build_spec, DTYPES
from vlmprobe.point.measure import measure
from vlmprobe.point.rank import simulate_rank
from vlmprobe.results.table import RANK_VALUE_COLUMNS
from vlmprobe.run.ranks import run_ranks, point_row, rank_groups, simulate_elsewhere

BYTES = [c for c in RANK_VALUE_COLUMNS if c.endswith("_bytes") and c not in (
    "peak_reserved_bytes", "last_step_peak_reserved_bytes", "peak_active_bytes", "nvml_used_bytes",
    "nvml_process_bytes")]
TINY = ["data.batch_size=2", "data.lm_max_length=64"]


@pytest.fixture
def run_dist(point):
    """run_dist(overrides) -> the outputs of a distributed point (rank rows under "ranks")."""
    return lambda overrides: run_ranks(point(overrides), dict(__import__("os").environ))


def by_rank(outputs):
    return {r["rank"]: {k: r.get(k) for k in BYTES} for r in outputs["ranks"]}


def compare_estimate_and_cpu(run_dist, model, world, dist=("dist=fsdp2",), unsettled=()):
    """The estimate equals real gloo ranks (a real run that agrees: conftest.REAL_RUNS) in every byte column but
    `unsettled`: columns left out, the real run's being timing-dependent (see the DDP test)."""
    base = [f"model={model}", *TINY, *dist, f"dist.world_size={world}"]
    estimate = run_dist(base + ["measure.backend=estimate"])
    assert estimate["status"] == "ok", estimate.get("error")
    assert len(estimate["ranks"]) == world and {r["backend"] for r in estimate["ranks"]} == {"estimate"}

    def settled(outputs):
        return {r: {k: v for k, v in row.items() if k not in unsettled} for r, row in by_rank(outputs).items()}

    def apart(cpu):
        assert cpu["status"] == "ok", cpu.get("error")
        assert len(cpu["ranks"]) == world and {r["backend"] for r in cpu["ranks"]} == {"cpu"}
        return {(rank, k): (settled(estimate)[rank][k], v) for rank, row in settled(cpu).items()
                for k, v in row.items() if settled(estimate)[rank][k] != v}

    return estimate, real_run_that_agrees(lambda: run_dist(base + ["measure.backend=cpu"]), apart)


# qwen2_vl_tiny (~30 s each here) behind -m slow: the suite has to stay within ~10 minutes on a 2-core machine
QWEN_SLOW = pytest.param("qwen2_vl_tiny", marks=pytest.mark.slow)


@pytest.mark.parametrize("model", ["nanovlm_tiny", QWEN_SLOW])
def test_fsdp2_estimate_equals_real_gloo_ranks_to_the_byte_at_world_size_2(run_dist, model):
    compare_estimate_and_cpu(run_dist, model, 2)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["nanovlm_tiny", "qwen2_vl_tiny"])
def test_fsdp2_estimate_equals_real_gloo_ranks_to_the_byte_at_world_size_4(run_dist, model):
    compare_estimate_and_cpu(run_dist, model, 4)


@pytest.mark.parametrize("model,view", [pytest.param("nanovlm_tiny", "false", marks=pytest.mark.slow),
                                        ("qwen2_vl_tiny", "true")])
def test_ddp_estimate_equals_real_gloo_ranks_to_the_byte_with_buckets_rebuilt(run_dist, model, view):
    # 0.25 MiB buckets: several per tiny model, which DDP rebuilds in the order the grads came in the first
    # forward after the first backward (without that rebuild the estimate's peak is 512 B off on qwen2_vl_tiny).
    # Left out: the load columns. DDP broadcasts rank 0's parameters when it wraps the model, through a flat copy
    # that gloo's worker thread may still hold when the load is read (seen on the last rank, now and then).
    dist = ("dist=ddp", "dist.bucket_cap_mb=0.25", f"dist.gradient_as_bucket_view={view}")
    compare_estimate_and_cpu(run_dist, model, 2, dist, unsettled=("after_load_bytes", "load_peak_bytes"))


def test_ddp_grads_as_bucket_views_hold_one_copy_of_the_grads_less(run_dist, point):
    base = ["model=qwen2_vl_tiny", *TINY, "dist=ddp", "measure.backend=estimate"]
    copies, views = (run_dist(base + [f"dist.gradient_as_bucket_view={v}"]) for v in ("false", "true"))
    assert copies["status"] == views["status"] == "ok", (copies.get("error"), views.get("error"))
    config = point(base)
    spec = build_spec(config["model"])
    model = spec.build(torch.device("meta"), DTYPES[config["train"]["param_dtype"]], init=False)
    # by hand: every trainable parameter's grad as its own block, rounded up to the allocator's 512 B
    grad_blocks = sum(math.ceil(p.numel() * p.element_size() / 512) * 512 for p in model.parameters() if p.requires_grad)
    assert copies["after_step_bytes"] - views["after_step_bytes"] == grad_blocks
    # views: the grads are the buckets, counted once each
    assert views["grads_bytes"] == copies["grads_bytes"]


def real_local_shapes(point_cfg, rank, world):
    """Each parameter's local shard shape on `rank`, from the real fully_shard on a meta model."""
    from vlmprobe.distributed.torch_engines import FSDP2Engine
    from vlmprobe.distributed.process_group import fake_group
    from vlmprobe.knobs import apply_knobs
    from vlmprobe.point.build import build_spec

    spec = build_spec(point_cfg["model"])
    model = spec.build(torch.device("meta"), torch.float32, init=False)
    apply_knobs(spec, model, point_cfg["train"])
    with fake_group(rank, world):
        engine = FSDP2Engine(point_cfg, torch.device("meta"))  # materialises on meta: shapes only
        engine.wrap(spec, model)
        return [tuple(engine.local(p).shape) for p in model.parameters()]


def test_a_rank_simulated_in_a_forked_child_equals_one_in_a_fresh_interpreter_and_one_in_this_process(point):
    # DeepSpeed ranks are simulated in a child (its process groups are module globals); FSDP2's ranks run the
    # same way here, without DeepSpeed (CI has none)
    cfg = point(["model=nanovlm_tiny", *TINY, "dist=fsdp2", "dist.world_size=2", "measure.backend=estimate"])
    forked = simulate_elsewhere(cfg, 1, fork=True)
    fresh = simulate_elsewhere(cfg, 1, fork=False)
    here = simulate_rank(cfg, 1)
    assert forked["status"] == fresh["status"] == here["status"] == "ok", (forked.get("error"), fresh.get("error"))
    assert {k: forked.get(k) for k in BYTES} == {k: fresh.get(k) for k in BYTES} == {k: here.get(k) for k in BYTES}
    assert forked["peak_allocated_bytes"] > 0


def test_a_rank_whose_simulation_fails_in_a_forked_child_is_a_row_with_the_error(point):
    cfg = point(["model=nanovlm_tiny", *TINY, "dist=fsdp2", "dist.world_size=2", "measure.backend=estimate"])
    cfg["model"]["_target_"] = "vlmprobe.models.no_such_module.Spec"  # fails inside the child, after planning
    row = simulate_elsewhere(cfg, 0, fork=True)
    assert row["status"] == "error" and "no_such_module" in row["error"]


@pytest.mark.parametrize("model,world", [("nanovlm_tiny", 3), ("qwen2_vl_tiny", 4)])
def test_ranks_are_grouped_by_the_shard_shapes_fully_shard_gives_them(point, model, world):
    cfg = point([f"model={model}", *TINY, "dist=fsdp2", f"dist.world_size={world}", "measure.backend=estimate"])
    shapes = [real_local_shapes(cfg, rank, world) for rank in range(world)]
    expected = {}
    for rank, local in enumerate(shapes):
        expected.setdefault(tuple(local), []).append(rank)
    assert rank_groups(cfg) == list(expected.values())


def test_model_states_per_rank_fall_as_1_over_n_as_a_hand_computation_of_the_shards(run_dist, compose):
    spec = instantiate(compose(["model=nanovlm_tiny"]).model, _convert_="all")
    shapes = [tuple(p.shape) for p in spec.build("meta", torch.float32, init=False).parameters()]
    whole = 4 * sum(math.prod(s) for s in shapes)  # fp32 bytes of the unsharded model
    for world in (1, 2, 4):
        outputs = run_dist(["model=nanovlm_tiny", *TINY, "dist=fsdp2", f"dist.world_size={world}",
                            "measure.backend=estimate"])
        rank0 = outputs["ranks"][0]
        chunk = [math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes]  # rank 0 holds the first, full chunk
        # params and grads live in shards padded to the largest chunk; AdamW's two states follow the shard
        assert rank0["params_bytes"] == rank0["grads_bytes"] == 4 * sum(chunk)
        assert rank0["optimizer_state_bytes"] == 2 * 4 * sum(chunk)
        assert abs(rank0["params_bytes"] - whole / world) <= 4 * len(shapes) * world * 64  # padding only


def test_activations_do_not_change_with_world_size_at_a_fixed_per_gpu_batch(run_dist):
    activations = {world: run_dist(["model=qwen2_vl_tiny", *TINY, "dist=fsdp2", f"dist.world_size={world}",
                                    "measure.backend=estimate"])["activations_bytes"] for world in (1, 2, 4)}
    assert len(set(activations.values())) == 1, activations


@pytest.mark.slow
def test_fsdp2_at_world_size_1_is_within_a_few_percent_of_one_gpu_without_sharding(run_dist, point):
    base = ["model=nanovlm_222m", "data.batch_size=4", "data.lm_max_length=512", "train.param_dtype=bfloat16",
            "train.autocast_dtype=null", "measure.backend=estimate"]
    single = measure(point(base))["peak_allocated_bytes"]
    sharded = run_dist(base + ["dist=fsdp2", "dist.world_size=1"])["peak_allocated_bytes"]
    assert abs(sharded / single - 1) < 0.05, (sharded, single)


def test_the_point_row_is_the_max_over_ranks_and_an_oom_names_its_rank():
    ok = {"status": "ok", "backend": "cpu", "peak_allocated_bytes": 100, "params_bytes": 10, "peak_phase": "backward"}
    rows = {0: {**ok, "peak_allocated_bytes": 80, "params_bytes": 12}, 1: ok, 2: {**ok, "peak_allocated_bytes": 100}}
    out, rank_rows = point_row(rows, 3, "cpu")
    assert out["status"] == "ok" and out["peak_allocated_bytes"] == 100 and out["params_bytes"] == 12
    assert out["max_rank"] == 1 and out["min_rank_peak_allocated_bytes"] == 80 and out["rank_imbalance"] == 1.25
    assert [r["rank"] for r in rank_rows] == [0, 1, 2]
    rows[2] = {"status": "oom", "backend": "cpu", "error": "Tried to allocate 2.00 GiB", "peak_allocated_bytes": 90}
    out, _ = point_row(rows, 3, "cpu")
    assert out["status"] == "oom" and out["error"].startswith("rank 2: Tried to allocate")
    out, _ = point_row({0: ok}, 2, "cpu", {"status": "crash", "error": "torchrun exit code 1"})
    assert out["status"] == "crash" and "ranks [1] left no row" in out["error"]


def test_a_rank_that_failed_before_its_backend_said_so_is_labelled_with_the_backend_that_ran_it():
    # a simulated rank's error row (worker.error_row) carries no backend: the row and ranks.csv still say estimate
    out, rank_rows = point_row({0: {"status": "error", "error": "RuntimeError: tracing error"}}, 1, "estimate")
    assert out["backend"] == "estimate" and [r["backend"] for r in rank_rows] == ["estimate"]
    assert out["status"] == "error" and out["error"] == "rank 0: RuntimeError: tracing error"


@pytest.mark.slow
def test_a_rank_out_of_memory_makes_the_launched_point_oom_and_names_the_rank(run_dist):
    out = run_dist(["model=nanovlm_tiny", *TINY, "dist=fsdp2", "measure.backend=cpu", "measure.device_memory=1MiB"])
    assert out["status"] == "oom" and out["error"].startswith("rank ")


@pytest.mark.slow
def test_ddp_ranks_hold_the_model_and_a_bucket_copy_of_its_grads(run_dist, point):
    base = ["model=nanovlm_tiny", *TINY, "measure.backend=cpu"]
    single = measure(point(base))
    ddp = run_dist(base + ["dist=ddp", "dist.world_size=2"])
    assert ddp["status"] == "ok", ddp.get("error")
    assert ddp["params_bytes"] == single["params_bytes"] and ddp["optimizer_state_bytes"] == single["optimizer_state_bytes"]
    # DDP allocates its buckets (grads-sized, fp32) when it wraps the model: after load holds them
    assert ddp["after_load_bytes"] - single["after_load_bytes"] >= single["params_bytes"]


def without_deepspeed(monkeypatch):
    """importlib finds no DeepSpeed; every other module as before (libraries look theirs up lazily)."""
    find_spec = options.importlib.util.find_spec
    monkeypatch.setattr(options.importlib.util, "find_spec",
                        lambda name, *args: None if name == "deepspeed" else find_spec(name, *args))


def test_zero_points_are_skipped_saying_how_to_get_deepspeed_where_it_is_missing(plan_points, monkeypatch):
    without_deepspeed(monkeypatch)
    (planned,) = plan_points(["model=nanovlm_tiny", *TINY, "dist=zero3", "measure.backend=estimate"])
    assert planned.skip == 'dist=zero3 needs DeepSpeed, not installed here: pip install -e ".[deepspeed]"'


@pytest.mark.slow  # ~15 s a model: real gloo ranks (the host-memory hand computation below stays fast)
@pytest.mark.parametrize("model", ["nanovlm_tiny", QWEN_SLOW])
def test_fsdp2_cpu_offload_estimate_equals_real_gloo_ranks_to_the_byte_host_memory_included(run_dist, model):
    estimate, _ = compare_estimate_and_cpu(run_dist, model, 2, dist=("dist=fsdp2", "dist.offload_param=cpu"))
    assert all(r["peak_host_bytes"] > 0 for r in estimate["ranks"])


def test_fsdp2_cpu_offload_keeps_shards_grads_and_adamw_state_in_pinned_host_memory_as_a_hand_computation(
        run_dist, compose):
    spec = instantiate(compose(["model=nanovlm_tiny"]).model, _convert_="all")
    shapes = [tuple(p.shape) for p in spec.build("meta", torch.float32, init=False).parameters()]
    base = ["model=nanovlm_tiny", *TINY, "dist=fsdp2", "dist.world_size=2", "measure.backend=estimate"]
    on_device = run_dist(base)["ranks"][0]
    offloaded = run_dist(base + ["dist.offload_param=cpu"])["ranks"][0]
    # the device keeps none of them; all else it held after a step (the batch, buffers) stays. The row's byte
    # figures are the storages' own sizes, after_step_bytes the allocator's blocks: each storage rounded up to
    # 512 B, so the difference is the model states plus less than 512 B for each of their storages (a shard
    # and two AdamW states per parameter, at most one gradient buffer per parameter)
    assert offloaded["params_bytes"] == offloaded["grads_bytes"] == offloaded["optimizer_state_bytes"] == 0
    states = on_device["params_bytes"] + on_device["grads_bytes"] + on_device["optimizer_state_bytes"]
    assert 0 <= on_device["after_step_bytes"] - offloaded["after_step_bytes"] - states < 512 * 4 * len(shapes)
    assert offloaded["optimizer_peak_bytes"] == offloaded["after_step_bytes"]  # the step runs on the host
    # rank 0's fp32 chunk of each parameter: the shard pinned by reset_sharded_param, its gradient copied to
    # the host without blocking (pinned too): each a pinned block, rounded up to a power of two by torch's
    # CachingHostAllocator; AdamW's two states, made like the shard in pageable memory, exact
    pinned = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    chunks = [4 * math.ceil(s[0] / 2) * math.prod(s[1:]) for s in shapes]
    assert offloaded["after_step_host_bytes"] == sum(2 * pinned(c) + 2 * c for c in chunks)


def test_deepspeed_offload_runs_off_cuda(plan_points, monkeypatch):
    # DeepSpeed's host buffers are told apart (vlmprobe.distributed.host_memory): only a missing DeepSpeed skips
    find_spec = options.importlib.util.find_spec  # DeepSpeed found (CI has none), every other module as before
    monkeypatch.setattr(options.importlib.util, "find_spec",
                        lambda name, *args: object() if name == "deepspeed" else find_spec(name, *args))
    (planned,) = plan_points(["model=nanovlm_tiny", *TINY, "dist=zero3", "dist.offload_optimizer=cpu",
                              "dist.offload_param=cpu", "measure.backend=estimate"])
    assert planned.skip is None


def test_world_size_and_the_dist_group_are_sweep_axes(plan_points):
    planned = plan_points(["model=nanovlm_tiny", *TINY, "dist=fsdp2", "+sweep.axes.dist.world_size=[1,2,4,8]"])
    assert [p.inputs["world_size"] for p in planned] == [1, 2, 4, 8] and {p.inputs["dist"] for p in planned} == {"fsdp2"}
    planned = plan_points(["model=nanovlm_tiny", *TINY, "+sweep.axes.dist=[none,fsdp2]"])
    assert [(p.inputs["dist"], p.inputs["world_size"]) for p in planned] == [("none", 1), ("fsdp2", 2)]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", ["world 0", "not whole nodes", "none with 2 ranks", "missing json", "not json",
                                  "stage 5", "ddp offload", "fsdp2 optimizer offload", "find", "offload param zero2",
                                  "unknown engine name", "engine name without its keys", "zero_init not a bool",
                                  "ddp bucket 0", "ddp bucket view not a bool", "an auto nobody fills",
                                  "LoRA beside a bf16 tower under zero.Init", "nvme offload"])
def test_bad_dist_input_is_one_line_naming_the_value(plan_points, tmp_path, case):
    cases = {
        "world 0": (["dist=fsdp2", "dist.world_size=0"], "dist.world_size=0 is not allowed"),
        "unknown engine name": (["dist.name=-1"], "dist.name=-1 is not allowed: choose the engine with dist=OPTION"),
        "engine name without its keys": (["dist.name=fsdp2"], "dist.name=fsdp2 is not allowed: the other dist keys"),
        "not whole nodes": (["dist=fsdp2", "dist.world_size=12"], "dist.world_size=12 is not allowed with dist.ranks_per_node=8"),
        "none with 2 ranks": (["dist.world_size=2"], "dist.world_size=2 is not allowed with dist=none"),
        "missing json": (["dist=zero3", f"dist.deepspeed_config={tmp_path}/nope.json"], "no such file"),
        "not json": (["dist=zero3", f"dist.deepspeed_config={write(tmp_path, 'a.json', '{stage: 3')}"], "not JSON"),
        "stage 5": (["dist=zero3", f"dist.deepspeed_config={write(tmp_path, 'b.json', json.dumps({'zero_optimization': {'stage': 5}}))}"],
                    "zero_optimization.stage=5, DeepSpeed's ZeRO stages are 0-3"),
        "ddp offload": (["dist=ddp", "dist.offload_optimizer=cpu"], "dist.offload_* is not allowed with dist=ddp"),
        "fsdp2 optimizer offload": (["dist=fsdp2", "dist.offload_optimizer=cpu"], "is not allowed with dist=fsdp2"),
        "find": (["dist=fsdp2", "+find=max_batch", "memory_budget=1GiB"], "dist=fsdp2 is not allowed with +find=max_batch"),
        "offload param zero2": (["dist=zero2", "dist.offload_param=cpu"], "at ZeRO stage 3 only"),
        "zero_init not a bool": (["dist=zero3", "dist.zero_init=maybe"], "dist.zero_init='maybe' is not allowed: use true"),
        "ddp bucket 0": (["dist=ddp", "dist.bucket_cap_mb=0"], "dist.bucket_cap_mb=0 is not allowed: it must be a number"),
        "ddp bucket view not a bool": (["dist=ddp", "dist.gradient_as_bucket_view=1"],
                                       "dist.gradient_as_bucket_view=1 is not allowed: use true or false"),
        "an auto nobody fills": (["dist=zero3", f"dist.deepspeed_config={write(tmp_path, 'c.json', json.dumps({'zero_optimization': {'stage': 3, 'sub_group_size': 'auto'}}))}"],
                                 'is not allowed: zero_optimization.sub_group_size: "auto" has no value'),
        "nvme offload": (["dist=zero3", f"dist.deepspeed_config={write(tmp_path, 'd.json', json.dumps({'zero_optimization': {'stage': 3, 'offload_param': {'device': 'nvme', 'nvme_path': '/nvme'}}}))}"],
                         "zero_optimization.offload_param.device='nvme': vlmprobe models offloading to the host"),
        # the real engine's failure without this line: tests/test_deepspeed.py
        "LoRA beside a bf16 tower under zero.Init": (
            ["dist=zero3", "train.lora_r=8", "train.param_dtype=bfloat16", "train.autocast_dtype=null"],
            "train.lora_r=8 is not allowed with dist=zero3 built under deepspeed.zero.Init while other weights train "
            "in bfloat16 (projector.*, vision.*, vision.blocks.*, ...): peft keeps the adapters in float32"),
    }
    overrides, message = cases[case]
    with pytest.raises(ConfigError, match=None) as raised:
        plan_points(["model=nanovlm_tiny", *TINY, "measure.backend=estimate", *overrides])
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_distributed_sweep_writes_rank_columns_ranks_csv_and_the_spread(tmp_path):
    proc = run_cli(["model=nanovlm_tiny", *TINY, "dist=fsdp2", "+sweep.axes.dist.world_size=[1,2]",
                    "measure.backend=estimate", f"results_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.glob("*/*")
    table, ranks = pd.read_csv(out / "results.csv"), pd.read_csv(out / "ranks.csv")
    assert list(table["world_size"]) == [1, 2] and set(table["dist"]) == {"fsdp2"}
    assert list(ranks.groupby("point_id").size()) == [1, 2]
    for row in table.itertuples():
        mine = ranks[ranks["point_id"] == row.point_id]
        assert row.peak_allocated_bytes == mine["peak_allocated_bytes"].max()
        assert row.min_rank_peak_allocated_bytes == mine["peak_allocated_bytes"].min()
    assert table["rank_imbalance"].iloc[1] > 1  # nanovlm_tiny's (1, 16, 32) position table: rank 1 holds no row
    assert "Per-rank spread" in (out / "summary.md").read_text()
    assert (out / "plot.png").stat().st_size > 0


def test_a_launched_rank_whose_measurement_raises_writes_its_error_row_and_leaves(tmp_path):
    """run_rank as torchrun starts it (a world of one, gloo): the exception lands in the rank's row, where the point
    row names it (before, the rank died and only the end of torchrun's stderr was kept, often without it)."""
    import socket
    import subprocess
    import sys

    from vlmprobe.point.rank import FAILED_EXIT

    request = tmp_path / "point.json"
    request.write_text(json.dumps({"measure": {"backend": "cpu"}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**__import__("os").environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    code = ("import sys; from pathlib import Path; from vlmprobe.point import rank\n"
            "def measure(point): raise RuntimeError('tracing error at step 3:\\nexpected another parameter')\n"
            "rank.measure = measure\n"
            "sys.exit(rank.run_rank(Path(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, str(request)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == FAILED_EXIT, proc.stderr[-2000:]
    row = json.loads((tmp_path / "rank0.json").read_text())
    out, _ = point_row({0: row}, 1, "cpu", {"status": "crash", "error": f"torchrun exit code {FAILED_EXIT}"})
    assert out["status"] == "error" and out["error"].startswith("rank 0: RuntimeError: tracing error at step 3:")
