"""Qwen2.5-VL: transformers' Qwen2_5_VLForConditionalGeneration with random weights. The processor, the image
arithmetic, the batch and the loss are Qwen2-VL's (qwen2_vl.py); what differs is the vision tower: RMSNorm blocks
with a gated SiLU MLP, and window attention over 4 x 4 merged tokens (112 x 112 px) except in the
`fullatt_block_indexes` blocks. The tower's own window indices have a data-dependent shape that fake tensors cannot
answer, so the collator computes them in pure Python (`window_index`) and passes them as constant inputs
(`image_window_index`, `image_cu_window_seqlens` and the video ones), which transformers 5.17-5.23 accepts
(vision_utils.get_vision_window_index).
"""

from __future__ import annotations

import torch

from vlmprobe.models.fake_constants import constant_tensor
from vlmprobe.models.qwen2_vl import Qwen2VLSpec

__all__ = ["window_index"]


def window_index(grids: list[tuple[int, int]], merge: int, window_size: int, patch: int) -> tuple[list[int], list[int]]:
    """(window_index, cu_window_seqlens) of still images with these (rows, cols) patch grids, as
    transformers' get_vision_window_index computes them: merged tokens renumbered window by window (windows
    row-major over a grid padded up to whole windows, tokens row-major inside a window), and the cumulative
    patch count at each window's end (consecutive repeats, from windows that are all padding, dropped)."""
    side = window_size // merge // patch  # merged tokens per window side
    order, bounds, offset = [], [0], 0
    for rows, cols in grids:
        llm_rows, llm_cols = rows // merge, cols // merge
        # transformers pads by side - n % side: a whole empty window row/column where n is a multiple of side
        windows_h = (llm_rows + side - llm_rows % side) // side
        windows_w = (llm_cols + side - llm_cols % side) // side
        for wh in range(windows_h):
            for ww in range(windows_w):
                inside = [r * llm_cols + c
                          for r in range(wh * side, min((wh + 1) * side, llm_rows))
                          for c in range(ww * side, min((ww + 1) * side, llm_cols))]
                order += [offset + i for i in inside]
                bounds.append(bounds[-1] + len(inside) * merge * merge)
        offset += llm_rows * llm_cols
    return order, [b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1]]


class Qwen2_5_VLSpec(Qwen2VLSpec):
    """Hydra target for conf/model/qwen2_5_vl_*.yaml."""

    config_class = "Qwen2_5_VLConfig"
    model_class = "Qwen2_5_VLForConditionalGeneration"

    def vision_inputs(self, grids: list[tuple[int, int]], device: torch.device, modality: str = "image") -> dict:
        # A video's windows are its frames' (transformers reshapes each video to (t, rows, cols) and cuts every
        # temporal patch into windows of its own), so one grid per temporal patch gives the video's index.
        order, bounds = window_index(grids, self.vision["spatial_merge_size"], self.vision["window_size"],
                                     self.vision["patch_size"])
        # dtypes as transformers makes them: int64 (an arange) and int32
        return {f"{modality}_window_index": constant_tensor(order, device),
                f"{modality}_cu_window_seqlens": constant_tensor(bounds, device, torch.int32)}

    def video_time_interval(self) -> float:
        """Qwen2.5-VL's M-RoPE temporal step: vision_config.tokens_per_second x second_per_grid_t, the seconds one
        temporal patch spans (temporal_patch_size / fps, as Qwen2_5_VLProcessor computes it)."""
        return self.config().vision_config.tokens_per_second * self.vision["temporal_patch_size"] / self.video_fps
