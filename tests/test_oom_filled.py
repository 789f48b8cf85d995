"""What filled the memory when a point ran out (the row's oom_filled): the largest groups of the blocks live at that
moment, by the module that made them, their kind and dtype (vlmprobe.estimate.tracker.Attribution). Checked against
hand counts of the tiny Qwen2-VL's logits, weights and AdamW state at a vocabulary large enough for them to lead,
against the cpu backend's real run of a step the estimate replays, and against the figures with the labels off."""

import re

import pytest
import torch
from torch import nn

from vlmprobe.estimate.tracker import LiveBytesTracker, filled_text
from vlmprobe.point.measure import measure
from vlmprobe.results.answer import verdict

from test_estimate import BYTE_COLUMNS

VOCAB, BATCH, LENGTH, HIDDEN = 16384, 2, 128, 64  # HIDDEN: qwen2_vl_tiny's text hidden size
TINY = ["model=qwen2_vl_tiny", "train.autocast_dtype=null", f"model.text.vocab_size={VOCAB}",
        f"data.batch_size={BATCH}", f"data.lm_max_length={LENGTH}"]
LOGITS = BATCH * LENGTH * VOCAB * 4  # fp32 (B, L, V): 16 MiB, whole 2 MiB pages, so its block is exactly this
TABLE = VOCAB * HIDDEN * 4  # fp32 (V, H): lm_head's weight, and the (untied) input embedding's
MiB = 2**20


def groups(row: dict) -> list[str]:
    return row["oom_filled"].split("; ")


def state_last(found: list[str]) -> bool:
    """The training state (weights, gradients, optimizer state: the row's own columns) after what the step made."""
    state = [bool(re.match(r"(\S+ )?(weights|buffers|gradients|optimizer state) ", g)) for g in found]
    return state == sorted(state)


def test_an_oom_in_the_forward_names_the_logits_of_lm_head_first_and_the_weights_last(point):
    # 50 MiB: the logits fit; the loss's log-softmax, as large, does not
    row = measure(point([*TINY, "measure.backend=estimate", "measure.device_memory=50MiB"]))
    assert row["status"] == "oom" and row["peak_phase"] == "forward" and row["oom_block_bytes"] == LOGITS
    found = groups(row)
    assert found[0] == f"fp32 activations of lm_head {LOGITS / MiB:.1f} MiB" and len(found) == 5 and state_last(found)
    assert all(g == f"fp32 weights of lm_head {TABLE / MiB:.1f} MiB" for g in found if "weights of lm_head" in g)
    # the two decoder layers' blocks make one group, not one a layer
    assert any("layers.*." in g for g in found) and not any("layers.0" in g for g in found)
    said = verdict({**row, "point_id": "p"})
    assert said.endswith(f"; largest live: {found[0]}, {found[1]}")


def test_an_oom_in_a_replayed_backward_labels_its_blocks_as_the_real_step_did(point):
    # 80 MiB: step 1 fits; step 2, with AdamW's state, runs out in its backward, which the estimate replays from
    # step 1's log; the cpu backend runs it for real
    overrides = [*TINY, "measure.device_memory=80MiB"]
    estimate = measure(point([*overrides, "measure.backend=estimate"]))
    assert estimate["status"] == "oom" and estimate["peak_phase"] == "backward"
    assert estimate["optimizer_state_bytes"] == 2 * estimate["params_bytes"]  # step 2: AdamW's m and v exist
    found = groups(estimate)
    # the loss's log-softmax saved for backward (made in the model's own forward) and its gradient
    assert found[0] == f"fp32 activations of Qwen2VLForConditionalGeneration {LOGITS / MiB:.1f} MiB"
    assert found[1] == f"fp32 activation gradients of Qwen2VLForConditionalGeneration {LOGITS / MiB:.1f} MiB"
    assert state_last(found)
    assert all(g.endswith(f" {2 * TABLE / MiB:.1f} MiB") for g in found if "optimizer state of lm_head" in g)


@pytest.mark.slow
def test_the_replayed_step_names_what_the_cpu_backends_real_step_names(point):
    overrides = [*TINY, "measure.device_memory=80MiB"]
    estimate = measure(point([*overrides, "measure.backend=estimate"]))
    cpu = measure(point([*overrides, "measure.backend=cpu"]))
    assert cpu["status"] == estimate["status"] == "oom"
    assert cpu["oom_filled"] == estimate["oom_filled"]


def test_the_labels_change_no_figure_and_an_ok_row_has_none(point):
    base = [*TINY, "data.lm_max_length=64", "measure.backend=estimate"]
    labelled = measure(point([*base, "measure.device_memory=1GiB"]))  # a capacity: every block labelled
    plain = measure(point(base))
    assert labelled["status"] == plain["status"] == "ok" and labelled.get("oom_filled") is None
    assert {k: labelled[k] for k in BYTE_COLUMNS} == {k: plain[k] for k in BYTE_COLUMNS}
    assert labelled["timeline"] == plain["timeline"]


def test_every_live_byte_is_in_one_group_and_a_tensor_made_outside_a_module_has_none():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1024))
    with LiveBytesTracker(capacity=4 * MiB) as tracker:  # small blocks share 2 MiB segments; 2 MiB needs 20 MiB
        attribution = tracker.attribute()
        model = model.to_empty(device="cpu")
        attribution.watch(model)
        attribution.enter_phase("forward")
        x = torch.empty(512, 64)  # 128 KiB, outside any module
        hidden = model[0](x)  # 256 KiB: activations of "0"
        with pytest.raises(torch.OutOfMemoryError):
            model(x)  # "0" again, freed once "1" has its output (256 KiB); then "2"'s 2 MiB output does not fit
        everything = attribution.filled(tracker, top=100)
    # by hand: weights 64 x 128 + 128 and 128 x 1024 + 1024 fp32 (each block rounded up to 512 B); x; two outputs
    weights_0, weights_2 = 64 * 128 * 4 + 512, 128 * 1024 * 4 + 1024 * 4
    assert sum(size for *_, size in everything) == weights_0 + weights_2 + 128 * 1024 + 2 * 256 * 1024
    assert filled_text(everything) == ("fp32 activations of 0 256.0 KiB; fp32 activations of 1 256.0 KiB; "
                                       "fp32 activations 128.0 KiB; fp32 weights of 2 516.0 KiB; "
                                       "fp32 weights of 0 32.5 KiB")
    del hidden
