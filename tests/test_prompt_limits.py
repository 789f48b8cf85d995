"""What every family refuses where the processor decides the image, one table each: an image size its processor
would not keep (the family's native size is the only one it gives the model), and a sequence too short for the
images' tokens and their framing. Each row's figures are the family's own (a hand count beside it)."""

import pytest

from vlmprobe.errors import ConfigError

# model, a size the processor changes, its native size, the native size's image tokens, who resizes and how
NATIVE_SIZE_ONLY = [
    ("paligemma2_3b_224", [1, 448, 896], 224, 256, "PaliGemmaProcessor resizes every image to 224 x 224 px"),
    ("gemma3_4b", [1, 448, 897], 896, 256, "Gemma3ImageProcessor resizes every image to 896 x 896 px"),
    ("llava_1_5_7b", [1, 224, 337, 672], 336, 576, "its processor resizes and center-crops every image to 336 x 336 px"),
]


@pytest.mark.parametrize("model,sizes,native,tokens,resizes", NATIVE_SIZE_ONLY, ids=[r[0] for r in NATIVE_SIZE_ONLY])
def test_an_image_size_the_processor_would_change_is_refused_and_the_native_one_taken(plan_points, model, sizes,
                                                                                       native, tokens, resizes):
    for size in sizes:
        with pytest.raises(ConfigError, match=rf"^data.image_size={size} is not allowed for {model}: {resizes}"):
            plan_points([f"model={model}", f"data.image_size={size}", "data.lm_max_length=2048"])
    for size in (native, "null"):
        (point,) = plan_points([f"model={model}", f"data.image_size={size}", "data.lm_max_length=2048"])
        assert point.inputs["image_size"] == native and point.inputs["image_tokens"] == tokens


def test_an_image_size_beyond_idefics3s_cap_is_refused_and_its_longest_edge_taken(plan_points):
    with pytest.raises(ConfigError, match=r"^data.image_size=4097 is not allowed for smolvlm_256m: Idefics3ImageProcessor "
                                          r"scales every image down to at most 4096 px per side"):
        plan_points(["model=smolvlm_256m", "data.image_size=4097", "data.lm_max_length=8192"])
    (point,) = plan_points(["model=smolvlm_256m", "data.image_size=null", "data.lm_max_length=2048"])
    assert point.inputs["image_size"] == 2048 and point.inputs["image_tokens"] == 1088


# overrides, and the line: the images' tokens, what the processor writes beside them, and the least length that
# holds both and one text token
TOO_SHORT = {
    "paligemma": (["model=paligemma2_3b_224", "data.lm_max_length=258"],
                  "data.lm_max_length=258 is too short for paligemma2_3b_224: the images take 256 tokens plus <bos> "
                  "and the prefix's newline, so it must be at least 259"),
    "gemma3": (["model=gemma3_4b", "data.lm_max_length=261"],  # <start_of_image>, 256 tokens, <end_of_image>, 2 newlines
               "data.lm_max_length=261 is too short for gemma3_4b: the images take 256 tokens plus 4 markers each and "
               "<bos>, so it must be at least 262"),
    # 4 x 4 tiles + global: (64 + 3) + 4 x (4 x (64 + 2) + 1) = 1127 tokens, plus a start token and a text token
    "idefics3": (["model=smolvlm_256m", "data.lm_max_length=1024"],
                 "data.lm_max_length=1024 is too short for smolvlm_256m at 2048 px: the images take 1088 tokens plus "
                 "the processor's tile markers, so it must be at least 1129"),
    # 1000 px: 9 tiles + thumbnail = 10 x 256
    "internvl": (["model=internvl3_2b", "data.image_size=1000", "data.lm_max_length=2000"],
                 "data.lm_max_length=2000 is too short for internvl3_2b at 1000 px: the images take 2560 tokens plus "
                 "<img> and </img> each, so it must be at least 2563"),
    "llava": (["model=llava_1_5_7b", "data.lm_max_length=577"],  # 24 x 24 patches of a 336 px image
              "data.lm_max_length=577 is too short for llava_1_5_7b: the images take 576 tokens plus <s>, so it must "
              "be at least 578"),
    "qwen3_vl": (["model=qwen3_vl_8b", "data.lm_max_length=198"],  # 448 px: 14 x 14 merged 32 px blocks
                 "data.lm_max_length=198 is too short for qwen3_vl_8b at 448 px: the images take 196 tokens plus 2 "
                 "vision markers each, so it must be at least 199"),
}


@pytest.mark.parametrize("family", TOO_SHORT)
def test_a_sequence_too_short_for_the_image_tokens_is_refused(plan_points, family):
    overrides, line = TOO_SHORT[family]
    with pytest.raises(ConfigError) as refused:
        plan_points(overrides)
    assert str(refused.value) == line
