"""One sample as the memory of a training step sees it: its text tokens, its images' and videos' sizes.

Rule: sizes are what the files hold, before any processor resizes them (height, width in px; videos as frames
handed to the processor, height, width); text tokens exclude the image tokens, which the model family decides
(vlmprobe/dataset/image_tokens.py). `index` is the sample's place in its dataset, which the samplers permute.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Sample"]


@dataclass(frozen=True)
class Sample:
    index: int
    text_tokens: int
    images: tuple[tuple[int, int], ...] = ()  # (height, width) px each
    videos: tuple[tuple[int, int, int], ...] = ()  # (frames, height, width) each
    text_from: str = "given"  # how text_tokens was found: given, a tokenizer, or the stated estimate
