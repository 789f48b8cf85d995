"""The estimate against the CUDA measurements committed under results/gpu_check/ (real runs, each on the card its
env.json names): every point of each nightly sweep a GPU check measured, estimated for that card as
scripts/check_estimate.py --cuda-dir does, is within TOLERANCE of its measured peak allocated
(max_memory_allocated) and peak reserved (max_memory_reserved) bytes, with the same status. A run whose directory
holds SUPERSEDED.md measured a program the code no longer runs (the file says what changed): it is not a
measurement of what the estimate runs today, and is skipped with that reason."""

import pandas as pd
import pytest

from conftest import REPO, load_script, requested
from vlmprobe.results.table import gpu_check_runs, superseded

CUDA_RUNS = gpu_check_runs(REPO / "results" / "gpu_check") + gpu_check_runs(REPO / "results" / "gpu_check", part="allocator")
TOLERANCE = 0.5  # percent
# Known reserved-memory gaps, (card, point) -> the measured gap in percent, open (issue 12). No CUDA trace of this
# point was recorded; at the two that were (batch 1 and 8 at 512) the estimate is within 0.1 %. Each stays beyond
# TOLERANCE or the test says to drop it.
RESERVED_GAPS = {("nvidia-h200", "data.batch_size=16,data.lm_max_length=128"): -0.53}  # two 20 MiB segments



def _recorded() -> list[tuple]:
    """(requests CSV, point_id, the estimate's overrides) of each point a GPU check recorded on the default allocator
    settings: what each run asked the allocator for (results/gpu_check/<card>/<stamp>/<part>_requests.csv, from its
    snapshots by scripts/check_allocator.py --requests-csv), and the command of that part (the env.json of its results
    dir, <part>/<sweep>/<stamp>/) as an estimate, as scripts/check_estimate.py --cuda-dir makes it."""
    import json

    found = []
    for path in sorted((REPO / "results" / "gpu_check").glob("*/*/*_requests.csv")):
        part = path.name.removesuffix("_requests.csv")
        (env,) = [json.loads(p.read_text()) for p in path.parent.glob(f"{part}/*/*/env.json")]
        overrides = load_script("check_estimate").estimate_overrides(env)
        found += [(path, point_id, overrides) for point_id in sorted(set(pd.read_csv(path)["point_id"]))
                  if "measure.alloc_conf=" not in point_id or point_id.endswith("measure.alloc_conf=null")]
    return found


RECORDED = _recorded()
# The allocations a kernel makes for itself that the estimate does not model, as the recorded runs of batch 1 and 8 at
# 512 on the H200 (torch 2.11) made them: size (bytes) -> how many times in its two steps. Which kernel makes each is
# read from the trace's order and sizes against PyTorch's sources, not confirmed on a GPU. Before they were modelled,
# reductions' staging buffers (vlmprobe.estimate.cuda_rules.reduction_staging) were 220 buffers and their 220 semaphores of batch
# 8's, cuDNN attention's seeds, offsets and workspaces (vlmprobe.estimate.cuda_rules.attention_scratch) 168 + 84 + 84 of each,
# the embedding backward's index and partial-sum buffers (vlmprobe.estimate.cuda_rules.embedding_backward) 22 of batch 8's, and
# max()'s copy of the positions expanded over the batch and advanced indexing's copies of the image rows
# (vlmprobe.estimate.cuda_rules.kernel_copies) 2 and 6.
KERNEL_SCRATCH = {("nvidia-h200", "data.batch_size=1,data.lm_max_length=512,measure.alloc_conf=null"): {
    4249616: 2, 4249744: 2,  # cuDNN's convolution workspaces (forward, backward): its chosen algorithm's, once a step
    1048576: 1,  # torch 2.11's cuBLASLt workspace, one a process (2.13 shares cuBLAS's: conf/device/h200.yaml)
    8: 1,  # an 8 B block of the build: the frames say LM.__init__'s rotary inv_freq (arange, pow), not placed further
}, ("nvidia-h200", "data.batch_size=8,data.lm_max_length=512,measure.alloc_conf=null"): {
    11976720: 4,  # cuDNN's convolution workspaces, forward and backward, this batch's algorithm's
    1048576: 1,  # cuBLASLt's workspace
    8: 1,  # the same 8 B block of the build as batch 1's
    83455: 2, 1279: 4,  # cub's temporary storage in the embedding backward's sort, unique-by-key and scan
}}


def test_there_are_cuda_measurements_to_judge_the_estimate_by():
    assert [run for run in CUDA_RUNS if not superseded(run)], \
        "no results/gpu_check/<card>/<stamp>/nightly/<sweep>/<stamp>/results.csv of a program the code runs today"


