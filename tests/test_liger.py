"""train.liger_kernel (vlmprobe.kernels.liger): the stand-ins allocate and save what Liger-Kernel 0.8.5's kernels do
(hand counts from its code; less than transformers' own modules and loss by what Liger leaves out), the model is
patched where Liger's apply function patches it, the estimate equals the cpu backend to the byte, the knob off
changes nothing, and a family, step or dist it does not cover is one line (exit 2). Slow: Liger itself (its Triton
launches as no-ops, on its CPU branches) against the stand-ins, event by event; skipped without liger-kernel.

Run as a script (`python tests/test_liger.py --against-liger`) it prints that comparison (needs liger-kernel and
triton).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys

import pytest
import torch

from vlmprobe.backends import get
from vlmprobe.errors import ConfigError
from vlmprobe.kernels import liger, liger_ops
from vlmprobe.point.build import build_spec, parameter_shapes
from vlmprobe.point.measure import measure

BLOCK = 512  # the caching allocator's unit: every block a multiple of it
BYTE_COLUMNS = ("peak_allocated_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
                "after_load_bytes", "after_step_bytes", "activations_bytes", "grads_bytes", "optimizer_state_bytes",
                "params_bytes", "peak_reserved_bytes")
TINY = ["data.batch_size=2", "data.lm_max_length=96"]
ONE_STEP = ["data.batch_size=1", "data.lm_max_length=64", "measure.steps=1"]  # the fast tests' points
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def block(nbytes: int) -> int:
    return -(nbytes // -BLOCK) * BLOCK


def held_by(meter, run):
    """(run()'s result, the bytes it leaves allocated, its peak), the last two above the memory before it."""
    meter.reset_peak()
    before = meter.current()
    out = run()
    return out, meter.current() - before, meter.peaks()["allocated"] - before


def test_rms_norm_keeps_an_fp32_rstd_per_row_and_writes_the_input_gradient_over_the_output_gradient():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

    rows, width = 2 * 96, 64
    with get("estimate").session(None) as meter:
        norm = Qwen2VLRMSNorm(width)  # an fp32 weight
        liger.patch_rms_norm(norm)
        x = torch.zeros(2, 96, width, dtype=torch.bfloat16, requires_grad=True)
        y, held, _ = held_by(meter, lambda: norm(x))
        # rms_norm_forward: Y like X, RSTD fp32 per row (llama casting); saved: X (the caller's), W, RSTD
        assert held == block(rows * width * 2) + block(rows * 4)
        grad = torch.ones_like(y)
        _, held, peak = held_by(meter, lambda: y.backward(grad))
        # rms_norm_backward, in place: the (sm_count, width) fp32 partials and their sum (W's dtype: no cast); dX is
        # the output gradient's own block, which x.grad takes over; the graph's RSTD dies
        assert peak == block(liger_ops.MULTIPROCESSORS * width * 4) + block(width * 4)
        assert held == block(width * 4) - block(rows * 4)
        assert x.grad.untyped_storage() is grad.untyped_storage()


def test_swiglu_keeps_its_two_inputs_where_transformers_mlp_also_keeps_the_silu_output():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2MLP

    rows, hidden, inner = 2 * 96, 64, 128
    config = Qwen2VLTextConfig(hidden_size=hidden, intermediate_size=inner, hidden_act="silu")
    held = {}
    with get("estimate").session(None) as meter:
        for name in ("transformers", "liger"):
            mlp = Qwen2MLP(config)
            if name == "liger":
                liger.patch_swiglu(mlp)
            x = torch.zeros(2, 96, hidden, requires_grad=True)
            y, held[name], _ = held_by(meter, lambda: mlp(x))
            del y
    # Liger: gate and up outputs (saved by LigerSiLUMulFunction), c (saved by down_proj), the output
    assert held["liger"] == 3 * block(rows * inner * 4) + block(rows * hidden * 4)
    # transformers: the same plus silu(gate), which its product saves
    assert held["transformers"] - held["liger"] == block(rows * inner * 4)


def test_chunk_size_is_liger_s_own_example():
    # fused_linear_cross_entropy.py's comment: BT = 4096*4, V = 32000, H = 4096 ==> inc_factor = 8, chunk_size = 2048
    assert liger_ops.chunk_rows(4096 * 4, 4096, 32000) == 2048
    assert liger_ops.chunk_rows(100, 64, 64) == 100  # one chunk: never over BT


def fused_loss_figures(batch: int, length: int, hidden: int, vocab: int, fused: bool) -> tuple[int, int]:
    """(forward peak, held after forward) above the start, bf16 head and hidden states, no autocast: Liger's loss or
    transformers' (lm_head, then ForCausalLMLoss)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    with get("estimate").session(None) as meter:
        hidden_states = torch.zeros(batch, length, hidden, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.zeros(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(batch, length, dtype=torch.int64)
        if fused:
            run = lambda: liger_ops.causal_lm_loss(hidden_states, weight, labels, hidden)  # noqa: E731
        else:
            logits = torch.nn.functional.linear
            run = lambda: ForCausalLMLoss(logits(hidden_states, weight), labels, vocab)  # noqa: E731
        loss, held, peak = held_by(meter, run)
        return peak, held


def test_fused_linear_cross_entropy_holds_its_buffers_by_hand_and_never_the_logits():
    b, length, hidden, vocab = 2, 256, 64, 4096
    rows = b * length
    chunk = 8  # inc_factor = ceil(4096 / 64) = 64; next power of 2 of ceil(512 / 64)
    peak, held = fused_loss_figures(b, length, hidden, vocab, fused=True)
    # LigerForCausalLMLoss's padded and shifted labels, then fused_linear_cross_entropy_forward's grad_input,
    # grad_weight (bf16 like the head), fp32 loss_1d, the bool target mask, and one bf16 logits chunk reused
    # through mm(out=) (bf16 operands, no autocast): nothing else is alive at once
    buffers = block(rows * hidden * 2) + block(vocab * hidden * 2) + block(rows * 4) + block(rows) \
        + block(chunk * vocab * 2)
    assert peak == block(b * (length + 1) * 8) + block(rows * 8) + buffers
    # kept to backward: the two gradients, and the loss
    assert held == block(rows * hidden * 2) + block(vocab * hidden * 2) + BLOCK
    # transformers' loss holds at its cross-entropy the logits' fp32 copy and log_softmax's fp32 output beside the
    # same two label copies (the bf16 logits die once copied: no model output holds them here)
    hf_peak, _ = fused_loss_figures(b, length, hidden, vocab, fused=False)
    assert hf_peak - peak >= 2 * block(rows * vocab * 4) - buffers


def test_at_a_tiny_qwen2_vl_point_the_forward_peak_drops_by_the_logits_and_the_loss_s_copies(point):
    b, length, hidden, vocab = 2, 128, 64, 4096
    rows = b * length
    base = ["model=qwen2_vl_tiny", f"model.text.vocab_size={vocab}", f"data.batch_size={b}",
            f"data.lm_max_length={length}", "train.param_dtype=bfloat16", "train.autocast_dtype=null",
            "measure.backend=estimate", "measure.steps=1"]
    off, on = (measure(point(base + [f"train.liger_kernel={v}"])) for v in ("false", "true"))
    assert off["status"] == on["status"] == "ok", (off.get("error"), on.get("error"))
    # transformers: bf16 logits, fp32 copy, log_softmax output (BT x V each) on top of the backbone; Liger: its
    # buffers instead (the hand count of the test above), its other kernels only lowering the backbone
    chunk = 4  # inc_factor = ceil(4096 / 64) = 64; next power of 2 of ceil(256 / 64)
    fused = block(rows * hidden * 2) + block(vocab * hidden * 2) + block(rows * 4) + block(rows) \
        + block(chunk * vocab * 2) + block(b * (length + 1) * 8) + block(rows * 8)
    assert off["forward_peak_bytes"] - on["forward_peak_bytes"] >= rows * vocab * (2 + 4 + 4) - fused
    assert off["peak_allocated_bytes"] > on["peak_allocated_bytes"]
    assert on["notes"].startswith("Liger-Kernel 0.8.5 modelled")


def test_estimate_equals_the_cpu_backend_to_the_byte_and_leaves_transformers_as_it_was(point):
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    functions = (modeling_qwen3_vl.apply_rotary_pos_emb, modeling_qwen3_vl.apply_rotary_pos_emb_vision)
    base = ["model=qwen3_vl_tiny", *ONE_STEP, "train.liger_kernel=true"]  # RMSNorm, q/k norms, both RoPEs, FLCE
    cpu = measure(point(base + ["measure.backend=cpu"]))
    estimate = measure(point(base + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok", (cpu.get("error"), estimate.get("error"))
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}
    # Liger's RoPE functions were in the modeling module only while this instance's attention ran
    assert (modeling_qwen3_vl.apply_rotary_pos_emb, modeling_qwen3_vl.apply_rotary_pos_emb_vision) == functions


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2_vl_tiny", "qwen2_5_vl_tiny", "qwen3_vl_tiny"])
@pytest.mark.parametrize("setting", [
    ["train.param_dtype=bfloat16", "train.autocast_dtype=null"],
    ["train.autocast_dtype=null"],
    ["train.grad_ckpt.lm=true", "train.grad_ckpt.vision=true"],
    ["train.lora_r=4"],
    ["train.freeze_lm=true"],
    ["train.grad_accum_steps=2", "measure.hold_outputs=true"],
    ["device=h100_80gb"],
])
def test_estimate_equals_the_cpu_backend_to_the_byte_in_every_family_and_knob(point, model, setting):
    base = [f"model={model}", *TINY, "train.liger_kernel=true", *setting]
    cpu = measure(point(base + ["measure.backend=cpu"]))
    estimate = measure(point(base + ["measure.backend=estimate"]))
    assert cpu["status"] == estimate["status"] == "ok", (cpu.get("error"), estimate.get("error"))
    assert {k: estimate[k] for k in BYTE_COLUMNS} == {k: cpu[k] for k in BYTE_COLUMNS}


@pytest.mark.slow
@pytest.mark.parametrize("dist", [["dist=ddp", "dist.bucket_cap_mb=0.25"], ["dist=fsdp2"]])
def test_sharded_and_replicated_ranks_estimate_equals_real_gloo_ranks(point, dist):
    from conftest import real_run_that_agrees
    from vlmprobe.run.ranks import run_ranks

    base = ["model=qwen2_vl_tiny", "data.batch_size=2", "data.lm_max_length=64", "train.liger_kernel=true",
            "dist.world_size=2", *dist]
    columns = [c for c in BYTE_COLUMNS if c not in ("peak_reserved_bytes", "after_load_bytes")]

    def by_rank(overrides):
        out = run_ranks(point(base + overrides), dict(os.environ))
        assert out["status"] == "ok", out.get("error")
        return {r["rank"]: {k: r.get(k) for k in columns} for r in out["ranks"]}

    estimate = by_rank(["measure.backend=estimate"])
    real_run_that_agrees(lambda: by_rank(["measure.backend=cpu"]), lambda cpu: {
        (r, k): (estimate[r][k], v) for r, row in cpu.items() for k, v in row.items() if estimate[r][k] != v})


def test_the_knob_off_is_byte_identical_to_a_config_without_it(point):
    off = point(["model=qwen2_vl_tiny", *ONE_STEP, "measure.backend=estimate", "train.liger_kernel=false"])
    without = {**off, "train": {k: v for k, v in off["train"].items() if k != "liger_kernel"}}
    rows = [measure(config) for config in (off, without)]
    assert rows[0]["status"] == rows[1]["status"] == "ok"
    assert {k: rows[0][k] for k in BYTE_COLUMNS} == {k: rows[1][k] for k in BYTE_COLUMNS}
    assert rows[0]["notes"] == rows[1]["notes"] is None
    spec = build_spec(off["model"])
    model = spec.build("meta", torch.float32, init=False)
    before = {name: dict(vars(module)) for name, module in model.named_modules()}
    liger.apply(spec, model, off["train"])
    liger.apply(spec, model, without["train"])
    assert {name: dict(vars(module)) for name, module in model.named_modules()} == before


def test_liger_changes_no_parameter(point):
    config = point(["model=qwen2_5_vl_tiny", *TINY, "train.liger_kernel=true"])
    spec = build_spec(config["model"])
    model = spec.build("meta", torch.float32, init=False)
    before = [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()]
    liger.apply(spec, model, config["train"])
    assert [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()] == before
    off = {**config, "train": {**config["train"], "liger_kernel": False}}
    assert parameter_shapes(config) == parameter_shapes(off) == [shape for _, shape, _, _ in before]


@pytest.mark.parametrize("model,patched", [
    # monkey_patch.py, with a model: qwen2_vl's vision blocks' two LayerNorms; the LM's final norm, two norms
    # and a SwiGLU MLP per layer
    ("qwen2_vl_tiny", {"LigerLayerNorm": 2 * 2, "LigerRMSNorm": 1 + 2 * 2, "LigerSwiGLUMLP": 2}),
    # qwen2_5_vl: the vision blocks' two RMSNorms instead
    ("qwen2_5_vl_tiny", {"LigerRMSNorm": 2 * 2 + 1 + 2 * 2, "LigerSwiGLUMLP": 2}),
    # qwen3_vl: no SwiGLU by default; the attention's q and k norms too; RoPE in both towers' attention
    ("qwen3_vl_tiny", {"LigerRMSNorm": 1 + 4 * 2}),
])
def test_apply_patches_what_liger_s_apply_function_patches(spec, model, patched):
    built = spec(model).build("meta", torch.float32, init=False)
    liger.apply(spec(model), built, {"liger_kernel": True})
    names = [m._get_name() for m in built.modules()]
    assert {n: names.count(n) for n in set(names) if n.startswith("Liger")} == patched
    assert "forward" in vars(built)  # the fused cross-entropy's forward, on this instance only
    wrapped = [name for name, m in built.named_modules() if "forward" in vars(m) and name.endswith("attn")]
    assert len(wrapped) == (2 + 2 if model == "qwen3_vl_tiny" else 0)


def test_qwen2_vl_rope_patch_has_nothing_to_replace_in_this_transformers():
    """Liger's qwen2_vl / qwen2_5_vl apply functions replace apply_multimodal_rotary_pos_emb; transformers 5.x merges
    M-RoPE's sections in the rotary embedding and its attention calls apply_rotary_pos_emb, so none is modelled."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    for modeling, attention in ((modeling_qwen2_vl, "Qwen2VLAttention"), (modeling_qwen2_5_vl, "Qwen2_5_VLAttention")):
        assert not hasattr(modeling, "apply_multimodal_rotary_pos_emb")
        assert "apply_rotary_pos_emb(" in inspect.getsource(getattr(modeling, attention).forward)


@pytest.mark.parametrize("overrides,line", [
    (["model=llava_tiny", "train.liger_kernel=true"],
     "train.liger_kernel=true is not allowed with model=llava_tiny (LlavaForConditionalGeneration): vlmprobe models "
     "Liger-Kernel 0.8.5's patches for model types qwen2_vl, qwen2_5_vl, qwen3_vl only; use false"),
    (["model=nanovlm_tiny", "train.liger_kernel=true"], "is not allowed with model=nanovlm_tiny (NanoVLMSpec)"),
    (["model=qwen2_vl_tiny", "train.liger_kernel=yes"], "train.liger_kernel='yes' is not allowed: use true or false"),
    (["model=qwen2_5_vl_tiny", "train.liger_kernel=true", "step=grpo", "data.batch_size=4"],
     "train.liger_kernel=true is not allowed with step=grpo: only the supervised step is modelled"),
    (["model=qwen2_vl_tiny", "train.liger_kernel=true", "dist=zero3", "dist.world_size=2"],
     "train.liger_kernel=true is not allowed with dist=zero3: Liger's fused cross-entropy reads lm_head.weight"),
])
def test_what_it_does_not_cover_is_one_line(cli, overrides, line):
    code, err = cli([*overrides, "measure.backend=estimate", "dry_run=true"])
    assert code == 2 and len(err) == 1 and line in err[0], err


def test_apply_refuses_a_family_it_does_not_cover_by_name(spec):
    llava = spec("llava_tiny")
    with pytest.raises(ConfigError, match=r"model=llava_tiny \(LlavaForConditionalGeneration\).*qwen2_vl, qwen2_5_vl"):
        liger.apply(llava, llava.build("meta", torch.float32, init=False), {"liger_kernel": True})


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel and triton are not installed (pip install liger-kernel)")
def test_liger_itself_patches_and_allocates_as_the_stand_ins_do_on_its_cpu_branches():
    """Liger's own Python, its Triton launches made no-ops (a kernel makes no storage), on CPU tensors: in a child
    process, as Liger's apply functions patch transformers' modules process-wide."""
    result = subprocess.run([sys.executable, __file__, "--against-liger"], capture_output=True, text=True,
                            timeout=1200, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0 and "ALL SAME" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


# --- the comparison with Liger itself (a child process: `python tests/test_liger.py --against-liger`) -----------------

def _liger_without_kernels():
    """Import liger_kernel with every Triton kernel of the ops read here replaced by a no-op launch, and shims for what
    transformers 5.20+ removed (the Qwen-VL CausalLMOutputWithPast classes Liger imports, the rope_deltas it reads)."""
    from dataclasses import dataclass

    import transformers.modeling_outputs as outputs
    import triton
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    for module, name in ((modeling_qwen2_vl, "Qwen2VLCausalLMOutputWithPast"),
                         (modeling_qwen2_5_vl, "Qwen2_5_VLCausalLMOutputWithPast"),
                         (modeling_qwen3_vl, "Qwen3VLCausalLMOutputWithPast")):
        if not hasattr(module, name):
            setattr(module, name, dataclass(type(name, (outputs.CausalLMOutputWithPast,),
                                                 {"__annotations__": {"rope_deltas": object}, "rope_deltas": None})))
    if not hasattr(outputs.MultimodalBaseModelOutputWithPast, "rope_deltas"):
        outputs.MultimodalBaseModelOutputWithPast.rope_deltas = None

    import liger_kernel.ops.cross_entropy
    import liger_kernel.ops.fused_linear_cross_entropy
    import liger_kernel.ops.layer_norm
    import liger_kernel.ops.rms_norm
    import liger_kernel.ops.rope
    import liger_kernel.ops.swiglu
    import liger_kernel.ops.utils

    class NoKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for module in (liger_kernel.ops.rms_norm, liger_kernel.ops.layer_norm, liger_kernel.ops.swiglu,
                   liger_kernel.ops.rope, liger_kernel.ops.fused_linear_cross_entropy, liger_kernel.ops.cross_entropy,
                   liger_kernel.ops.utils):
        for name, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.jit.JITFunction):
                setattr(module, name, NoKernel())


def _events(run):
    """The allocator model's requests (+bytes) and frees (-bytes) while run() runs on the cpu backend: its forward,
    and its backward; a marker where the forward returned (what autocast's cast cache frees after it comes in a hash
    table's order, not the program's: compared as a set)."""
    from vlmprobe.estimate.allocator import CachingAllocatorModel

    events, live = [], {}
    malloc, free = CachingAllocatorModel.malloc, CachingAllocatorModel.free

    def recorded_malloc(self, nbytes):
        handle = malloc(self, nbytes)
        live[handle] = nbytes
        events.append(f"+{nbytes}")
        return handle

    def recorded_free(self, handle):
        events.append(f"-{live.pop(handle, '?')}")
        return free(self, handle)

    CachingAllocatorModel.malloc, CachingAllocatorModel.free = recorded_malloc, recorded_free
    try:
        with get("cpu").session(None):
            torch.manual_seed(0)
            return run(events)
    finally:
        CachingAllocatorModel.malloc, CachingAllocatorModel.free = malloc, free


_MARKED: list[list] = []  # the events list of the step running, where a forward marks its return (_mark)


def _mark() -> None:
    _MARKED[-1].append("| forward returned")


def _step(make, call):
    def run(events):
        inputs = make()
        events.clear()
        _MARKED.append(events)
        out = call(*inputs)
        _mark()  # a forward that marked its return inside its autocast region keeps that first mark
        _MARKED.pop()
        forward = list(events)
        events.clear()
        loss = sum(o.float().sum() for o in out) if isinstance(out, tuple) else out.float().sum()
        loss.backward()
        cut = forward.index("| forward returned")
        return forward[:cut], sorted(forward[cut:]), list(events)
    return _events(run)


def _against_liger() -> bool:
    """Each Function, then a whole forward and backward of each family's tiny model, Liger's vs the stand-ins'."""
    from hydra.utils import instantiate
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss
    from omegaconf import OmegaConf

    from conftest import CONF
    from vlmprobe.models.base import DataShape

    # Liger's branches on CPU tensors: sm_count 1, no mm(out=), the legacy weight-gradient path
    liger_ops.MULTIPROCESSORS, liger_ops.CAPABILITY = 1, 0
    liger_ops._can_use_mm_out = lambda *args: False
    same = True

    def compare(label, make, theirs, ours):
        nonlocal same
        a, b = _step(make, theirs), _step(make, ours)
        same &= a == b
        print(f"{label:45s} {'SAME' if a == b else 'DIFFERENT'}: {len(a[0])} forward, {len(a[2])} backward events")
        if a != b:
            print("  liger   ", a, "\n  stand-in", b)

    for dtype in (torch.bfloat16, torch.float32):
        for in_place in (True, False):
            for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
                args = (1e-6, offset, casting, in_place, None)
                compare(f"rms_norm {dtype} in_place={in_place} {casting}",
                        lambda: ((torch.randn(3, 40, 64, dtype=dtype, requires_grad=True) * 1.0),
                                 torch.ones(64, requires_grad=True)),
                        lambda x, w: LigerRMSNormFunction.apply(x, w, *args),
                        lambda x, w: liger_ops.RMSNormFunction.apply(x, w, *args))
        compare(f"layer_norm {dtype}",
                lambda: (torch.randn(3, 40, 48, dtype=dtype, requires_grad=True) * 1.0,
                         torch.ones(48, requires_grad=True), torch.zeros(48, requires_grad=True)),
                lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-6),
                lambda x, w, b: liger_ops.LayerNormFunction.apply(x, w, b, 1e-6))
        compare(f"swiglu {dtype}",
                lambda: (torch.randn(3, 40, 32, dtype=dtype, requires_grad=True),
                         torch.randn(96, 32, dtype=dtype, requires_grad=True),
                         torch.randn(96, 32, dtype=dtype, requires_grad=True)),
                lambda x, w1, w2: LigerSiLUMulFunction.apply(x @ w1.t(), x @ w2.t(), 1.0, 1.0),
                lambda x, w1, w2: liger_ops.SiLUMulFunction.apply(x @ w1.t(), x @ w2.t(), 1.0, 1.0))

        def heads(qp, kp):
            return (qp * 1.0).view(2, 24, 4, 16).transpose(1, 2), (kp * 1.0).view(2, 24, 2, 16).transpose(1, 2)

        compare(f"rope {dtype}",
                lambda: (torch.randn(2, 24, 64, dtype=dtype, requires_grad=True),
                         torch.randn(2, 24, 32, dtype=dtype, requires_grad=True),
                         torch.randn(2, 24, 16, dtype=dtype), torch.randn(2, 24, 16, dtype=dtype)),
                lambda qp, kp, c, s: LigerRopeFunction.apply(*heads(qp, kp), c, s),
                lambda qp, kp, c, s: liger_ops.RopeFunction.apply(*heads(qp, kp), c, s))
        for frozen in (False, True):
            def make():
                labels = torch.randint(0, 256, (2, 40))
                labels[:, :5] = -100
                return (torch.randn(2, 40, 64, dtype=dtype, requires_grad=True),
                        torch.randn(256, 64, dtype=dtype, requires_grad=not frozen), labels)

            compare(f"fused linear cross-entropy {dtype} frozen head={frozen}", make,
                    lambda h, w, y: LigerForCausalLMLoss(h * 1.0, w, y, 64),
                    lambda h, w, y: liger_ops.causal_lm_loss(h * 1.0, w, y, 64))

    def whole_steps(patch) -> dict:
        """(modules' names, the step's events) per family and setting, the model patched by patch(spec, model)."""
        found = {}
        for name in ("qwen2_vl_tiny", "qwen2_5_vl_tiny", "qwen3_vl_tiny"):
            spec = instantiate(OmegaConf.load(CONF / "model" / f"{name}.yaml"), _convert_="all")
            for dtype, autocast in ((torch.float32, True), (torch.bfloat16, False), (torch.float32, False)):
                def make():
                    model = spec.build("cpu", dtype)
                    patch(spec, model)
                    return model.train(), spec.batch(DataShape(batch_size=2, lm_max_length=64), torch.device("cpu"))

                def forward(model, batch):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = spec.loss(model, batch)[0]
                        _mark()  # before autocast's cache is freed
                        return loss

                names = [m._get_name() for m in make()[0].modules()]
                found[f"{name} {dtype} autocast={autocast}"] = names, _step(make, forward)
        return found

    def liger_apply(spec, model):
        """Liger's own, after which the classes it also swaps in the modeling module (Qwen2RMSNorm = LigerRMSNorm...)
        are put back: a model built later in a process Liger patched would be built of its classes, where the
        Trainer patches a model built before (its functions, as the RoPE that instance calls, stay)."""
        modeling = sys.modules[type(model).__module__]
        classes = {k: v for k, v in vars(modeling).items() if isinstance(v, type)}
        _apply_liger_kernel_to_instance(model=model)
        vars(modeling).update(classes)

    # the stand-ins first: Liger's apply functions also replace functions in transformers' modules
    ours = whole_steps(lambda spec, model: liger.apply(spec, model, {"liger_kernel": True}))
    theirs = whole_steps(liger_apply)
    for label, (names, events) in ours.items():
        same &= (names, events) == theirs[label]
        print(f"{label}: modules patched {'SAME' if names == theirs[label][0] else 'DIFFERENT'}, step "
              f"{'SAME' if events == theirs[label][1] else 'DIFFERENT'} ({len(events[0])} forward, "
              f"{len(events[2])} backward events)")
    print("ALL SAME" if same else "SOME DIFFER")
    return same


if __name__ == "__main__" and "--against-liger" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _liger_without_kernels()
    sys.exit(0 if _against_liger() else 1)
