"""train.quantization (QLoRA): the stand-in keeps and allocates what bitsandbytes' CUDA path does (hand counts
from bitsandbytes 0.50.2's code, without bitsandbytes), matches real bitsandbytes on the cpu backend where both
run the same code (skipped without bitsandbytes); the row's trainable parameters are what the run trains (bad values:
test_bad_input.py)."""

import importlib.util

import pytest
import torch
from conftest import CONF
from hydra.utils import instantiate
from omegaconf import OmegaConf

from vlmprobe.backends import get
from vlmprobe.point.measure import measure
from vlmprobe.quantization import bnb_standin, layers_to_quantize
from vlmprobe.quantization.accounting import block, kept_bytes, layer_bytes

NF4 = {"quantization": "nf4", "quantization_double_quant": True, "quantization_compute_dtype": "bfloat16", "lora_r": 8}
INT8 = {**NF4, "quantization": "int8"}
OUT, IN, ROWS = 512, 256, 4096  # a layer and the rows (tokens) of its input: over 1536, CUDA's dequantize path
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def tiny_spec():
    return instantiate(OmegaConf.to_container(OmegaConf.load(CONF / "model" / "qwen2_vl_tiny.yaml")), _convert_="all")


def layer(backend: str, train: dict, replace) -> dict:
    return layer_bytes(get(backend), train, replace, (OUT, IN), ROWS)


def test_nf4_stand_in_keeps_and_allocates_what_bitsandbytes_cuda_path_does_by_hand():
    got = layer("estimate", NF4, bnb_standin.replace)
    n, blocks = OUT * IN, OUT * IN // 64
    assert got["kept"] == kept_bytes(OUT, IN, "nf4", True) - 2 * n  # the bf16 weight goes, its 4-bit state comes
    out = block(ROWS * OUT * 2)
    # forward: the output, and during the matmul the nested absmax dequantized + offset (two fp32 [blocks]) and
    # the weight dequantized in bf16 (_dequant_linear_fallback)
    assert got["forward"] == out + 2 * block(4 * blocks) + block(2 * n)
    # backward: the sum and its gradient (one block each), then functional.dequantize_4bit (the fp32 absmax, freed
    # when it returns, and the bf16 weight), which lives through the matmul with the input's gradient
    assert got["backward"] == 2 * 512 + block(2 * n) + block(ROWS * IN * 2)


def test_quantizing_a_loaded_weight_holds_what_bitsandbytes_cuda_path_allocates_by_hand():
    n, blocks = OUT * IN, OUT * IN // 64
    got = layer("estimate", NF4, bnb_standin.replace)
    # quantize_4bit: the op's fp32 absmax and the packed codes, the 16-value table; then the mean (one block), the
    # absmax less it (fp32), the dynamic map made once (1 KiB), the nested fp32 absmax, the uint8 codes, the map's copy
    assert got["quantizing"] == (2 * block(4 * blocks) + block(n // 2) + 512 + 512 + 1024 + block(4 * blocks // 256)
                                 + block(blocks) + 1024)
    # Int8Params._quantize: an fp16 copy of the weight, the fp32 row scales, the int8 rows
    assert layer("estimate", INT8, bnb_standin.replace)["quantizing"] == block(2 * n) + block(4 * OUT) + block(n)


def test_double_quant_off_keeps_fp32_absmax_per_block():
    got = layer("estimate", {**NF4, "quantization_double_quant": False}, bnb_standin.replace)
    assert got["kept"] == kept_bytes(OUT, IN, "nf4", False) - 2 * OUT * IN


def test_int8_stand_in_keeps_int8_weight_and_row_scales():
    got = layer("estimate", INT8, bnb_standin.replace)
    assert got["kept"] == kept_bytes(OUT, IN, "int8") - 2 * OUT * IN


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed (pip install -e \".[quant]\")")
def test_stand_in_matches_real_bitsandbytes_on_cpu_where_both_run_the_same_code():
    from vlmprobe.quantization import bnb_real

    for train in (NF4, INT8):
        real, standin = layer("cpu", train, bnb_real.replace), layer("estimate", train, bnb_standin.replace)
        # backward is the same code on CPU and CUDA (dequantize_4bit / CB.to(dtype).mul_): equal to the byte
        assert real["backward"] == standin["backward"], train["quantization"]
    # kept: bitsandbytes makes the 16-value 4-bit code from Python data (torch.tensor), which the cpu tracker
    # does not see (a CUDA run allocates it): one 512-byte block
    real, standin = layer("cpu", NF4, bnb_real.replace), layer("estimate", NF4, bnb_standin.replace)
    assert standin["kept"] - real["kept"] == 512


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed (pip install -e \".[quant]\")")
def test_the_loaded_base_is_what_from_pretrained_with_a_bitsandbytes_config_gives(tmp_path):
    """transformers' own from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)) of a
    saved checkpoint, on the cpu: every parameter and buffer, its shape, dtype and module type, as the loader makes
    them."""
    import transformers

    from vlmprobe.quantization import load

    spec = tiny_spec()
    spec.build("cpu", torch.bfloat16).save_pretrained(tmp_path)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    real = getattr(transformers, spec.model_class).from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu",
                                                                   quantization_config=config)
    ours = load(spec, torch.device("cpu"), torch.bfloat16, NF4, "cpu")

    def tensors(model):
        return sorted((f"{name}.{key}", tuple(t.shape), t.dtype, type(module).__name__)
                      for name, module in model.named_modules()
                      for key, t in [*module._parameters.items(), *module._buffers.items()] if t is not None)

    assert tensors(ours) == tensors(real)


