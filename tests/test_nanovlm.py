import pytest
import torch

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.models.nanovlm import IGNORE_INDEX, pixel_shuffle


def test_nanovlm_222m_has_49_image_tokens_inside_lm_max_length(spec):
    # 224 px / 16 px patches = 14 x 14 = 196 patches; pixel shuffle x2 -> 196 / 4 = 49 tokens
    data = DataShape(batch_size=2, lm_max_length=128)
    assert spec("nanovlm_222m").image_tokens(data) == 49


def test_batch_shapes_and_labels_match_a_hand_computation(spec):
    tiny = spec("nanovlm_tiny")  # 64 px, patch 16 -> 16 patches -> 4 tokens
    data = DataShape(batch_size=3, lm_max_length=20, images_per_sample=2)
    batch = tiny.batch(data, torch.device("cpu"))
    assert batch["input_ids"].shape == (3, 20)
    assert batch["pixel_values"].shape == (6, 3, 64, 64)
    assert batch["attention_mask"].shape == (3, 20) and bool(batch["attention_mask"].all())  # no padding
    assert tiny.image_tokens(data) == 8
    assert (batch["labels"][:, :8] == IGNORE_INDEX).all() and (batch["labels"][:, 8:] >= 0).all()


def test_hold_outputs_keeps_the_logits_alive_through_backward_and_the_optimizer_step(point):
    from vlmprobe.point.measure import measure

    base = ["model=nanovlm_tiny", "data.batch_size=4", "data.lm_max_length=64", "measure.backend=estimate",
            "train.autocast_dtype=null"]
    dropped, held = (measure(point(base + [f"measure.hold_outputs={h}"])) for h in ("false", "true"))
    logits = 4 * 64 * 512 * 4  # B x L x vocab x fp32
    assert held["backward_peak_bytes"] - dropped["backward_peak_bytes"] >= logits
    assert held["optimizer_peak_bytes"] - dropped["optimizer_peak_bytes"] >= logits


def test_pixel_shuffle_folds_each_2x2_block_of_patches_into_one_token():
    x = torch.arange(16).float().view(1, 16, 1)  # a 4 x 4 patch grid, width 1
    out = pixel_shuffle(x, 2)
    assert out.shape == (1, 4, 4)
    assert out[0, 0].tolist() == [0, 1, 4, 5]  # the top-left 2 x 2 block


def test_tiny_model_trains_one_step(spec):
    tiny = spec("nanovlm_tiny")
    model = tiny.build("cpu", torch.float32)
    batch = tiny.batch(DataShape(batch_size=2, lm_max_length=16), torch.device("cpu"))
    loss, logits = tiny.loss(model, batch)
    loss.backward()
    assert torch.isfinite(loss) and logits.shape == (2, 16, 512)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("data,message", [
    (DataShape(batch_size=1, lm_max_length=49), "data.lm_max_length=49 is too short for nanovlm_222m: the images take 49 tokens"),
    (DataShape(batch_size=1, lm_max_length=512, image_size=448), "data.image_size=448 is not allowed for nanovlm_222m"),
])
def test_validation_names_the_value_and_what_is_allowed(spec, data, message):
    with pytest.raises(ConfigError, match=message):
        spec("nanovlm_222m").validate(data)


def test_data_shape_rejects_non_positive_sizes():
    with pytest.raises(ConfigError, match=r"data.batch_size=0 is not allowed: it must be a positive integer"):
        DataShape.from_config({"batch_size": 0, "lm_max_length": 8})


def test_a_nanovlm_sweep_never_imports_transformers_modeling_code(tmp_path):
    # nanoVLM is our own modules: its points skip transformers' modeling code (~5 s of imports) in the sweep
    # process (planning, provenance, the report) and in the measurement, checkpointing included (LoRA is peft's,
    # which imports transformers)
    import subprocess
    import sys

    code = ("import runpy, sys\n"
            "sys.argv = ['vlmprobe', 'model=nanovlm_tiny', 'measure.backend=estimate', 'measure.steps=1',\n"
            "            'train.grad_ckpt.lm=true', 'results_dir=' + sys.argv[1]]\n"
            "try:\n"
            "    runpy.run_module('vlmprobe', run_name='__main__')\n"
            "finally:\n"
            "    print(sorted(m for m in sys.modules if m.startswith('transformers.')), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert "ok, peak" in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "[]", proc.stderr[-2000:]


def test_building_without_init_calls_no_torch_init_function_and_restores_them(spec, monkeypatch):
    from torch import nn

    from vlmprobe.models.base import torch_init_skipped

    calls = []
    for name in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_"):  # Linear, Conv2d, Embedding, norms
        monkeypatch.setattr(nn.init, name, lambda tensor, *args, _name=name, **kwargs: calls.append(_name))
    recorders = {name: getattr(nn.init, name) for name in ("kaiming_uniform_", "normal_")}
    spec("nanovlm_tiny").build(torch.device("meta"), torch.float32, init=False)
    assert not calls
    with torch_init_skipped():
        assert nn.init.normal_ is not recorders["normal_"]
    assert {name: getattr(nn.init, name) for name in recorders} == recorders
    nn.Linear(2, 2, device="meta")  # outside it, torch initialises as usual
    assert calls == ["kaiming_uniform_", "uniform_"]


@pytest.mark.parametrize("value", ["abc", 0, -8, True])
def test_a_bad_max_position_embeddings_is_refused_in_one_line_before_any_point_runs(value):
    """Read only in the forward (where RoPE's frequencies stretch past it): without the check a bad value
    surfaced as every point's error row."""
    from vlmprobe.config.plan import plan_overrides

    with pytest.raises(ConfigError, match=rf"^model.text.max_position_embeddings={value!r} is not allowed: give "
                                          rf"the positions RoPE covers, a positive integer"):
        plan_overrides(["+sweep=smoke", "model=nanovlm_tiny", f"model.text.max_position_embeddings={value}"])
