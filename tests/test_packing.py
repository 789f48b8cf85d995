"""data.packing: the micro batch's samples as one row, positions restarting per sample (vlmprobe/models/packing.py).
The packed batches against hand constructions and the model's own get_rope_index per sample (ms-swift's rule), the
model keeping the samples apart (packed logits == per-sample logits), estimate == cpu to the byte with the
(1, 1, N, N) block mask sdpa builds, flash attention's varlen calls, and the refusals."""

import collections
import functools
import re

import pytest
import torch

from vlmprobe.errors import ConfigError
from vlmprobe.estimate.cuda_rules import flash_attn_standin
from vlmprobe.models.base import IGNORE_INDEX, DataShape
from vlmprobe.point.measure import measure

CPU = torch.device("cpu")
BYTE_COLUMNS = ("peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
                "after_load_bytes", "after_step_bytes", "activations_bytes", "peak_reserved_bytes")


def frees_sorted(events: list[str]) -> list[str]:
    """allocator_events with each run of frees between two requests in one order: the garbage of one Python
    statement is freed in an order of the interpreter's, and the allocator's state after the run is the same."""
    out, frees = [], []
    for event in events:
        if event[0] == "-":
            frees.append(event)
            continue
        out += [*sorted(frees), event]
        frees = []
    return out + sorted(frees)


def hand_block_mask(samples: int, length: int) -> torch.Tensor:
    """(1, 1, N, N) causal mask of `samples` sequences of `length` tokens end to end: each attends to its own past."""
    return torch.block_diag(*[torch.ones(length, length).tril()] * samples).bool()[None, None]