def test_qlora_loads_its_base_weight_by_weight_never_whole_in_16_bit(plan_points):
    """The build's peak is the quantized base plus at most one 16-bit weight and its quantization's buffers (the
    largest layer's, by hand), far below the 16-bit model that building it whole and quantizing after would hold."""
    lora = measure(plan_point(plan_points).config)
    qlora = measure(plan_point(plan_points, "train.quantization=nf4").config)
    model = tiny_spec().build("meta", torch.bfloat16, init=False)
    largest = max(model.get_submodule(name).weight.numel() for name in layers_to_quantize(model))
    blocks = -(largest // -64)
    one_weight = block(2 * largest) + 2 * block(4 * blocks) + block(largest // 2) + 4096 + block(blocks)
    assert qlora["build_peak_bytes"] <= qlora["after_load_bytes"] + one_weight  # the base stays, adapters come
    assert qlora["build_peak_bytes"] < lora["build_peak_bytes"]


def plan_point(plan_points, *extra):
    (planned,) = plan_points(["model=qwen2_vl_tiny", "data.batch_size=1", "data.lm_max_length=64",
                              "measure.backend=estimate", "train.lora_r=4", "train.param_dtype=bfloat16",
                              "train.autocast_dtype=null", *extra])
    return planned


def test_qlora_on_a_tiny_vlm_trains_what_its_row_says_on_a_smaller_base(plan_points):
    adapters = plan_point(plan_points, "train.freeze_vision=true")  # LoRA alone: its fp32 adapters (merger frozen)
    lora = plan_point(plan_points)
    frozen = plan_point(plan_points, "train.freeze_vision=true", "train.quantization=nf4")
    qlora = plan_point(plan_points, "train.quantization=nf4")
    assert qlora.inputs["quantization"] == "nf4" and qlora.inputs["params"] == lora.inputs["params"]
    assert frozen.inputs["trainable_params"] == adapters.inputs["trainable_params"]
    # the vision tower's linear layers are quantized too (as transformers does), so they no longer train
    assert adapters.inputs["trainable_params"] < qlora.inputs["trainable_params"] < lora.inputs["trainable_params"]
    out = measure(qlora.config)
    assert out["status"] == "ok"
    n_adapters = adapters.inputs["trainable_params"]
    # the run allocates gradients for what the row counts: the fp32 adapters and the bf16 vision parameters left
    assert out["grads_bytes"] == 4 * n_adapters + 2 * (qlora.inputs["trainable_params"] - n_adapters)
    assert out["params_bytes"] < 2 * lora.inputs["params"]  # less than the bf16 weights


def test_a_model_transformers_cannot_quantize_is_a_skipped_row(plan_points):
    (planned,) = plan_points(["model=nanovlm_tiny", "train.lora_r=4", "train.quantization=nf4",
                              "measure.backend=estimate"])
    assert planned.skip.startswith("train.quantization=nf4: NanoVLM")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed (pip install -e \".[quant]\")")
def test_nf4_on_a_tiny_vlm_is_real_bitsandbytes_on_cpu_but_for_its_code_tables(plan_points):
    """Every phase of a whole step, real bitsandbytes on cpu vs the stand-in on estimate: apart only by the 4-bit
    code table of each quantized layer and the dynamic map made once a process (1 KiB), which bitsandbytes makes
    from Python data (uncounted on cpu)."""
    rows = {}
    for backend in ("cpu", "estimate"):
        planned = plan_point(plan_points, "train.quantization=nf4", f"measure.backend={backend}")
        rows[backend] = measure(planned.config)
    spec = instantiate(planned.config["model"], _convert_="all")
    layers = len(layers_to_quantize(spec.build("meta", torch.bfloat16, init=False)))
    for key in ("after_load_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes"):
        assert rows["estimate"][key] - rows["cpu"][key] == 512 * layers + 1024, key


@pytest.mark.slow
def test_a_7b_qlora_point_fits_a_t4_with_a_build_peak_of_its_quantized_base(plan_points):
    """Qwen2-VL-7B in nf4 on a 15 GB T4, the card people run it on: the load never holds the 16-bit model (15.2e9 B
    of weights), so the point runs, and the card's figure is there."""
    (planned,) = plan_points(["model=qwen2_vl_7b", "device=t4", "data.batch_size=1", "data.lm_max_length=1024",
                              "measure.backend=estimate", "train.lora_r=16", "train.quantization=nf4",
                              "train.quantization_compute_dtype=float16", "train.param_dtype=float16",
                              "train.autocast_dtype=null", "train.grad_ckpt.lm=true"])
    row = measure(planned.config)
    assert row["status"] == "ok"
    assert row["build_peak_bytes"] < 7 * 2**30 < 2 * planned.inputs["params"]
    assert row["peak_reserved_bytes"] < row["predicted_device_bytes"] <= 15_828_320_256
