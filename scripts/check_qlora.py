#!/usr/bin/env python
"""QLoRA (train.quantization) checked against real bitsandbytes where it runs here: the CPU.

1. layer: one bf16 Linear(1024 -> 2048) with bias, 2 x 1024 rows (over the 1536 rows where bitsandbytes' CUDA
   gemm_4bit always takes its dequantize + F.linear fallback): bytes kept, forward and backward peaks, for
   ("kept" is the change from the bf16 weight to the quantized state: negative)
   - hand: bitsandbytes 0.50.2's formulas (vlmprobe.quantization.accounting.kept_bytes) and, for forward and
     backward, the tensors its CUDA code allocates (comments in layer_table),
   - estimate: the stand-in on fake tensors (what the estimate backend charges, modelling the CUDA path),
   - cpu: real bitsandbytes on the cpu backend, and `cpu, inside gemm_4bit`: the same with bitsandbytes::gemm_4bit
     run as the Python function its CPU dispatch runs (backends/default/ops.py _gemm_4bit_default_impl), so the
     tracker sees its transients (it sees only a custom op's output otherwise).
2. model: qwen2_vl_tiny, bf16, LoRA r 8 on q/k/v/o, batch 1 / 64 tokens: per-phase peaks, real bitsandbytes on
   cpu vs the stand-in on estimate; and the quantized layers' bytes by hand against the estimate's after-load
   difference with the unquantized model.

Differences, each from the code (run it to see the figures):
- kept: bitsandbytes makes the 16-value 4-bit code table from Python data (get_4bit_type: torch.tensor); the cpu
  tracker does not count tensors made from Python data, a CUDA run allocates it: 512 B per 4-bit layer.
- nf4 forward: on CPU gemm_4bit's default implementation frees the dequantized nested absmax as soon as the
  offset is added (a temporary); CUDA's fallback keeps both fp32 [blocks] tensors until it returns: the CPU
  peak is 4 x blocks B lower.
- int8 forward: CPU training runs MatMul8bitFp (dequantize + linear: the weight in the input dtype), CUDA
  MatMul8bitLt (int8 input rows, an int32 [rows, out] product, an fp16 output cast back): different code, the
  stand-in follows CUDA's; backward is the same code on both (equal).
- The stand-in assumes no int8 outlier columns (|activation| >= 6) and charges the 4-bit fallback from 5 rows up
  (bitsandbytes chooses per card between 5 and 1536 rows; the row's notes say so).

    python scripts/check_qlora.py [--parts layer,model]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import types

import pandas as pd

SHAPE, ROWS = (2048, 1024), 2048
TRAIN = {"quantization_double_quant": True, "quantization_compute_dtype": "bfloat16", "lora_r": 8}
MODEL = ["model=qwen2_vl_tiny", "data.batch_size=1", "data.lm_max_length=64", "train.lora_r=8",
         "train.param_dtype=bfloat16", "train.autocast_dtype=null"]
PHASES = ["after_load_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes", "peak_allocated_bytes"]


@contextlib.contextmanager
def gemm_4bit_as_python():
    """bitsandbytes::gemm_4bit replaced by the Python function its CPU dispatch runs, for the tracker to see inside."""
    import torch
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    namespace = torch.ops.bitsandbytes
    original = namespace.gemm_4bit
    setattr(namespace, "gemm_4bit", types.SimpleNamespace(default=_gemm_4bit_default_impl))
    try:
        yield
    finally:
        setattr(namespace, "gemm_4bit", original)


def layer_table() -> pd.DataFrame:
    from vlmprobe.backends import get
    from vlmprobe.quantization import bnb_real, bnb_standin
    from vlmprobe.quantization.accounting import block, kept_bytes, layer_bytes

    out_f, in_f = SHAPE
    rows = []
    for kind in ("nf4", "int8"):
        train = {**TRAIN, "quantization": kind}
        blocks, weight, output = out_f * in_f // 64, block(2 * out_f * in_f), block(ROWS * out_f * 2)
        grad_input, loss = block(ROWS * in_f * 2), 2 * 512  # backward also makes the loss (a sum) and its gradient
        if kind == "nf4":
            # CUDA fallback: the output, two fp32 absmax [blocks], the bf16 weight; backward: dequantize_4bit's bf16
            # weight (its fp32 absmax freed on return) through the matmul with the input's gradient
            hand = {"forward": output + 2 * block(4 * blocks) + weight, "backward": loss + weight + grad_input}
        else:
            # MatMul8bitLt at `out16.to(A.dtype)`: int8 rows, fp32 row stats, the int32 product, the fp16 output and
            # its bf16 cast; backward: the sum's gradient is an expanded scalar, so reshape(-1, N) copies it (bf16
            # [rows, out]), then the weight in bf16 and the input's gradient
            hand = {"forward": block(ROWS * in_f) + block(4 * ROWS) + block(4 * ROWS * out_f) + 2 * output,
                    "backward": loss + output + weight + grad_input}
        measured = {"hand": {"kept": kept_bytes(out_f, in_f, kind) - 2 * out_f * in_f, **hand},
                    "estimate (stand-in)": layer_bytes(get("estimate"), train, bnb_standin.replace, SHAPE, ROWS),
                    "cpu (bitsandbytes)": layer_bytes(get("cpu"), train, bnb_real.replace, SHAPE, ROWS)}
        if kind == "nf4":
            with gemm_4bit_as_python():
                measured["cpu, inside gemm_4bit"] = layer_bytes(get("cpu"), train, bnb_real.replace, SHAPE, ROWS)
        for source, figures in measured.items():
            rows.append({"quantization": kind, "source": source, **{f"{k} B": v for k, v in figures.items()}})
    return pd.DataFrame(rows)


def model_table() -> tuple[pd.DataFrame, pd.DataFrame]:
    import torch
    from hydra.utils import instantiate

    from vlmprobe.config.plan import plan_overrides
    from vlmprobe.quantization import layers_to_quantize
    from vlmprobe.quantization.accounting import block, kept_bytes
    from vlmprobe.point.measure import measure

    rows, hand_rows = [], []
    for kind in ("nf4", "int8"):
        figures = {}
        for backend in ("cpu", "estimate"):
            for quantization in (kind, "null"):
                (planned,) = plan_overrides(MODEL + [f"train.quantization={quantization}", f"measure.backend={backend}"])
                figures[backend, quantization] = measure(planned.config)
            rows.append({"quantization": kind, "backend": backend,
                         **{k: figures[backend, kind][k] for k in PHASES}})
        spec = instantiate(planned.config["model"], _convert_="all")
        model = spec.build("meta", torch.bfloat16, init=False)
        shapes = [model.get_submodule(name).weight.shape for name in layers_to_quantize(model)]
        hand = sum(kept_bytes(o, i, kind) for o, i in shapes)
        weights = sum(block(2 * o * i) for o, i in shapes)
        for backend in ("cpu", "estimate"):
            change = figures[backend, kind]["after_load_bytes"] - figures[backend, "null"]["after_load_bytes"]
            hand_rows.append({"quantization": kind, "layers": len(shapes), "backend": backend,
                              "hand: quantized state B": hand,
                              "after-load change + bf16 weights B": change + weights,
                              "apart B": change + weights - hand})
    return pd.DataFrame(rows), pd.DataFrame(hand_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="layer,model")
    args = parser.parse_args()
    if importlib.util.find_spec("bitsandbytes") is None:
        raise SystemExit('bitsandbytes is not installed: pip install -e ".[quant]"')
    parts = args.parts.split(",")
    if "layer" in parts:
        print(f"## One layer: bf16 Linear({SHAPE[1]} -> {SHAPE[0]}), {ROWS} rows (bytes above the start of each phase)\n")
        print(layer_table().to_markdown(index=False), "\n")
    if "model" in parts:
        phases, hand = model_table()
        print("## qwen2_vl_tiny, bf16, LoRA r 8, batch 1 / 64 tokens (bytes)\n")
        print(phases.to_markdown(index=False), "\n")
        print("## Quantized layers' bytes: hand count vs the after-load change\n")
        print(hand.to_markdown(index=False))


if __name__ == "__main__":
    main()
