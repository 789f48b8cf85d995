"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B): exact sizes from the config, the experts as CUDA runs them (torch's grouped
matrix multiply in the weights' dtype, its output rows padded to 16 bytes), transformers' other experts
implementation and the router's load-balancing loss under the estimate, and the values refused. (Estimate vs cpu
in every setting and the knobs: test_families.py; config.json: test_hf.py; the image arithmetic is Qwen3-VL's:
test_qwen3_vl.py.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import meta_counts
from hand_counts import qwen3_moe_lm_params, qwen3_vl_vision_params
from test_families import BYTE_COLUMNS
from vlmprobe.errors import ConfigError
from vlmprobe.estimate.cuda_rules.grouped_mm import cuda_grouped_mm
from vlmprobe.models.base import DataShape
from vlmprobe.point.measure import measure

GROUPED_MM = torch.ops.aten._grouped_mm.default


@pytest.mark.parametrize("name,params,parts", [
    # the model card says "30B-A3B" (Qwen3-30B-A3B's 30.5B language model and a 0.5B vision tower)
    ("qwen3_vl_30b_a3b", 31_070_754_032, (538_631_408, 30_220_957_696, 311_164_928)),
    ("qwen3_vl_235b_a22b", 235_670_022_896, (576_388_336, 234_471_304_704, 622_329_856)),  # the card: "235B-A22B"
    ("qwen3_vl_moe_tiny", 304_320, (139_584, 131_968, 32_768)),  # layer 0 experts, layer 1 a dense MLP
])
def test_qwen3_vl_moe_on_meta_matches_the_hand_count_of_its_config(spec, name, params, parts):
    qwen = spec(name)
    assert meta_counts(qwen) == (params, parts)
    assert parts[0] == qwen3_vl_vision_params(qwen.vision)
    assert parts[1] == qwen3_moe_lm_params(qwen.text)


class GroupedMMs(TorchDispatchMode):
    """(shape, stride, dtype) of every _grouped_mm output, in order."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is GROUPED_MM:
            self.outputs.append((tuple(out.shape), out.stride(), out.dtype))
        return out


def grouped_mm_outputs(spec, fake: bool) -> list:
    """The _grouped_mm outputs of one forward and backward of the tiny MoE with fp32 weights under bf16 autocast
    (CUDA's autocast op policy), on real CPU tensors or on fake ones with the estimate's grouped_mm rule."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vlmprobe.estimate.cuda_rules.autocast_policy import cuda_autocast_policy

    qwen = spec("qwen3_vl_moe_tiny")
    data = DataShape(batch_size=2, lm_max_length=48)
    with FakeTensorMode() if fake else torch.device("cpu"), cuda_grouped_mm():
        model = qwen.build("cpu", torch.float32, init=not fake)
        batch = qwen.batch(data, torch.device("cpu"))
        recorded = GroupedMMs()
        with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16), recorded:
            loss, _ = qwen.loss(model, batch)
            loss.backward()
    return recorded.outputs


def test_fp32_experts_run_in_fp32_under_bf16_autocast_as_on_cuda_and_the_fake_kernel_agrees(spec):
    # CUDA's autocast has no kernel for grouped_mm, so the tokens (cast to the experts' dtype by transformers) and
    # the experts stay fp32; the estimate's meta rule must give what the real kernel gives, call by call
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_grouped_mm", "AutocastCUDA")
    real, fake = grouped_mm_outputs(spec, fake=False), grouped_mm_outputs(spec, fake=True)
    # one MoE layer: gate_up and down forward, then each one's input and weight gradients backward; 2 x 48
    # tokens x 2 experts each = 192 rows; widths 2 x 32 (gate and up) and 64
    assert real == fake == [((192, 64), (64, 1), torch.float32), ((192, 64), (64, 1), torch.float32),
                            ((8, 64, 32), (2048, 32, 1), torch.float32), ((192, 32), (32, 1), torch.float32),
                            ((8, 64, 64), (4096, 64, 1), torch.float32), ((192, 64), (64, 1), torch.float32)]


