import pytest
import torch

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import DataShape
from vlmprobe.models.nanovlm import IGNORE_INDEX, pixel_shuffle


@pytest.fixture
def spec(compose):
    from hydra.utils import instantiate

    return lambda name: instantiate(compose([f"model={name}"]).model, _convert_="all")


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
    from vlmprobe.worker import measure

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