def one_run_a_card_fast(runs: list) -> list:
    """The first measured run of each card in the fast suite, the others with the slow tests (all of them also in
    scripts/check_estimate.py --parts cuda)."""
    first: dict = {}
    return [run if first.setdefault(run.parents[3].name, run) is run else pytest.param(run, marks=pytest.mark.slow)
            for run in runs]


@pytest.mark.parametrize("run", one_run_a_card_fast(CUDA_RUNS), ids=lambda p: f"{p.parents[3].name}/{p.parent.name}")
def test_the_estimate_for_the_card_is_within_half_a_percent_of_every_measured_peak(run, tmp_path):
    if note := superseded(run):
        pytest.skip(note.split(". ")[0])
    table, _ = load_script("check_estimate").against(run, tmp_path)  # (points, steps: none in these runs)
    assert len(table) and (table["status_cuda"] == table["status_estimate"]).all()
    assert table["rel_error_%"].abs().max() <= TOLERANCE, table.to_string()
    card = run.parents[3].name
    gaps = {p: RESERVED_GAPS[(card, p)] for p in table["point_id"] if (card, p) in RESERVED_GAPS}
    known = table["point_id"].isin(gaps)
    assert table.loc[~known, "reserved rel_error_%"].abs().max() <= TOLERANCE, table.to_string()
    for point, error in zip(table.loc[known, "point_id"], table.loc[known, "reserved rel_error_%"]):
        assert abs(error) > TOLERANCE, f"{card} {point}: reserved now within {TOLERANCE}% ({error}): drop its gap"
        assert error == pytest.approx(gaps[point], abs=0.05), (point, error)


@pytest.mark.parametrize("ran, card, estimated", [
    (["+sweep=seq_len"], "NVIDIA H100 80GB HBM3", ["+sweep=seq_len", "device=h100_80gb"]),
    (["+sweep=x", "device=none", "measure.backend=cuda"], "NVIDIA H100 80GB HBM3", ["+sweep=x", "device=h100_80gb"]),
    (["+sweep=x", "device=a100_80gb"], "NVIDIA H100 80GB HBM3", ["+sweep=x", "device=a100_80gb"]),  # its own choice
    (["+sweep=x", "results_dir=/tmp/r"], "NVIDIA B200", ["+sweep=x", "device=b200"]),
    (["+sweep=x", "results_dir=/tmp/r"], "NVIDIA H100 PCIe", ["+sweep=x"]),  # no profile is that card's
])
def test_a_cuda_run_that_named_no_card_is_estimated_for_the_card_it_ran_on(ran, card, estimated):
    overrides = load_script("check_estimate").estimate_overrides({"overrides": ran, "device_name": card})
    assert overrides == [*estimated, "measure.backend=estimate"]


def _estimate_requests(point_id: str, overrides: list[str], plan_points, events: list[str]) -> dict[int, int]:
    """How many times the estimate of that point of the command `overrides` asks its allocator model for each size
    (`events`: the allocator_events fixture)."""
    from collections import Counter

    from vlmprobe.point.measure import measure

    (planned,) = [p for p in plan_points(overrides) if p.point.id == point_id]
    outputs = measure(planned.config)
    assert outputs["status"] == "ok", outputs.get("error")
    return Counter(requested(events))


@pytest.mark.parametrize("recorded, point_id, overrides", RECORDED,
                         ids=[f"{p.parents[1].name}/{p.name.removesuffix('_requests.csv')}/{i}" for p, i, _ in RECORDED])
def test_the_estimate_asks_for_no_allocation_the_recorded_cuda_run_did_not(recorded, point_id, overrides, plan_points,
                                                                             allocator_events):
    """Size by size, the estimate's allocations are among the CUDA run's: each as often or less (what CUDA's kernels
    make for themselves). Before the engine's gradient sums were charged in place the estimate asked for 422 more
    blocks of the LM's residual gradient and a second tied-embedding gradient than the run did."""
    table = pd.read_csv(recorded)
    cuda = dict(table.loc[table["point_id"] == point_id, ["size_bytes", "count"]].itertuples(index=False))
    estimate = _estimate_requests(point_id, overrides, plan_points, allocator_events)
    more = {size: (count, cuda.get(size, 0)) for size, count in estimate.items() if count > cuda.get(size, 0)}
    assert not more, f"sizes the estimate asks for more often than CUDA (estimate, cuda): {more}"
    card = recorded.parents[1].name
    if (card, point_id) in KERNEL_SCRATCH:
        fewer = {size: count - estimate.get(size, 0) for size, count in cuda.items() if count > estimate.get(size, 0)}
        assert fewer == KERNEL_SCRATCH[(card, point_id)]
