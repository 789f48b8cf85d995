"""LM tokens of one image of any (height, width), and of one video, per model family: each family's spec gives its
own rule (ModelSpec.image_tokens_at / video_tokens_at, vlmprobe/models/*.py: its processor's rule for square
images taken to both sides, read from transformers 5.25's processors); these functions ask the spec.

Families with a rule: Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4.1V (smart_resize), LLaVA 1.5 and Pixtral, LLaVA-NeXT
and LLaVA-OneVision (anyres), Mistral 3, SmolVLM / Idefics3, InternVL, DeepSeek-VL2, PaliGemma, Gemma 3, nanoVLM,
Llama 3.2 Vision; videos: Qwen2-VL and Qwen2.5-VL. Anything else (a family without a rule, or an object that is no
ModelSpec) is refused by name. The markers a processor writes around an image (vision_start / end) are the spec's
image_markers, counted by the plan (batches.lm_tokens), not here.
"""

from __future__ import annotations

from vlmprobe.models.base import ModelSpec

__all__ = ["image_tokens", "video_tokens"]


def image_tokens(spec, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> int:
    """LM tokens of one `height` x `width` px image for the family of `spec` (a ModelSpec): its image_tokens_at.
    ConfigError for a family without a rule, or an image its processor refuses."""
    if not isinstance(spec, ModelSpec):
        return ModelSpec.image_tokens_at(spec, height, width)  # the base refusal, naming what was given
    return spec.image_tokens_at(height, width, images_in_sample=images_in_sample, min_pixels=min_pixels,
                                max_pixels=max_pixels)


def video_tokens(spec, frames: int, height: int, width: int) -> int:
    """LM tokens of one video of `frames` frames (as handed to the processor) of `height` x `width` px for the
    family of `spec`: its video_tokens_at (Qwen2-VL and Qwen2.5-VL; any other family is refused)."""
    if not isinstance(spec, ModelSpec):
        return ModelSpec.video_tokens_at(spec, frames, height, width)  # the base refusal
    return spec.video_tokens_at(frames, height, width)
