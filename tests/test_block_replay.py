"""The estimate replays a tower's middle blocks from its first block's allocations in forward and its last block's in
backward (vlmprobe.estimate.replay.blocks). Checked against the cpu backend's real tensors, which run every block."""

import pytest
import torch

from vlmprobe.estimate.replay import blocks as block_replay
from vlmprobe.knobs import apply_knobs
from vlmprobe.models.nanovlm import NanoVLMSpec
from vlmprobe.point import measure as measure_module
from vlmprobe.point.build import build_spec
from vlmprobe.point.measure import measure

from test_estimate import BYTE_COLUMNS

# nanovlm_tiny with 3 vision and 4 LM blocks: 1 and 2 blocks replayed (the first and the last of each run)
TOWERS = ["model=nanovlm_tiny", "model.vision.num_hidden_layers=3", "model.text.num_hidden_layers=4",
          "data.batch_size=2", "data.lm_max_length=48"]


@pytest.fixture
def replayed(monkeypatch):
    """How many blocks each point replayed (forward), and whether any point was measured again without."""
    counts = {"blocks": 0, "again": 0}
    forward = block_replay._Ticket.forward
    run = measure_module.measure_once

    def spy_forward(self, x):
        counts["blocks"] += 1
        return forward(self, x)

    def spy_measure(point, replay_blocks):
        counts["again"] += not replay_blocks
        return run(point, replay_blocks)

    monkeypatch.setattr(block_replay._Ticket, "forward", spy_forward)
    monkeypatch.setattr(measure_module, "measure_once", spy_measure)
    return counts


@pytest.mark.parametrize("knobs", [[], ["train.grad_ckpt.lm=true", "train.grad_ckpt.vision=true"],
                                   ["train.freeze_vision=true"], ["train.freeze_lm=true"], ["train.lora_r=4"],
                                   ["train.param_dtype=bfloat16", "train.autocast_dtype=null"],
                                   ["train.autocast_dtype=float16", "model.attn_implementation=eager"],
                                   ["measure.hold_outputs=false", "measure.steps=3"],
                                   ["measure.alloc_conf=expandable_segments:True"],
                                   ["device=rtx3090"]])  # the forward's workspace is made in the first block
def test_replayed_blocks_give_the_cpu_backends_figures(point, replayed, knobs):
    cpu = measure(point(TOWERS + knobs + ["measure.backend=cpu"]))
    estimate = measure(point(TOWERS + knobs + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok"
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}
    # the blocks were replayed, not quietly run: 1 vision block and 2 LM blocks, with nothing measured again
    assert replayed == {"blocks": 3, "again": 0}


def test_blocks_that_do_not_repeat_the_first_are_measured_again_with_every_block_run(point, replayed, monkeypatch):
    # the LM's blocks handed over in reverse: called in another order than the one given, so no replay can stand
    monkeypatch.setattr(NanoVLMSpec, "repeated_blocks", lambda self, model: [list(model.lm.blocks)[::-1]])
    cpu = measure(point(TOWERS + ["measure.backend=cpu"]))
    estimate = measure(point(TOWERS + ["measure.backend=estimate"]))
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}
    assert replayed["again"] == 1


def tiny_blocks(point, *knobs):
    config = point(TOWERS + list(knobs))
    spec = build_spec(config["model"])
    model = spec.build(torch.device("meta"), torch.float32, init=False)
    apply_knobs(spec, model, config["train"])
    return list(model.lm.blocks)


def test_a_tower_is_replayed_only_where_its_blocks_match_module_by_module(point):
    tracker = object()  # the check needs none
    replay = block_replay.BlockReplay.__new__(block_replay.BlockReplay)
    replay.tracker, replay.problems = tracker, []
    assert block_replay._Tower(replay, tiny_blocks(point)).usable
    assert block_replay._Tower(replay, tiny_blocks(point, "train.lora_r=4")).usable  # peft's layers alike too
    hooked = tiny_blocks(point)
    hooked[2].norm1.register_forward_hook(lambda *args: None)  # a hook could do anything: not replayed
    assert not block_replay._Tower(replay, hooked).usable
    other = tiny_blocks(point)
    other[1].heads = 1  # a setting of one block's own
    assert not block_replay._Tower(replay, other).usable
    shared = tiny_blocks(point)
    shared[3].q_proj.weight = shared[0].q_proj.weight  # a parameter two blocks share
    assert not block_replay._Tower(replay, shared).usable
