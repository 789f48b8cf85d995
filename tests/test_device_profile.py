"""The target GPU (`device=`): profiles as data, what they impose on a point (capacity, dtypes), what the
estimate predicts on the card, and the CUDA worker's name check (a pure function: no GPU here)."""

import pandas as pd
import pytest

from conftest import CONF, REPO
from vlmprobe.errors import ConfigError
from vlmprobe.gpu import device_profile

MiB, GiB = 2**20, 2**30
PROFILES = sorted(p.stem for p in (CONF / "device").glob("*.yaml") if p.stem != "none")
# The memory each card is sold with (NVIDIA's spec sheets): CUDA reports less, the driver keeps some for itself
# (and ECC on the L40S), but never more, and not less than 90% of it. The B200's HBM3e is 8 stacks of 24 GiB
# (HGX B200 sells 180 GB of it a GPU, below what CUDA reports: 178.35 GiB).
NOMINAL = {"rtx3090": 24 * GiB, "rtx4090": 24 * GiB, "l40s": 48 * GiB, "v100_32gb": 32 * GiB, "a100_40gb": 40 * GiB,
           "a100_80gb": 80 * GiB, "h100_80gb": 80 * GiB, "h20": 96 * GiB, "h200": 141 * GiB, "t4": 16 * GiB,
           "a10g": 24 * GiB, "l4": 24 * GiB, "rtx_a6000": 48 * GiB, "rtx5090": 32 * GiB, "b200": 192 * GiB}
SM = {"rtx3090": (8, 6), "rtx4090": (8, 9), "l40s": (8, 9), "v100_32gb": (7, 0), "a100_40gb": (8, 0),
      "a100_80gb": (8, 0), "h100_80gb": (9, 0), "h20": (9, 0), "h200": (9, 0), "t4": (7, 5), "a10g": (8, 6),
      "l4": (8, 9), "rtx_a6000": (8, 6), "rtx5090": (12, 0), "b200": (10, 0)}  # NVIDIA's CUDA GPUs list
ISSUE_12 = {"rtx3090", "rtx4090", "v100_32gb", "a100_40gb", "a100_80gb", "h100_80gb", "h20", "h200", "l40s"}


def test_every_card_the_issue_asks_for_has_a_profile_and_every_profile_is_checked_here():
    assert ISSUE_12 <= set(PROFILES) and set(PROFILES) == set(NOMINAL) == set(SM)


@pytest.mark.parametrize("key", PROFILES)
def test_a_cards_total_memory_is_below_what_it_is_sold_with_and_above_nine_tenths_of_it(key):
    card = device_profile.load(key)
    assert 0.9 * NOMINAL[key] < card.total_memory < NOMINAL[key]


@pytest.mark.parametrize("key", PROFILES)
def test_compute_capability_bf16_and_flash_follow_the_architecture(key):
    card = device_profile.load(key)
    assert card.compute_capability == SM[key]
    ampere_or_later = SM[key] >= (8, 0)  # bf16 kernels, flash and cuDNN attention start at sm80
    assert card.bf16 == card.sdpa["flash"] == card.sdpa["cudnn"] == ampere_or_later
    assert card.sdpa["efficient"] and card.sdpa["math"]
    # check_prefer_cudnn_attention: cuDNN first on major 9 and 10 (not on sm120, the RTX 50 cards)
    assert card.sdpa["default"] == ("cudnn" if SM[key][0] in (9, 10) else "flash" if ampere_or_later else "efficient")


@pytest.mark.parametrize("key", PROFILES)
def test_the_cublas_workspace_is_torchs_default_for_the_architecture(key):
    card = device_profile.load(key)
    below_hopper = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8": two 4 MiB and eight 16 KiB chunks
    hopper = 4096 * 1024 * 8  # ":4096:8": 32 MiB
    # torch 2.13 parseChosenWorkspaceSize: 32 MiB on major 9, 10 and 12 (Hopper and Blackwell)
    assert card.cublas_workspace_bytes == (hopper if SM[key][0] in (9, 10, 12) else below_hopper)
    assert below_hopper == 8_519_680  # what pytorch#95668 found left allocated after one Linear
    assert card.cublaslt_workspace_bytes == 0  # torch 2.13 reuses the cuBLAS workspace for cuBLASLt


