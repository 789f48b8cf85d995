#!/usr/bin/env python
"""What one more sample costs at the peak of nanoVLM issue #103's setup: a hand count, family by family,
against the estimate and the published RTX 3090 slope.

The step's peak (at batch 8 and 16, both lengths) is its first backward op, nll_loss_backward: every tensor
the forward saved for backward is alive, with the logits measure_vram.py holds in `_`, the fp32 copy of the
log-probabilities nll_loss saved and the fp32 gradient it is writing. `hand_count` lists what one sample adds
to that moment, tensor family by tensor family, from the model's dimensions and the source of each saved
tensor (PyTorch's derivatives.yaml and CUDA's autocast lists, read for torch 2.13). The estimate backend runs
batch 8 and 16 of `+sweep=seq_len`; per sample = (batch 16 - batch 8) / 8 of:
  - requested: the allocator model's peak of requested bytes (tensor sizes, no block rounding);
  - allocated: its peak allocated bytes (block sizes, what max_memory_allocated reports);
beside the published slope over the same batches. hand == requested says the estimate charges exactly these
families and nothing else; published - requested is what CUDA allocated per sample beyond them (with block
rounding, which the allocator model makes for its own allocation sequence only).

    python scripts/check_per_sample.py [--lengths 128,512]

What was found (2026-11-23, backend estimate, no GPU). The estimate charges exactly the families of the hand
count and nothing else (`tests/test_per_sample.py` checks it to the byte on nanovlm_tiny); its allocated slope
is lower than its requested one because its allocator model's block rounding (allocated − requested at the peak)
falls from 135/155 MiB at batch 8 to 100/92 MiB at batch 16. What CUDA adds beyond them, ~10 MiB a sample at 128
and ~37 at 512 (about 0.071 MiB a token plus ~1 MiB), is no saved tensor we could find in PyTorch's sources.
Ruled out, bytes per sample at 128 / 512: flash (ViT) and memory-efficient (LM) attention keep output +
logsumexp as the CPU kernel does (logsumexp padded to 32 rows: none at these lengths; the (B,1,1,L) mask is
8-aligned, so expanded without a copy; the philox seed/offset are CPU scalars without dropout): 0 / 0; the math
kernel's attention weights (30 × 9 × L² × 2 B): 8.4 / 135, far too many; cross-entropy: `cross_entropy` hands
the logits' dtype to `log_softmax`, so it stays bf16 and nll_loss saves an fp32 cast, as the estimate has it (an
fp32 log_softmax instead would change −2 B per logit, not add); autocast's weight casts are per step, not per
sample; LayerNorm mean/rstd and GELU's input are the same on both; dropout has p = 0 (a no-op, no mask);
nanoVLM's KV-cache list (30 × L × 1152 B: 4.2 / 16.9) dies when the forward returns, before the peak; the
embedding backward's sort buffers come at the end of backward; a ViT with unfused softmax attention (the issue's
config names a `vit_attn_type='softmax'` no public nanoVLM commit has) would keep per layer the fp32 softmax and
its bf16 cast, 12 × 12 × 196² × 6 B less the logsumexp: 31.5 MiB at both lengths, three times the gap at 128.
The gap's shape fits one more fp32 (L, 576) tensor per LM layer (8.4 / 33.8 MiB) plus 1.6–3.4 MiB, but no kernel
we read keeps one. What the published table can and cannot say: it carries the CUDA allocator's block rounding
on CUDA's own allocation sequence (with allocations the estimate does not make: cuBLAS workspaces, attention-
backward workspaces), which the allocator model reproduces only for its own sequence. That rounding moves by ~30
MiB between runs: the published batch-1 peaks differ by 3.5 MiB between the lengths while the only length-
dependent tensor alive there, the held logits, differs by 36.0 MiB. Over 8 samples that is ±4 MiB a sample,
which covers part of the 10 MiB at 128 and little of the 37 at 512. At the peak, published − requested less the
two cuBLAS workspaces (2 × 8,519,680 B, which CUDA counts as allocated and the estimate does not yet charge) is
192/165 MiB at batch 8 (512/128), near the model's own rounding there (155/135), but 490/246 MiB at batch 16
(model: 92/100): either CUDA's rounding grows with the batch on its sequence, or a tensor family not found
above. A CUDA memory snapshot of these points replayed through the allocator model
(`scripts/check_allocator.py`, issue 12 section 2) would tell the two apart.

What was found next (2026-11-25, from committed CUDA runs and the estimate; no GPU that day). The step itself holds
no missing bytes on CUDA: the H100 run of 2026-11-24 (results/gpu_check/nvidia-h100-80gb-hbm3/, torch 2.11, this
implementation of nanoVLM's step, one fresh process a point) measured 250.47 MiB a sample at 128 and 813.83 at 512
(the last table this script prints), below the hand count, as the estimate's allocated slope is; the estimate for
that card is 1.16 MiB below and 3.27 above (0.5 % and 0.4 %). So the published 3090 run's 13.1 / 45.9 MiB a sample
beyond that measurement are the published run's own. Not its one process: measure_vram.py runs the batch sizes one
after another (the last logits held across them, empty_cache between), and `scripts/check_one_process.py` runs that
loop through one allocator model: it moves a sample's cost by under 1 MiB (device=rtx3090: 249.04 -> 249.82 at 128,
816.53 -> 817.00 at 512) and no peak by more than 6.5 MiB. What is left is what that run ran and this step does not:
its code (the issue's config names a `vit_attn_type` no public nanoVLM commit has), its torch (June 2025) and sm86's
kernels; only that code on an sm86 card can tell. Estimated for the 3090 (device=rtx3090, its cuBLAS workspaces),
the published points are 0.4-2.3 % apart (scripts/check_estimate.py --parts published): within the issue's 1 % at 3
of 6, and no model of this step, unfitted, brings the other 3 there.

Later that day vlmprobe's nanoVLM was made to compute as nanoVLM's own code does, to the byte
(scripts/check_nanovlm_code.py): its keys and values are kept until the forward returns, which is before this
peak, so the families above are the same but for index_put's indices (the image positions, 400 B a sample). The
H100 run measured the program before (its directory says so in SUPERSEDED.md), so the measured table is left out
until a GPU check measures today's. Today's estimate (device=none): 253.44 / 816.18 MiB a sample allocated at
128 / 512 (requested = hand count, 0 B apart); published 263.56 / 859.72.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import pandas as pd

from vlmprobe import backends
from vlmprobe.config.plan import plan_overrides
from vlmprobe.gpu import device_profile
from vlmprobe.point.measure import measure
from vlmprobe.results import finding as check, published as reference
from vlmprobe.results.table import gpu_check_runs, read_results_dir, superseded
from vlmprobe.script_args import positive_ints
from vlmprobe.sizes import MiB

REPO = Path(__file__).resolve().parent.parent
BATCHES = (check.SLOPE_FROM, check.SLOPE_TO)  # where the published table has both lengths
BF16, FP32, INT64 = 2, 4, 8


def hand_count(model: dict, length: int) -> list[tuple[str, str, int]]:
    """(family, formula, bytes) a sample of `length` LM tokens keeps at the backward peak: nanoVLM-222M's
    step (vlmprobe.models.nanovlm) with fp32 weights under bf16 autocast and the logits held.
    N/n layers, H/D hidden, I/M MLP width, h/hv heads of the LM/ViT, V vocab, T patches, S image side, f the
    pixel-shuffle factor."""
    text, vision = model["text"], model["vision"]
    N, H, I, h, V = (text[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                       "num_attention_heads", "vocab_size"))
    n, D, M, hv = (vision[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"))
    S = model["image_size"]
    T = (S // vision["patch_size"]) ** 2
    head_dim = H // h
    L = length
    return [
        # the LM, per layer: linear() saves its bf16 input; autocast makes a fresh cast per call for
        # non-leaf inputs (only parameters are cached), so q, k, v and gate, up each keep their own
        ("LM: linear inputs cast to bf16 (q, k, v, gate, up)", "N*L*5H*2", N * L * 5 * H * BF16),
        # RoPE multiplies bf16 q, k by fp32 cos/sin: fp32 results, cast again by SDPA's autocast (k after
        # repeat_interleave to all h heads), saved by the attention kernel
        ("LM: SDPA q and expanded k, cast to bf16", "N*L*2H*2", N * L * 2 * H * BF16),
        ("LM: v expanded to all heads (repeat_interleave copy, bf16)", "N*L*H*2", N * L * H * BF16),
        # memory-efficient (CUDA) / flash (CPU) keep output + logsumexp (h x L fp32; CUDA pads L to 32)
        ("LM: attention output (bf16) + logsumexp (fp32)", "N*L*(2H + 4h)", N * L * (H * BF16 + h * FP32)),
        ("LM: attention mask cast to bf16 (saved by SDPA)", "N*L*2", N * L * BF16),
        ("LM: gate and up outputs (bf16; silu and the product save them)", "N*L*2I*2", N * L * 2 * I * BF16),
        ("LM: silu(gate) and silu(gate)*up (bf16)", "N*L*2I*2", N * L * 2 * I * BF16),
        # RMSNorm without casts: x * rsqrt(mean(x^2) + eps) * w saves x * rsqrt (fp32) and rsqrt (L x 1)
        ("LM: RMSNorm x*rsqrt (fp32) and rsqrt, 2 per layer + final", "(2N+1)*L*(4H + 4)",
         (2 * N + 1) * L * (H + 1) * FP32),
        # block inputs and mid-block sums: the norms' inputs (the embeddings, 2N residual sums)
        ("LM: residual stream (fp32): embeddings + 2 sums per layer", "(2N+1)*L*H*4", (2 * N + 1) * L * H * FP32),
        ("LM: RoPE cos and sin (fp32)", "L*head_dim*4*2", L * head_dim * FP32 * 2),
        ("LM head: input cast to bf16", "L*H*2", L * H * BF16),
        ("logits (bf16), held by the loop's `_`", "L*V*2", L * V * BF16),
        # cross_entropy passes the logits' dtype to log_softmax (LossNLL.cpp), so autocast's fp32 does not apply
        ("log_softmax output (bf16), saved", "L*V*2", L * V * BF16),
        ("nll_loss input cast to fp32 (autocast fp32 list), saved", "L*V*4", L * V * FP32),
        ("nll_loss_backward's gradient (fp32): the op at the peak", "L*V*4", L * V * FP32),
        ("batch: input_ids, labels, attention_mask (int64)", "3*L*8", 3 * L * INT64),
        # the image features written into the embeddings by advanced indexing: index_put saves its indices, the
        # sample's row (a view of one arange) and its image positions
        ("image positions: index_put's indices (int64), saved", "(T/f^2 + 1)*8",
         (T // model["pixel_shuffle_factor"] ** 2 + 1) * INT64),
        # the ViT, per layer (T patches, no mask: flash on CUDA and on CPU)
        ("ViT: linear inputs cast to bf16 (qkv, fc1)", "n*T*2D*2", n * T * 2 * D * BF16),
        ("ViT: qkv output (bf16; q, k, v views saved by SDPA)", "n*T*3D*2", n * T * 3 * D * BF16),
        ("ViT: attention output (bf16) + logsumexp (fp32)", "n*T*(2D + 4hv)", n * T * (D * BF16 + hv * FP32)),
        ("ViT: fc1 output and gelu output (bf16)", "n*T*2M*2", n * T * 2 * M * BF16),
        ("ViT: residual stream (fp32): patches + position, 2 sums per layer", "(2n+1)*T*D*4",
         (2 * n + 1) * T * D * FP32),
        ("ViT: LayerNorm mean and rstd (fp32), 2 per layer + final", "(2n+1)*T*8", (2 * n + 1) * T * 2 * FP32),
        ("ViT: pixels (fp32) and their bf16 cast for the patch conv", "3*S^2*(4+2)", 3 * S * S * (FP32 + BF16)),
        ("projector: input cast to bf16 (pixel-shuffled patches)", "T*D*2", T * D * BF16),
    ]


@contextlib.contextmanager
def requested_peak_of_last_point(backend):
    """While active, `found["requested"]` is the allocator model's peak of requested bytes over the whole
    point measure() ran last (the step resets the model's peaks at each phase; the peak is kept across them)."""
    found = {}
    session = backend.session

    @contextlib.contextmanager
    def recording(*args, **kwargs):
        with session(*args, **kwargs) as meter:
            allocator = meter.tracker.allocator
            reset = allocator.reset_peak
            found["requested"] = 0

            def reset_peak():
                found["requested"] = max(found["requested"], allocator.peak_requested)
                reset()

            allocator.reset_peak = reset_peak
            yield meter
            found["requested"] = max(found["requested"], allocator.peak_requested)

    backend.session = recording
    try:
        yield found
    finally:
        del backend.session  # the class's method again


def estimate_peaks(lengths: list[int], overrides: tuple[str, ...] = ()) -> dict[tuple[int, int], dict]:
    """(batch, length) -> the estimate's peak allocated and peak requested bytes and the model config, for the
    points of `+sweep=seq_len` (with `overrides`, e.g. a smaller model) at BATCHES and `lengths`."""
    backend = backends.get("estimate")
    peaks = {}
    with requested_peak_of_last_point(backend) as found:
        axes = [f"sweep.axes.data.batch_size=[{','.join(map(str, BATCHES))}]",
                f"sweep.axes.data.lm_max_length=[{','.join(map(str, lengths))}]"]
        for planned in plan_overrides(["+sweep=seq_len", "measure.backend=estimate", *axes, *overrides]):
            data = planned.config["data"]
            key = (data["batch_size"], data["lm_max_length"])
            row = measure(planned.config)
            peaks[key] = {"allocated": row["peak_allocated_bytes"], "requested": found["requested"],
                          "model": planned.config["model"]}
    return peaks


def per_sample(peaks: dict, length: int, figure: str) -> float:
    return check.per_sample({key: found.get(figure) for key, found in peaks.items()}, length)


def measured_runs(root: Path = REPO / "results" / "gpu_check") -> list[tuple[str, dict]]:
    """(card, (batch, length) -> {"allocated": bytes}) of each committed CUDA run of the seq_len sweep that has
    both lengths at BATCHES: a measurement of the very step the estimate runs (not a run marked SUPERSEDED.md:
    it measured a program the code no longer runs)."""
    runs = []
    for run in gpu_check_runs(root, "seq_len"):
        if superseded(run):
            continue
        table = read_results_dir(run)
        card = json.loads((run / "env.json").read_text())["device_name"]
        table = table[(table["backend"] == "cuda") & (table["status"] == "ok")]
        peaks = {(int(r.batch_size), int(r.lm_max_length)): {"allocated": int(r.peak_allocated_bytes)}
                 for r in table.itertuples()}
        runs.append((card, peaks))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=positive_ints, default="128,512",
                        help="lm_max_length values (comma-separated)")
    args = parser.parse_args()
    lengths = args.lengths
    peaks = estimate_peaks(lengths)
    for r in reference.load().itertuples():
        if (r.batch_size, r.lm_max_length) in peaks and r.status == "ok":
            peaks[(r.batch_size, r.lm_max_length)]["published"] = int(r.peak_bytes)
    model = next(iter(peaks.values()))["model"]
    counts = {n: hand_count(model, n) for n in lengths}
    families = pd.DataFrame({"family": [name for name, _, _ in counts[lengths[0]]],
                             "formula (bytes per sample)": [formula for _, formula, _ in counts[lengths[0]]],
                             **{f"L={n} MiB": [size / MiB for _, _, size in counts[n]] for n in lengths}})
    print("## What one sample keeps at the backward peak, by hand (MiB = 1024^2 bytes)\n")
    print(families.round(3).to_markdown(index=False), "\n")
    rows = []
    published = {n: per_sample(peaks, n, "published") if all("published" in peaks[(b, n)] for b in BATCHES) else None
                 for n in lengths}
    for n in lengths:
        hand = sum(size for _, _, size in counts[n])
        requested = per_sample(peaks, n, "requested")
        rows.append({"lm_max_length": n, "hand MiB": hand / MiB, "estimate requested MiB": requested / MiB,
                     "requested - hand B": requested - hand,
                     "estimate allocated MiB": per_sample(peaks, n, "allocated") / MiB,
                     "published MiB (RTX 3090)": None if published[n] is None else published[n] / MiB,
                     "published - requested MiB": None if published[n] is None else (published[n] - requested) / MiB})
    low, high = BATCHES
    print(f"## Per sample, batch {low} -> {high} (estimate: backend estimate, no GPU; published: CUDA)\n")
    print(pd.DataFrame(rows).round(2).to_markdown(index=False), "\n")
    measured = []
    for card, peaks_measured in measured_runs():
        key = device_profile.key_of_card(card)
        estimated = estimate_peaks(lengths, (f"device={key}",) if key else ())
        for n in lengths:
            if all((b, n) in peaks_measured for b in BATCHES):
                cuda, estimate = per_sample(peaks_measured, n, "allocated"), per_sample(estimated, n, "allocated")
                measured.append({"card (cuda)": card, "lm_max_length": n, "measured MiB": cuda / MiB,
                                 "estimated for": f"device={key or 'none'}", "estimate allocated MiB": estimate / MiB,
                                 "estimate - measured MiB": (estimate - cuda) / MiB,
                                 "published (RTX 3090) - measured MiB":
                                     None if published[n] is None else (published[n] - cuda) / MiB})
    if measured:
        print(f"## Per sample, batch {low} -> {high}, measured on CUDA (committed runs under results/gpu_check/)\n")
        print(pd.DataFrame(measured).round(2).to_markdown(index=False), "\n")
    print("## Block rounding in the estimate at each peak (allocated - requested)\n")
    print(pd.DataFrame([{"batch_size": b, "lm_max_length": n, "allocated MiB": p["allocated"] / MiB,
                         "requested MiB": p["requested"] / MiB,
                         "allocated - requested MiB": (p["allocated"] - p["requested"]) / MiB}
                        for (b, n), p in sorted(peaks.items())]).round(2).to_markdown(index=False))


if __name__ == "__main__":
    main()
