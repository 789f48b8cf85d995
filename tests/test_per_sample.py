"""The bytes one more sample costs at the step's peak: the estimate charges exactly the tensor families that
scripts/check_per_sample.py counts by hand from the model's dimensions (nanoVLM's step as measure_vram.py runs
it: fp32 weights, bf16 autocast, the logits held), to the byte, at two lengths (the LM terms grow with the
length, the ViT terms do not)."""

from conftest import load_script


def test_estimate_per_sample_bytes_are_the_hand_count():
    script = load_script("check_per_sample")
    peaks = script.estimate_peaks([128, 512], ("model=nanovlm_tiny",))
    model = next(iter(peaks.values()))["model"]
    assert model["name"] == "nanovlm_tiny"
    for length in (128, 512):
        hand = sum(size for _, _, size in script.hand_count(model, length))
        assert script.per_sample(peaks, length, "requested") == hand, length