def test_the_estimate_predicts_reserved_plus_the_context_on_the_card():
    card = device_profile.load("rtx3090")
    assert card.cuda_context_bytes == 256 * MiB
    assert device_profile.predicted_device_bytes(1000 * MiB, card) == 1000 * MiB + 256 * MiB


@pytest.mark.parametrize("key", PROFILES)
def test_a_threads_first_matrix_multiply_allocates_the_cards_cublas_workspace_and_nothing_without_a_card(key):
    card = device_profile.load(key)
    assert device_profile.workspace_blocks(card) == (card.cublas_workspace_bytes,)  # Lt shares it (torch 2.13)
    assert device_profile.workspace_blocks(None) == ()


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100_80gb"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
                                       ("GeForce RTX 3090", "rtx3090"), ("NVIDIA H100 PCIe", None),
                                       ("Tesla T4", "t4"), ("NVIDIA B200", "b200"),
                                       ("NVIDIA GeForce RTX 5090 D", None),  # the China model, another card
                                       ("x86_64 CPU (fake tensors)", None)])
def test_the_profile_of_a_card_is_found_by_the_name_torch_gives_it(name, key):
    assert device_profile.key_of_card(name) == key


def test_a_card_without_a_known_context_takes_the_one_measured_on_the_h100_and_says_so():
    assert device_profile.predicted_device_bytes(1000 * MiB, None) is None  # no card, nothing to predict
    a100, h100 = device_profile.load("a100_80gb"), device_profile.load("h100_80gb")
    assert a100.cuda_context_bytes is None
    # the assumed context is the measured one of conf/device/h100_80gb.yaml, not a figure of its own
    assert device_profile.predicted_device_bytes(1000 * MiB, a100) == 1000 * MiB + h100.cuda_context_bytes
    assert "assumes a CUDA context of 760 MiB" in device_profile.context_note(a100)
    assert device_profile.context_note(h100) is None and device_profile.context_note(None) is None


def test_every_card_profile_yields_predicted_device_bytes():
    for path in sorted((CONF / "device").glob("*.yaml")):
        card = device_profile.load(path.stem)
        if card is not None:
            assert device_profile.predicted_device_bytes(0, card) >= 256 * MiB, path.stem


@pytest.mark.parametrize("card_dir, profile", [("nvidia-h100-80gb-hbm3", "h100_80gb"), ("nvidia-h200", "h200")])
def test_a_cards_context_is_what_its_committed_runs_held_outside_the_allocator(card_dir, profile):
    """nvidia-smi's per-process figure minus the allocator's peak reservation, in each committed run on the card
    (read after the steps; with no allocation retry the reservation still stood at its peak): the profile takes
    the largest, so predicted_device_bytes of those points is never below what NVML showed."""
    from vlmprobe.results.table import gpu_check_runs, read_table

    root = REPO / "results" / "gpu_check"
    runs = [run for run in gpu_check_runs(root) if run.relative_to(root).parts[0] == card_dir]
    assert runs
    held = []  # the process outside the allocator is the same whatever program a run measured (superseded or not)
    for run in runs:
        rows = read_table(run / "results.csv")
        rows = rows[(rows["status"] == "ok") & (rows["num_alloc_retries"] == 0)]
        held += (rows["nvml_process_bytes"] - rows["peak_reserved_bytes"]).tolist()
    card = device_profile.load(profile)
    assert card.cuda_context_bytes == max(held) and max(held) - min(held) <= 4 * MiB
    assert device_profile.predicted_device_bytes(1000 * MiB, card) == 1000 * MiB + max(held)


def test_device_memory_wins_over_the_card_and_the_card_is_the_capacity_without_it():
    card = device_profile.load("a100_80gb")
    assert device_profile.capacity(None, card) == 84_987_740_160
    assert device_profile.capacity(24 * GiB, card) == 24 * GiB
    assert device_profile.capacity(24 * GiB, None) == 24 * GiB
    assert device_profile.capacity(None, None) is None


