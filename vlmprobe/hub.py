"""Hugging Face Hub names: what one looks like, and the ids of the models vlmprobe ships a config for:
`model=Qwen/Qwen2.5-VL-7B-Instruct` is `model=qwen2_5_vl_7b`. Plain data, no torch: the command line reads it
before anything heavy is imported. An instruct or base checkpoint of the same architecture maps to the same config (the
weights differ, the shapes do not). Ids match without regard to case, as the Hub resolves them."""

from __future__ import annotations

import re

__all__ = ["HUB_IDS", "HUB_NAME", "shipped_option"]

HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")  # ORG/NAME

HUB_IDS = {
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2_vl_2b", "Qwen/Qwen2-VL-2B": "qwen2_vl_2b",
    "Qwen/Qwen2-VL-7B-Instruct": "qwen2_vl_7b", "Qwen/Qwen2-VL-7B": "qwen2_vl_7b",
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2_5_vl_3b", "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl_7b",
    "Qwen/Qwen2.5-VL-72B-Instruct": "qwen2_5_vl_72b",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl_8b", "Qwen/Qwen3-VL-8B-Thinking": "qwen3_vl_8b",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_30b_a3b", "Qwen/Qwen3-VL-30B-A3B-Thinking": "qwen3_vl_30b_a3b",
    "Qwen/Qwen3-VL-235B-A22B-Instruct": "qwen3_vl_235b_a22b", "Qwen/Qwen3-VL-235B-A22B-Thinking": "qwen3_vl_235b_a22b",
    "zai-org/GLM-4.1V-9B-Thinking": "glm4_1v_9b", "zai-org/GLM-4.1V-9B-Base": "glm4_1v_9b",
    "zai-org/GLM-4.5V": "glm4_5v",
    "OpenGVLab/InternVL3-2B-hf": "internvl3_2b",
    "meta-llama/Llama-3.2-11B-Vision-Instruct": "llama3_2_11b_vision", "meta-llama/Llama-3.2-11B-Vision": "llama3_2_11b_vision",
    "llava-hf/llava-1.5-7b-hf": "llava_1_5_7b", "llava-hf/llava-v1.6-mistral-7b-hf": "llava_v1_6_mistral_7b",
    "llava-hf/llava-onevision-qwen2-7b-ov-hf": "llava_onevision_qwen2_7b",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": "mistral_small_3_1_24b",
    "mistralai/Mistral-Small-3.1-24B-Base-2503": "mistral_small_3_1_24b",
    "mistral-community/pixtral-12b": "pixtral_12b",
    "google/paligemma-3b-pt-224": "paligemma_3b_224", "google/paligemma2-3b-pt-224": "paligemma2_3b_224",
    "google/paligemma2-3b-pt-448": "paligemma2_3b_448",
    "google/gemma-3-4b-it": "gemma3_4b", "google/gemma-3-4b-pt": "gemma3_4b",
    "deepseek-ai/deepseek-vl2-tiny": "deepseek_vl2_tiny", "deepseek-ai/deepseek-vl2-small": "deepseek_vl2_small",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "smolvlm_256m", "HuggingFaceTB/SmolVLM-Instruct": "smolvlm_2b",
}
_BY_LOWER = {key.lower(): option for key, option in HUB_IDS.items()}


def shipped_option(hub_id: str) -> str | None:
    """The conf/model option of a Hub id vlmprobe ships a config for, or None."""
    return _BY_LOWER.get(hub_id.lower())
