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


def test_the_first_batch_size_of_measure_vrams_one_process_loop_is_the_fresh_point():
    """scripts/check_one_process.py runs the batch sizes one after another in one session: before the first
    nothing ran, so its peak is the worker's own estimate of that point, to the byte; later ones differ only by
    what the loop left behind."""
    script = load_script("check_one_process")
    configs = script.points(64, [2, 4], "rtx3090", "nanovlm_tiny")
    alone, together = script.fresh(configs), script.one_process(configs)
    assert alone[2] == together[2] and together[4] is not None
