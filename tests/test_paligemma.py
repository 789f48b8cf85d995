"""PaliGemma 2: exact sizes from the config, the processor's image arithmetic against the real image processor and
the model's own image features, the prefix / suffix split PaliGemmaProcessor makes, and what the model cannot run
refused. (Estimate vs cpu and the knobs: test_families.py.)"""

import pytest
import torch

from hand_counts import llama_params, siglip_params
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, count_params
from vlmprobe.models.paligemma import NEWLINE

CPU = torch.device("cpu")


def gemma2_lm_params(t: dict) -> int:
    """Hand count of the Gemma 2 LM without its (tied) head: embedding, per layer q/k/v/o without bias, a gated
    MLP without bias and four RMSNorms (before and after the attention and the MLP), the final norm."""
    d, f, head = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * head, t["num_key_value_heads"] * head
    layer = 2 * d * q + 2 * d * kv + 3 * d * f + 4 * d
    return t["vocab_size"] * d + t["num_hidden_layers"] * layer + d


# the Hub's safetensors counts, "2.92B" and "3.03B" (recalled, no hub access here), equal to the hand counts below;
# Gemma 1's layers have Llama's shape (two RMSNorms, a gated MLP), Gemma 2's four RMSNorms
@pytest.mark.parametrize("name,params,lm_params,hand_count,attention", [
    ("paligemma_3b_224", 2_923_466_480, 2_508_662_784, llama_params, "sdpa"),
    ("paligemma2_3b_224", 3_032_242_416, 2_617_143_552, gemma2_lm_params, "eager"),
])
def test_paligemma_on_meta_has_the_published_parameter_count(spec, name, params, lm_params, hand_count, attention):
    pali = spec(name)
    model = pali.build("meta", torch.bfloat16, init=False)
    assert count_params(model) == (params, params)
    assert count_params(model.model.vision_tower)[0] == siglip_params(pali.vision) == 412_442_352
    assert count_params(model.model.language_model)[0] == hand_count(pali.text) == lm_params
    d_v, d = pali.vision["hidden_size"], pali.text["hidden_size"]
    assert count_params(model.model.multi_modal_projector)[0] == d_v * d + d  # one Linear with bias
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied: counted once
    assert model.config.text_config._attn_implementation == attention  # Gemma 2 has no SDPA path


def test_paligemma2_3b_448_is_the_224_px_model_with_the_448_px_towers_position_embeddings(spec):
    at_224, at_448 = (spec(name).build("meta", torch.bfloat16, init=False)
                      for name in ("paligemma2_3b_224", "paligemma2_3b_448"))
    assert count_params(at_448)[0] == 3_033_127_152 == count_params(at_224)[0] + (32**2 - 16**2) * 1152
    assert spec("paligemma2_3b_448").image_tokens(DataShape(1, 2048)) == 1024


def test_pixel_values_have_the_shape_the_real_image_processor_gives(spec):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    from transformers import SiglipImageProcessorPil

    # google/paligemma2-3b-pt-224's preprocessor: SiglipImageProcessor resizing to 224 x 224, whatever the input
    processor = SiglipImageProcessorPil(size={"height": 224, "width": 224})
    real = processor(images=[image.fromarray(np.zeros((500, 300, 3), dtype=np.uint8))] * 2, return_tensors="pt")
    tiny = spec("paligemma_tiny", "model.vision.image_size=224", "model.vision.patch_size=56")  # the 3B's geometry
    ours = tiny.batch(DataShape(batch_size=2, lm_max_length=64), CPU)
    assert ours["pixel_values"].shape == real["pixel_values"].shape == (2, 3, 224, 224)
    assert ours["pixel_values"].dtype == real["pixel_values"].dtype


def test_the_prefix_is_laid_out_as_the_real_processor_lays_it_out(spec):
    """PaliGemmaProcessor itself (a SigLIP image processor at the tiny tower's size and a word-level tokenizer built
    offline, whose ids stand for Gemma's) on an image, an empty prompt and a suffix: the same prefix (the image
    tokens, <bos>, the newline), token type 0 exactly over it, and labels that are the ids with -100 over it."""
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PaliGemmaProcessor, PreTrainedTokenizerFast, SiglipImageProcessorPil

    tiny = spec("paligemma_tiny")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "\n": 4, "a": 5}, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"\n| "), behavior="isolated")
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = tiny.tokens_per_image()  # what the Hub's preprocessor_config.json carries
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"))
    real = processor(text=["<image>"], images=[image.fromarray(np.zeros((50, 40, 3), dtype=np.uint8))],
                     suffix=["a a a"], return_tensors="pt")
    as_ours = {processor.image_token_id: tiny.image_token_id, 4: NEWLINE}  # <bos> is 2 in both
    real_ids = [as_ours.get(i, i) for i in real["input_ids"][0].tolist()]
    prefix = real["token_type_ids"][0].tolist().index(1)
    ours = tiny.batch(DataShape(batch_size=1, lm_max_length=48), CPU)
    assert prefix == tiny.tokens_per_image() + 2
    assert ours["input_ids"][0, :prefix].tolist() == real_ids[:prefix]
    assert (ours["token_type_ids"][0, :prefix] == 0).all() and (ours["token_type_ids"][0, prefix:] == 1).all()
    assert torch.equal(real["labels"], real["input_ids"].masked_fill(real["token_type_ids"] == 0, IGNORE_INDEX))
    assert torch.equal(ours["labels"], ours["input_ids"].masked_fill(ours["token_type_ids"] == 0, IGNORE_INDEX))


def test_the_prefix_attends_both_ways_and_only_the_suffix_is_learned(spec):
    """PaliGemmaProcessor's layout: <image> x tokens per image, <bos>, the prompt, "\\n" (token type 0), then the
    suffix (type 1); its labels are the ids with -100 wherever the token type is 0."""
    tiny = spec("paligemma_tiny")
    batch = tiny.batch(DataShape(batch_size=3, lm_max_length=64, images_per_sample=2), CPU)
    ids, labels, types = batch["input_ids"], batch["labels"], batch["token_type_ids"]
    assert ids.shape == labels.shape == types.shape == (3, 64)
    prefix = 2 * 16 + 2
    assert (ids[:, :32] == tiny.image_token_id).all() and (ids[:, 32] == 2).all()
    assert (types[:, :prefix] == 0).all() and (types[:, prefix:] == 1).all()
    assert torch.equal(labels, ids.masked_fill(types == 0, IGNORE_INDEX))
    assert (ids[:, prefix:] < tiny.image_token_id).all() and batch["pixel_values"].shape == (6, 3, 32, 32)


@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_attention_other_than_eager_is_refused_with_the_reason(plan_points, attention):
    with pytest.raises(ConfigError, match=rf"model.attn_implementation='{attention}' is not allowed for "
                                          rf"paligemma2_3b_224: transformers gives Gemma 2's attention no SDPA path"):
        plan_points(["model=paligemma2_3b_224", f"model.attn_implementation={attention}"])