@pytest.mark.parametrize("family", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_packed_qwen_batch_is_one_row_of_each_samples_own_rope_index_under_a_text_row(spec, family):
    tiny = spec(family)
    model = tiny.build("cpu", torch.float32)
    samples, length = 3, 50
    rows = tiny.batch(DataShape(samples, length, images_per_sample=2), CPU)
    packed = tiny.batch(DataShape(samples, length, images_per_sample=2, packing=True), CPU)
    n = samples * length
    for key in ("input_ids", "labels", "mm_token_type_ids"):
        assert packed[key].shape == (1, n) and torch.equal(packed[key], rows[key].reshape(1, n)), key
    for key in ("image_grid_thw", "pixel_values"):  # the images are the micro batch's, in order
        assert packed[key].shape == rows[key].shape, key
    assert torch.equal(packed["image_grid_thw"], rows["image_grid_thw"])
    # ms-swift 4.6.0 (Qwen2VLTemplate.packing_row): each sample's get_rope_index alone, a text row 0..L-1 on top,
    # the (4, 1, L) pieces end to end
    pieces = []
    for i in range(samples):
        ids, types = rows["input_ids"][i:i + 1], rows["mm_token_type_ids"][i:i + 1]
        rope, _ = model.model.get_rope_index(ids, types, rows["image_grid_thw"][2 * i:2 * i + 2])
        pieces.append(torch.cat([torch.arange(length).view(1, 1, length), rope]))
    assert packed["position_ids"].shape == (4, 1, n)
    assert torch.equal(packed["position_ids"], torch.cat(pieces, dim=-1))
    assert packed["position_ids"][0, 0].tolist() == list(range(length)) * samples  # hand: restarting per sample


def test_packed_internvl_batch_is_one_row_with_positions_restarting_per_sample(spec):
    tiny = spec("internvl_tiny")
    samples, length = 3, 40
    rows = tiny.batch(DataShape(samples, length, image_size=112), CPU)
    packed = tiny.batch(DataShape(samples, length, image_size=112, packing=True), CPU)
    n = samples * length
    assert set(packed) == {*rows, "position_ids"}
    for key in ("input_ids", "labels"):
        assert packed[key].shape == (1, n) and torch.equal(packed[key], rows[key].reshape(1, n)), key
    assert packed["pixel_values"].shape == rows["pixel_values"].shape  # 5 tiles (2 x 2 + thumbnail) a sample
    assert packed["position_ids"].tolist() == [list(range(length)) * samples]
    prompt = 1 + 5 * 4 + 1  # <img>, 4 tokens a tile, </img>: not learned in any sample
    labels = packed["labels"].view(samples, length)
    assert (labels[:, :prompt] == IGNORE_INDEX).all() and (labels[:, prompt:] != IGNORE_INDEX).all()


@pytest.mark.parametrize("family,attention", [("qwen2_vl_tiny", "sdpa"), ("qwen2_5_vl_tiny", "sdpa"),
                                              ("internvl_tiny", "eager")])
def test_the_model_keeps_packed_samples_apart(spec, family, attention):
    """transformers attends per sample from the positions alone: the packed row's logits are each sample's own."""
    tiny = spec(family, f"model.attn_implementation={attention}")
    torch.manual_seed(0)
    model = tiny.build("cpu", torch.float32).eval()
    rows, packed = tiny.batch(DataShape(2, 48), CPU), tiny.batch(DataShape(2, 48, packing=True), CPU)
    packed["pixel_values"] = rows["pixel_values"]  # the same images
    with torch.no_grad():
        apart = model(**rows, attention_mask=None, use_cache=False).logits
        together = model(**packed, attention_mask=None, use_cache=False).logits
    torch.testing.assert_close(together, apart.reshape(1, 96, -1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl_tiny", "internvl_tiny"])
def test_packed_sdpa_point_estimates_the_cpu_backend_to_the_byte_holding_the_n_by_n_block_mask(
        point, allocator_events, monkeypatch, family):
    """sdpa: create_causal_mask finds the samples (find_packed_sequence_indices) and builds a (1, 1, N, N) boolean
    block-diagonal causal mask over the whole row, N = batch x length: N^2 bytes, here 128^2 = 16 KiB (a multiple
    of the allocator's 512 B blocks). The fake bookkeeping makes every request of the real run, in its order."""
    from transformers import masking_utils

    masks = []
    sdpa_mask = masking_utils.AttentionMaskInterface._global_mapping["sdpa"]
    monkeypatch.setitem(masking_utils.AttentionMaskInterface._global_mapping, "sdpa",
                        lambda **kwargs: masks.append(sdpa_mask(**kwargs)) or masks[-1])
    base = [f"model={family}", "data.batch_size=2", "data.lm_max_length=64", "data.packing=true", "measure.steps=1"]
    cpu = measure(point(base + ["measure.backend=cpu"]))
    cpu_events = list(allocator_events)
    allocator_events.clear()
    estimate = measure(point(base + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok", (cpu.get("error"), estimate.get("error"))
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}
    assert frees_sorted(allocator_events) == frees_sorted(cpu_events)
    real, fake = masks  # one LM forward on each backend
    assert torch.equal(real, hand_block_mask(2, 64))
    assert fake.shape == (1, 1, 128, 128) and fake.dtype == torch.bool
    assert "+16384" in cpu_events


def test_a_packed_sdpa_row_costs_the_hand_counted_mask_and_repeated_kv_in_every_layer(point):
    """The step's peak (in backward) above the same samples as rows, by hand: in each LM layer SDPA keeps an
    additive copy of the (1, 1, N, N) mask in bf16 for backward, and K and V repeated from 2 to 4 heads
    (transformers' use_gqa_in_sdpa: no grouped-query SDPA with a mask; rows run is_causal without one); the batch
    holds the positions' text row besides. qwen2_vl_tiny: 2 LM layers, 4 heads, 2 KV heads, head_dim 16."""
    base = ["model=qwen2_vl_tiny", "device=h100_80gb", "data.batch_size=2", "data.lm_max_length=256",
            "train.param_dtype=bfloat16", "train.autocast_dtype=null", "measure.backend=estimate", "measure.steps=1"]
    rows, packed = (measure(point(base + [f"data.packing={p}"])) for p in ("false", "true"))
    assert rows["status"] == packed["status"] == "ok"
    n, bf16, layers, heads, kv_heads, head_dim = 512, 2, 2, 4, 2, 16
    per_layer = n * n * bf16 + 2 * n * (heads - kv_heads) * head_dim * bf16
    assert packed["peak_allocated_bytes"] - rows["peak_allocated_bytes"] == layers * per_layer + n * 8


def test_packed_flash_attention_2_runs_the_varlen_kernel_on_each_samples_bounds(point, monkeypatch):
    """flash_attention_2 (the estimate's stand-in; the cpu backend has no flash kernel): every LM layer reads the
    positions, derives cu_seqlens [0, L, 2L, ..., N] and max_seqlen L, and makes one varlen call over the row; the
    vision tower's own varlen calls are per image as before."""
    calls = collections.defaultdict(list)
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        kernel = getattr(flash_attn_standin, name)

        @functools.wraps(kernel)
        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            bounds = kwargs.get("cu_seqlens_q")
            calls[_name].append((args[0].shape, None if bounds is None else bounds.tolist(),
                                 None if bounds is None else int(kwargs["max_seqlen_q"])))
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(flash_attn_standin, name, counted)
    row = measure(point(["model=qwen2_vl_tiny", "model.attn_implementation=flash_attention_2", "data.batch_size=3",
                         "data.lm_max_length=40", "data.packing=true", "train.autocast_dtype=bfloat16",
                         "measure.backend=estimate", "measure.steps=1"]))
    assert row["status"] == "ok", row.get("error")
    assert "flash_attn_func" not in calls  # nothing attends over the whole row
    lm = [call for call in calls["flash_attn_varlen_func"] if call[0][1:] == (4, 16)]  # 4 LM heads, 2 vision heads
    assert lm == [((120, 4, 16), [0, 40, 80, 120], 40)] * 2  # 2 LM layers


def test_packing_false_leaves_the_batch_as_it_was(spec):
    tiny = spec("qwen2_vl_tiny")
    default, off = (tiny.batch(data, CPU) for data in (DataShape(2, 40), DataShape(2, 40, packing=False)))
    assert default.keys() == off.keys()
    for key in default:
        assert default[key].shape == off[key].shape and default[key].dtype == off[key].dtype, key
    assert off["input_ids"].shape == (2, 40) and off["position_ids"].shape == (3, 2, 40)


@pytest.mark.parametrize("overrides,message", [
    (["model=llava_tiny"], "data.packing=true is not allowed for llava_tiny: packed batches are modelled for "
                           "Qwen2-VL, Qwen2.5-VL and InternVL (qwen2_vl_*, qwen2_5_vl_*, internvl*, hf); use false"),
    (["model=qwen3_vl_tiny"], "data.packing=true is not allowed for qwen3_vl_tiny: packed batches are modelled"),
    (["model=qwen2_vl_tiny", "model.attn_implementation=flex_attention"],
     "model.attn_implementation='flex_attention' is not allowed with data.packing=true: packed samples are kept "
     "apart (and modelled) under sdpa, eager, flash_attention_2; use one of those"),
    (["model=qwen2_vl_tiny", "step=dpo"], "data.packing=true is not allowed with step=dpo: packed batches are modelled "
                                          "for step=sft; use data.packing=false"),
])
def test_packing_is_refused_where_it_is_not_modelled(plan_points, overrides, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        plan_points([*overrides, "data.packing=true", "measure.backend=estimate"])


def test_packing_must_be_true_or_false(plan_points):
    with pytest.raises(ConfigError, match="^data.packing='yes' is not allowed: use true or false$"):
        plan_points(["model=qwen2_vl_tiny", "data.packing=yes"])