def test_a_device_memory_above_the_card_is_refused_in_one_line():
    card = device_profile.load("rtx3090")
    device_profile.check(card.total_memory, {}, {}, "sdpa", card)  # the whole card is allowed
    with pytest.raises(ConfigError) as refused:
        device_profile.check(card.total_memory + 1, {}, {}, "sdpa", card)
    assert str(refused.value) == ("measure.device_memory=25438126081 is not allowed with device=rtx3090: the NVIDIA "
                                  "GeForce RTX 3090 has 25,438,126,080 B (23.69 GiB); give at most that, or null to "
                                  "use the card's")


@pytest.mark.parametrize("train,dist,key", [
    ({"param_dtype": "bfloat16", "autocast_dtype": None}, {}, "train.param_dtype"),
    ({"param_dtype": "float32", "autocast_dtype": "bfloat16"}, {}, "train.autocast_dtype"),
    ({"param_dtype": "float32", "autocast_dtype": None}, {"mp_param_dtype": "bfloat16"}, "dist.mp_param_dtype"),
])
def test_bfloat16_anywhere_is_refused_on_a_v100_and_allowed_on_an_a100(train, dist, key):
    with pytest.raises(ConfigError, match=f"^{key}=bfloat16 is not allowed with device=v100_32gb: the Tesla "
                                          f"V100-SXM2-32GB \\(sm70\\) has no bfloat16 kernels"):
        device_profile.check(None, train, dist, "sdpa", device_profile.load("v100_32gb"))
    device_profile.check(None, train, dist, "sdpa", device_profile.load("a100_40gb"))
    device_profile.check(None, {"param_dtype": "float16", "autocast_dtype": None}, {}, "sdpa", device_profile.load("v100_32gb"))


@pytest.mark.parametrize("real,key,same", [
    ("NVIDIA GeForce RTX 3090", "rtx3090", True),
    ("GeForce RTX 3090", "rtx3090", True),  # older drivers leave out the vendor
    ("nvidia  geforce rtx 3090", "rtx3090", True),
    ("NVIDIA GeForce RTX 3090 Ti", "rtx3090", False),
    ("NVIDIA A100-PCIE-40GB", "a100_40gb", False),  # the PCIe card is another card than the SXM4 profile
    ("NVIDIA H100 80GB HBM3", "h100_80gb", True),
    ("NVIDIA H100 PCIe", "h100_80gb", False),
])
def test_the_cuda_worker_notes_a_card_that_is_not_the_profiles(real, key, same):
    card = device_profile.load(key)
    note = device_profile.name_note(real, card)
    assert (note is None) == same
    if not same:
        assert f"device={key} is the {card.name}, but this ran on the {real}" in note
    assert device_profile.name_note(real, None) is None  # no profile, nothing to compare


@pytest.mark.parametrize("field,value,message", [
    ("compute_capability", "sm86", "device.compute_capability='sm86' is not allowed: give major.minor"),
    ("total_memory", -1, "device.total_memory=-1 is not allowed: give bytes or a size like 24GiB"),
    ("bf16", "yes", "device.bf16='yes' is not allowed: use true or false"),
    ("multiprocessors", 0, "device.multiprocessors=0 is not allowed: give a whole number of at least 1"),
    ("max_threads_per_multiprocessor", "1536", "device.max_threads_per_multiprocessor='1536' is not allowed"),
    ("cuda_context_bytes", "lots", "device.cuda_context_bytes='lots' is not allowed: give bytes"),
])
def test_a_profile_value_the_builder_refuses_is_one_line_naming_it(field, value, message):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "device" / "rtx3090.yaml"))
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        device_profile.from_config({**cfg, field: value})


def test_sizes_are_accepted_where_a_profile_takes_bytes():
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "device" / "h100_80gb.yaml"))
    card = device_profile.from_config({**cfg, "cuda_context_bytes": "512MiB"})
    assert card.cuda_context_bytes == 512 * MiB
    assert device_profile.predicted_device_bytes(0, card) == 512 * MiB


# ---- a point with a card, through the planner and the estimate (nanovlm_tiny) ----