def test_cuda_pads_grouped_mm_output_rows_to_16_bytes_and_so_does_the_estimate():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), cuda_grouped_mm():
        tokens = torch.empty(12, 16, dtype=torch.bfloat16)
        experts = torch.empty(4, 20, 16, dtype=torch.bfloat16)  # 20 outputs: 40 bytes, padded to 48 (24 elements)
        offsets = torch.empty(4, dtype=torch.int32)
        out = torch._grouped_mm(tokens, experts.transpose(-2, -1), offs=offsets)
        assert (out.shape, out.stride()) == ((12, 20), (24, 1))
        assert out.untyped_storage().nbytes() == (11 * 24 + 20) * 2  # CUDA's empty_strided: up to the last element
        weights = torch._grouped_mm(tokens.t(), out, offs=offsets)  # a weight gradient: 2-D x 2-D, one per expert
        assert (weights.shape, weights.stride()) == ((4, 16, 20), (16 * 24, 24, 1))
        with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):  # 40-byte rows
            torch._grouped_mm(tokens.t(), torch.empty(12, 20, dtype=torch.bfloat16), offs=offsets)
        with pytest.raises(RuntimeError, match="same dtype"):
            torch._grouped_mm(tokens.float(), experts.transpose(-2, -1), offs=offsets)


def test_cudas_grouped_mm_rule_goes_in_where_torch_refuses_overrides_by_default(monkeypatch):
    # torch 2.11 (the GPU image) registers _grouped_mm's meta kernel from Python and its Library.impl refuses to
    # override a Python kernel unless allow_override=True (the default became True in 2.13, pytorch#182293): there
    # every estimate stopped entering cuda_grouped_mm. The same conditions here: 2.11's default and its record.
    import functools

    from torch import library

    impl = library.Library.impl
    monkeypatch.setattr(library.Library, "impl", functools.partialmethod(impl, allow_override=False))
    monkeypatch.setattr(library, "_impls", library._impls | {"aten/_grouped_mm/Meta"})
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), cuda_grouped_mm():
        out = torch._grouped_mm(torch.empty(12, 16), torch.empty(4, 20, 16).transpose(-2, -1),
                                offs=torch.empty(4, dtype=torch.int32))
        assert (out.dtype, out.stride()) == (torch.float32, (20, 1))  # fp32, which torch's own meta refuses


