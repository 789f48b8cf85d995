"""flash_attention_2 on the estimate backend: the stand-in kernel allocates what flash-attn 2.8's CUDA code
allocates (hand counts of the shapes in csrc/flash_attn/flash_api.cpp and flash_attn_interface.py), and
transformers' own flash path reaches it."""

import collections
import functools

import pytest
import torch

from vlmprobe import backends
from vlmprobe.errors import ConfigError
from vlmprobe.estimate.cuda_rules import flash_attn_standin
from vlmprobe.estimate.cuda_rules.flash_attn_standin import flash_attn_func, flash_attn_varlen_func
from vlmprobe.point.measure import measure

BF16, FP32, I64 = 2, 4, 8


def blocks(*sizes: int) -> int:
    """Bytes the caching allocator hands out for these requests: each rounded up to 512."""
    return sum(-(-size // 512) * 512 for size in sizes)


def live_and_backward_peak(make_inputs, call):
    """(bytes the forward leaves live, the backward's peak above what was live before it) on the estimate
    backend, for `call(*inputs)` on fake bf16 inputs that require grad."""
    with backends.get("estimate").session(None) as meter:
        inputs = make_inputs()
        before = meter.current()
        out = call(*inputs)
        saved = meter.current() - before
        dout = torch.empty_like(out)
        meter.reset_peak()
        start = meter.current()
        out.backward(dout)
        return saved, meter.peaks()["allocated"] - start


def leaves(*shapes):
    return lambda: [torch.empty(*shape, dtype=torch.bfloat16, requires_grad=True) for shape in shapes]


def test_batched_grouped_query_attention_allocates_what_mha_fwd_and_mha_bwd_do():
    b, s, h, hk, d = 2, 200, 8, 2, 64
    saved, peak = live_and_backward_peak(leaves((b, s, h, d), (b, s, hk, d), (b, s, hk, d)),
                                         functools.partial(flash_attn_func, causal=True))
    # mha_fwd: out like q, softmax_lse fp32 (b, h, s), rng_state int64 (2,); all three saved for backward
    assert saved == blocks(b * s * h * d * BF16, b * h * s * FP32, 2 * I64)
    s_rounded = 256  # round_multiple(200, 128)
    # backward: dq, dk, dv like q, k, v; mha_bwd: softmax_d fp32 (b, h, s_rounded), dq_accum fp32
    # (b, s_rounded, h, round_multiple(64, 32)), and dk / dv expanded to h heads (GQA)
    assert peak == blocks(b * s * h * d * BF16, b * s * hk * d * BF16, b * s * hk * d * BF16,
                          b * h * s_rounded * FP32, b * s_rounded * h * 64 * FP32,
                          b * s * h * d * BF16, b * s * h * d * BF16)


def test_varlen_attention_keeps_unpadded_softmax_stats_and_pads_its_accumulator_by_128_rows_per_sequence():
    total, h, d, sequences = 300, 4, 80, 3
    cu_seqlens = torch.tensor([0, 100, 250, 300], dtype=torch.int32)
    saved, peak = live_and_backward_peak(leaves((total, h, d), (total, h, d), (total, h, d)),
                                         lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 150, 150))
    # mha_varlen_fwd: softmax_lse is (h, total_q)
    assert saved == blocks(total * h * d * BF16, h * total * FP32, 2 * I64)
    # mha_varlen_bwd: softmax_d (h, total + 128 b), dq_accum (total + 128 b, h, round_multiple(80, 32) = 96)
    assert peak == blocks(*[total * h * d * BF16] * 3, h * (total + 128 * sequences) * FP32,
                          (total + 128 * sequences) * h * 96 * FP32)


def test_a_head_size_off_a_multiple_of_8_is_padded_and_the_padded_inputs_are_saved():
    b, s, h, d = 1, 64, 2, 20  # padded to 24
    saved, _ = live_and_backward_peak(leaves((b, s, h, d), (b, s, h, d), (b, s, h, d)), flash_attn_func)
    # F.pad copies of q, k, v (saved, as FlashAttnFunc saves its padded inputs), out padded, lse, rng_state
    assert saved == blocks(*[b * s * h * 24 * BF16] * 4, b * h * s * FP32, 2 * I64)


def test_without_grad_only_the_output_outlives_the_call():
    with backends.get("estimate").session(None) as meter, torch.no_grad():
        q = torch.empty(2, 128, 4, 64, dtype=torch.bfloat16)
        before = meter.current()
        out = flash_attn_func(q, q, q)
        assert meter.current() - before == blocks(2 * 128 * 4 * 64 * BF16)
        assert out.shape == q.shape


def test_fp32_inputs_fail_as_flash_attn_fails_on_them():
    q = torch.empty(1, 8, 2, 64)
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16 data type"):
        flash_attn_func(q, q, q)


def test_the_qwen2_5_vl_vision_tower_makes_one_varlen_call_per_block_under_flash_attention_2(point, monkeypatch):
    """transformers' own flash path runs: the vision tower's blocks each make one varlen call over
    `cu_seqlens` (sdpa makes one call per window), the LM layers one batched call each."""
    calls = collections.Counter()
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        kernel = getattr(flash_attn_standin, name)
        counted = functools.wraps(kernel)(lambda *a, _k=kernel, _n=name, **kw: calls.update([_n]) or _k(*a, **kw))
        monkeypatch.setattr(flash_attn_standin, name, counted)
    row = measure(point(["model=qwen2_5_vl_tiny", "model.attn_implementation=flash_attention_2",
                         "measure.backend=estimate", "measure.steps=1", "data.lm_max_length=64"]))
    assert row["status"] == "ok", row.get("error")
    assert calls == {"flash_attn_varlen_func": 2, "flash_attn_func": 2}  # vision depth 2, LM 2 layers


def test_flash_attention_2_is_refused_where_it_cannot_run(plan_points):
    with pytest.raises(ConfigError, match="^model.attn_implementation=flash_attention_2 is not allowed with "
                                          "model=mllama_tiny: transformers' MllamaForConditionalGeneration has no "
                                          "flash attention path; use sdpa or eager$"):
        plan_points(["model=mllama_tiny", "model.attn_implementation=flash_attention_2", "measure.backend=estimate"])
    with pytest.raises(ConfigError, match="^model.attn_implementation=flash_attention_2 is not allowed with "
                                          "device=v100_32gb: FlashAttention 2 runs on sm80 and newer, the Tesla "
                                          "V100-SXM2-32GB is sm70; use sdpa$"):
        plan_points(["model=qwen2_vl_tiny", "model.attn_implementation=flash_attention_2", "device=v100_32gb",
                     "train.autocast_dtype=float16"])


def test_grpo_generation_runs_unpadded_under_flash_attention_2(point):
    """generate() passes an all-ones mask; a real run reads it, drops it and runs flash attention unpadded.
    A fake mask must get the same answer, or every layer would unpad (nonzero), which fake tensors refuse."""
    row = measure(point(["model=qwen2_5_vl_tiny", "step=grpo", "data.lm_max_length=40", "data.batch_size=4",
                         "step.max_completion_length=16", "measure.steps=1", "measure.backend=estimate",
                         "model.attn_implementation=flash_attention_2", "train.param_dtype=bfloat16",
                         "train.autocast_dtype=null"]))
    assert row["status"] == "ok", row.get("error")
    assert row["generate_peak_bytes"] > 0 and row["peak_phase"]