def test_the_row_says_which_card_it_was_estimated_for_and_nothing_without_one(plan_points):
    (with_card,) = plan_points(["model=nanovlm_tiny", "device=l40s", "measure.backend=estimate"])
    (without,) = plan_points(["model=nanovlm_tiny", "measure.backend=estimate"])
    assert with_card.inputs["device"] == "l40s" and without.inputs["device"] is None


def test_a_point_past_the_cards_memory_is_oom_exactly_as_with_device_memory(point):
    from vlmprobe.point.measure import measure

    tiny = ["model=nanovlm_tiny", "measure.backend=estimate", "data.batch_size=2"]
    card = measure(point([*tiny, "device=a100_80gb", "device.total_memory=4MiB"]))
    imposed = measure(point([*tiny, "device=a100_80gb", "measure.device_memory=4MiB"]))  # same card, same workspaces
    assert card["status"] == imposed["status"] == "oom"
    assert card["imposed_capacity_bytes"] == imposed["imposed_capacity_bytes"] == 4 * MiB
    assert card["oom_segment_bytes"] == imposed["oom_segment_bytes"]
    assert card["peak_allocated_bytes"] == imposed["peak_allocated_bytes"]
    assert card.get("predicted_device_bytes") is None  # an oom row predicts nothing


def test_device_memory_below_the_card_is_the_capacity_the_point_runs_against(point):
    from vlmprobe.point.measure import measure

    row = measure(point(["model=nanovlm_tiny", "measure.backend=estimate", "device=rtx3090",
                         "measure.device_memory=4MiB"]))
    assert row["status"] == "oom" and row["imposed_capacity_bytes"] == 4 * MiB


def test_the_prediction_is_the_allocator_models_peak_reserved_plus_the_context(point, monkeypatch):
    from vlmprobe.backends.estimate import TrackerMeter
    from vlmprobe.point.measure import measure

    reserved = []
    original = TrackerMeter.reserved_peak
    monkeypatch.setattr(TrackerMeter, "reserved_peak", lambda self: reserved.append(original(self)) or reserved[-1])
    row = measure(point(["model=nanovlm_tiny", "measure.backend=estimate", "device=rtx3090"]))
    assert row["status"] == "ok" and row["imposed_capacity_bytes"] == 25_438_126_080
    # reserved comes in whole segments (2 MiB small, >= 20 MiB large) and holds at least the allocated peak
    assert reserved[-1] % (2 * MiB) == 0 and reserved[-1] >= row["peak_allocated_bytes"]
    assert row["predicted_device_bytes"] == reserved[-1] + 256 * MiB


def test_the_reserved_peak_survives_the_phase_resets():
    from vlmprobe.backends.estimate import TrackerMeter
    from vlmprobe.estimate.tracker import LiveBytesTracker

    meter = TrackerMeter(LiveBytesTracker(), None)
    allocator = meter.tracker.allocator
    big = allocator.malloc(30 * MiB)  # a 30 MiB segment
    allocator.free(big)
    meter.reset_peak()
    allocator._release_cached_blocks()  # as the allocator does before an OOM: reserved falls to 0
    meter.reset_peak()
    allocator.malloc(1024)  # a 2 MiB small segment
    assert allocator.peak_reserved == 2 * MiB
    assert meter.reserved_peak() == 30 * MiB


def test_the_summary_shows_the_prediction_in_mib_and_gib_against_the_capacity():
    from vlmprobe.results.report import on_the_card

    table = pd.DataFrame({"point_id": ["a", "b"], "device": ["rtx3090", "rtx3090"],
                          "peak_allocated_bytes": pd.array([10 * GiB, 30 * GiB], dtype="Int64"),
                          "predicted_device_bytes": pd.array([12 * GiB + 512 * MiB, None], dtype="Int64"),
                          "imposed_capacity_bytes": pd.array([25_438_126_080] * 2, dtype="Int64")})
    lines = "\n".join(on_the_card(table)).splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| a ")]
    # 10 GiB allocated; 12.5 GiB predicted; the card's 25,438,126,080 B = 23.69 GiB; 23.69 - 12.50 = 11.19 left
    assert rows == [["a", "rtx3090", "10,240.0", "12,800.0", "12.50", "23.69", "11.19"]]
    assert not any(line.startswith("| b ") for line in lines)  # no prediction (an oom row), not shown