def test_torchs_own_meta_kernel_refuses_fp32_which_cuda_runs():
    # why estimate/grouped_mm.py exists: torch 2.13's meta kernel checks the CUTLASS fast path's dtypes (bf16
    # only), while CUDA's _grouped_mm_cuda falls back to a loop of mm for fp32. If this fails, torch's meta kernel
    # has caught up and the rule may be dropped.
    tokens, experts = torch.empty(12, 16, device="meta"), torch.empty(4, 20, 16, device="meta")
    with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
        torch._grouped_mm(tokens, experts.transpose(-2, -1), offs=torch.empty(4, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("extra", [["model.experts_implementation=batched_mm"],
                                   ["model.text.output_router_logits=true"]])
def test_batched_experts_and_the_router_loss_estimate_equals_the_cpu_backend_to_the_byte(plan_points, extra):
    base = ["model=qwen3_vl_moe_tiny", "data.batch_size=2", "data.lm_max_length=48", *extra]
    rows = {}
    for backend in ("estimate", "cpu"):
        (planned,) = plan_points([*base, f"measure.backend={backend}"])
        rows[backend] = measure(planned.config)
        assert rows[backend]["status"] == "ok", rows[backend].get("error")
    assert {k: rows["estimate"][k] for k in BYTE_COLUMNS} == {k: rows["cpu"][k] for k in BYTE_COLUMNS}


def test_batched_experts_keep_each_pairs_gathered_expert_weights(plan_points):
    # Kept for backward in the one MoE layer of the tiny model (bf16 weights, 192 (token, expert) pairs):
    # batched_mm gathers gate_up (64 x 64) and down (64 x 32) weights for every pair and its bmm keeps both
    # gathers, 192 x (64 x 64 + 64 x 32) x 2 B; grouped_mm keeps the same tokens, activations and routing weights
    # as batched_mm does, and beyond them three int64 index vectors of the pairs (the sort's permutation, the
    # token of each sorted pair, the inverse permutation: 192 x 8 = 1,536 B each) and the routing weights gathered
    # in sorted order (192 x 2 B, one 512 B block), which batched_mm reads in place
    rows = {}
    for experts in ("grouped_mm", "batched_mm"):
        (planned,) = plan_points(["model=qwen3_vl_moe_tiny", "data.batch_size=2", "data.lm_max_length=48",
                                  "train.param_dtype=bfloat16", "train.autocast_dtype=null", "measure.steps=1",
                                  f"model.experts_implementation={experts}", "measure.backend=estimate"])
        rows[experts] = measure(planned.config)
    gathered = 192 * (64 * 64 + 64 * 32) * 2
    grouped_only = 3 * 1536 + 512
    assert rows["batched_mm"]["activations_bytes"] - rows["grouped_mm"]["activations_bytes"] == gathered - grouped_only


@pytest.mark.parametrize("value,message", [
    ("eager", r"model.experts_implementation='eager' is not allowed for qwen3_vl_moe_tiny: use grouped_mm or "
              r"batched_mm \(eager's tensors are sized by how many tokens the router sends each expert"),
    ("sonicmoe", r"model.experts_implementation='sonicmoe' is not allowed for qwen3_vl_moe_tiny: use grouped_mm or "
                 r"batched_mm$"),
])
def test_an_experts_implementation_not_modelled_is_one_line(plan_points, value, message):
    with pytest.raises(ConfigError, match=message):
        plan_points(["model=qwen3_vl_moe_tiny", f"model.experts_implementation={value}"])


@pytest.mark.parametrize("top_k", [0, 9, "two"])
def test_routing_to_no_expert_or_more_than_there_are_is_one_line(plan_points, top_k):
    with pytest.raises(ConfigError, match=rf"model.text.num_experts_per_tok={top_k!r} is not allowed for "
                                          r"qwen3_vl_moe_tiny: each token goes to 1 to num_experts \(8\) experts"):
        plan_points(["model=qwen3_vl_moe_tiny", f"model.text.num_experts_per_tok={top_k}"])


def test_lora_on_the_experts_keeps_each_layers_merged_expert_weights(plan_points):
    # peft's target_parameters (ParamWrapper) adds B A to the whole expert stack in each forward (one baddbmm, in
    # the weights' dtype: fp32 here, autocast off for it) and the grouped multiply keeps that merged weight for
    # backward: gate_up 8 x 64 x 64 and down 8 x 64 x 32, x 4 B, in the tiny model's one MoE layer. With the
    # experts now trained through the adapters, each multiply also keeps its input for the weight's gradient: the
    # 192 sorted token rows (192 x 64 x 4 B) and the gated activations (192 x 32 x 4 B)
    base = ["model=qwen3_vl_moe_tiny", "data.batch_size=2", "data.lm_max_length=48", "measure.steps=1",
            "train.lora_r=4", "measure.backend=estimate"]
    rows, trainable = {}, {}
    for experts in ([], ["train.lora_target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"]):
        (planned,) = plan_points([*base, *experts])
        rows[bool(experts)], trainable[bool(experts)] = measure(planned.config), planned.inputs["trainable_params"]
        assert rows[bool(experts)]["status"] == "ok", rows[bool(experts)].get("error")
    merged = (8 * 64 * 64 + 8 * 64 * 32) * 4
    inputs = (192 * 64 + 192 * 32) * 4
    assert rows[True]["activations_bytes"] - rows[False]["activations_bytes"] == merged + inputs
    # the adapters: A (rank x experts, in) and B (out, rank x experts) for each of the two stacks
    assert trainable[True] - trainable[False] == 4 * 8 * (64 + 64) + 4 * 8 * (32 + 64)


def test_lora_on_a_parameter_the_model_does_not_have_is_one_line(plan_points):
    with pytest.raises(ConfigError, match=r"train.lora_target_parameters=\['mlp.experts.up_proj'\] is not allowed: no "
                                          r"parameter of the language model ends with mlp.experts.up_proj"):
        plan_points(["model=qwen3_vl_moe_tiny", "train.lora_r=4", "train.lora_target_parameters=[mlp.experts.up_proj]"])
