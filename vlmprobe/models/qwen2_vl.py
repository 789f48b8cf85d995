"""Qwen2-VL: transformers' Qwen2VLForConditionalGeneration with random weights, fed as its processor feeds it.

Images (Qwen2VLImageProcessor) and videos (Qwen2VLVideoProcessor, transformers 5.24) are re-implemented as pure
arithmetic: `smart_resize` (sides multiples of 28 px, pixels within the bounds; the video cap lowered as
qwen-vl-utils lowers it), 3 x 2 x 14 x 14 patches merged 2 x 2 into LM tokens. The batch is what a training collator
hands the model, M-RoPE position_ids included (`mrope_position_ids`: the model's get_rope_index rule, whose fresh
aranges fake mode cannot make constant). attention_mask is None: every sample fills lm_max_length, and a mask would
make a (B, 1, L, L) tensor that a CUDA run without padding never allocates. The small integer inputs the forward
reads are constant fakes (vlmprobe/models/fake_constants.py). Vision attention is "sdpa", split per image at
cu_seqlens; "flash_attention_2" is not modelled. Qwen2.5-VL (qwen2_5_vl.py) and Qwen3-VL (qwen3_vl.py) subclass
Qwen2VLSpec.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, ModelSpec, dataset_samples, filler_text, hyperparameters
from vlmprobe.models.fake_constants import collated, constant_tensor
from vlmprobe.models.packing import packed, packed_rows, padded_or_packed, restarting

__all__ = ["Qwen2VLSpec", "smart_resize"]


# qwen-vl-utils 0.0.14 (vision_process.py): VIDEO_MIN_TOKEN_NUM, VIDEO_MAX_TOKEN_NUM per frame, and MODEL_SEQ_LEN,
# the tokens whose 90 % make a video's default total pixel budget
QWEN_VL_UTILS_VIDEO_TOKENS = (128, 768)
QWEN_VL_UTILS_SEQ_LEN = 128_000


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 frames: int = 1, scale_up_small_sides: bool = False) -> tuple[int, int]:
    """(H, W) the Qwen2-VL image processor resizes a `height` x `width` image to (transformers'
    qwen2_vl smart_resize, 5.17-5.24): each side rounded to a multiple of `factor`, then scaled down
    (floor) if H*W > max_pixels or up (ceil) if H*W < min_pixels, keeping the aspect ratio.

    GLM-4.1V's processor (glm4v smart_resize) is this rule with two changes: the bounds hold the pixels of all
    `frames` of the temporal patch (a still image is its 2 frames, so the bounds per image are halved), and
    `scale_up_small_sides`: a side below `factor` is first scaled up to it (Qwen2-VL's callers refuse such a side
    before: Qwen2VLSpec._resized)."""
    if scale_up_small_sides and (height < factor or width < factor):
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor  # Python's round: halves go to the even multiple, as in transformers
    w_bar = round(width / factor) * factor
    if frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def mrope_position_ids(layout: list[tuple[str, int | tuple]]) -> list[list[int]]:
    """3 rows (t, h, w) of M-RoPE positions for one sample, as Qwen2VLModel.get_rope_index computes them:
    text tokens advance all three by 1; a still image of (rows, cols) merged tokens at position p takes
    (p, p + row, p + col), a video's temporal patch i adds int(i x interval) to the first, and the next token
    continues at p + max(rows, cols). `layout` is a list of ("text", n_tokens), ("image", (rows, cols)) and
    ("video", (temporal_patches, rows, cols, interval)) runs."""
    t, h, w = [], [], []
    pos = 0
    for kind, size in layout:
        if kind == "text":
            run = range(pos, pos + size)
            t += run
            h += run
            w += run
            pos += size
            continue
        frames, rows, cols, interval = (1, *size, 1) if kind == "image" else size
        for i in range(frames):
            for r in range(rows):
                t += [pos + int(i * interval)] * cols  # transformers: (arange(t) * interval).long(), a truncation
                h += [pos + r] * cols
                w += range(pos, pos + cols)
        pos += max(rows, cols)
    return [t, h, w]


DEFAULT_IMAGE_SIZE = 448  # px per side when data.image_size is null (no native size): 1024 patches, 256 tokens


class Qwen2VLSpec(ModelSpec):
    """Hydra target for conf/model/qwen2_vl_*.yaml."""

    # -- what differs between Qwen2-VL and Qwen2.5-VL (subclasses override these) ------------------------
    config_class = "Qwen2VLConfig"  # transformers classes, by name (imported when a model is built)
    model_class = "Qwen2VLForConditionalGeneration"
    # Qwen2-VL's preprocessor_config.json (the same for Qwen2.5-VL): a config.json read without one gets these
    published_pixels = (3136, 12845056)  # 56 * 56; 16384 * 28 * 28 (transformers' class default is 1280 * 28 * 28)
    # Qwen2VLVideoProcessor's class defaults (size.shortest_edge / longest_edge, transformers 5.24), qwen-vl-utils'
    # VIDEO_MIN_PIXELS / VIDEO_MAX_PIXELS too: px per frame, 128 and 768 tokens' worth
    video_pixels = (128 * 28 * 28, 768 * 28 * 28)
    video_fps = 2.0  # frames per second the processor assumes (its default): Qwen2.5-VL's M-RoPE time step reads it
    reads_video_preprocessor = True
    # the top-level config keys of the special tokens (text ids lie below all of them), and the two that frame
    # each image and video in the prompt
    token_keys = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    markers = ("vision_start_token_id", "vision_end_token_id")
    image_markers = len(markers)
    frames_in_budget = 1  # frames smart_resize counts against the pixel bounds for a still image (GLM-4.1V: 2)
    scales_up_small_sides = False  # a side below patch x merge px: scaled up to it (GLM), else refused (_resized)
    frame_timestamps_as_text = False  # the processor writes each frame's timestamp as text (videos then refused)

    def __init__(self, name: str, image_size: int, min_pixels: int, max_pixels: int, token_ids: dict,
                 vision: dict, text: dict, tie_word_embeddings: bool, attn_implementation: str = "sdpa",
                 video_min_pixels: int | None = None, video_max_pixels: int | None = None):
        self.name = name
        self.native_image_size = image_size  # Qwen2-VL has no native size (dynamic resolution): the default side
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.video_min_pixels = video_min_pixels or self.video_pixels[0]
        self.video_max_pixels = video_max_pixels or self.video_pixels[1]
        self.token_ids = dict(token_ids)
        self.vision = dict(vision)
        self.text = dict(text)
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_implementation = attn_implementation
        self.factor = self.vision["patch_size"] * self.vision["spatial_merge_size"]

    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None,
                       video_preprocessor: dict | None = None):
        """The spec of a model's config.json (`raw`), read through transformers' own config class (which
        accepts both the flat layout of the Hub's configs and the nested one newer versions save, and the
        legacy rope_scaling), and of its preprocessor_config.json where there is one (pixel bounds). Video
        bounds as transformers 5.24's video processor loader finds them: video_preprocessor_config.json, else
        preprocessor_config.json (the image bounds: a folder without the video file gives videos those), else
        the class defaults."""
        import transformers

        config = getattr(transformers, cls.config_class)(**raw)
        text, vision = config.text_config, config.vision_config
        low, high = pixel_bounds_of(preprocessor or {}, cls.published_pixels)
        video_low, video_high = pixel_bounds_of(video_preprocessor or preprocessor or {}, cls.video_pixels)
        return cls(name=name, image_size=DEFAULT_IMAGE_SIZE, min_pixels=low, max_pixels=high,
                   video_min_pixels=video_low, video_max_pixels=video_high,
                   token_ids={"bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id,
                              **{k: getattr(config, k) for k in cls.token_keys}},
                   vision=hyperparameters(vision), text=hyperparameters(text),
                   tie_word_embeddings=config.tie_word_embeddings, attn_implementation=attn_implementation)

    def vision_inputs(self, grids: list[tuple[int, int]], device: torch.device, modality: str = "image") -> dict:
        """Extra forward inputs the vision tower needs for the frames of these (rows, cols) patch grids (one per
        image, or per temporal patch of a video), named for their `modality`: none here (a hook for Qwen2.5-VL's
        window index)."""
        return {}

    def video_time_interval(self) -> float:
        """M-RoPE temporal step between a video's temporal patches: Qwen2-VL counts them (1)."""
        return 1.0

    # -- image geometry -------------------------------------------------------------------------------
    def pixel_bounds(self, data: DataShape) -> tuple[int, int]:
        """(min_pixels, max_pixels) per image for this point; raises ConfigError for bounds no image can meet."""
        return self._checked(data.min_pixels or self.min_pixels, data.max_pixels or self.max_pixels, "", "an image")

    def _checked(self, low: int, high: int, prefix: str, what: str, crossed: bool = False) -> tuple[int, int]:
        """(low, high) px per image or frame, or a ConfigError naming data.{prefix}min/max_pixels where no
        resized image can lie between them (`crossed`: a minimum above the maximum is the processor's to take)."""
        if high < self.factor**2:
            raise ConfigError(f"data.{prefix}max_pixels={high} is not allowed for {self.name}: {what} is at least one "
                              f"{self.factor} x {self.factor} px block, so it must be at least {self.factor**2}")
        if low > high and not crossed:
            raise ConfigError(f"data.{prefix}min_pixels={low} is not allowed for {self.name}: it must not exceed "
                              f"{prefix}max_pixels={high}")
        return low, high

    def grid(self, data: DataShape) -> tuple[int, int]:
        """(rows, cols) of 14 px patches of one resized image."""
        return self._resized(self.image_size(data), "image_size", *self.pixel_bounds(data))

    def video_size(self, data: DataShape) -> int:
        """Pixels per frame side this point asks for (the default image side where data.video_size is null)."""
        return data.video_size or self.native_image_size

    def video_grid(self, data: DataShape) -> tuple[int, int, int]:
        """(temporal patches, rows, cols) of one video: its frames padded to a multiple of temporal_patch_size
        (the processor repeats the last), each resized within the frame bounds (frame_bounds)."""
        rows, cols = self._resized(self.video_size(data), "video_size", *self.frame_bounds(data))
        return -(-data.video_frames // self.vision["temporal_patch_size"]), rows, cols

    def frame_bounds(self, data: DataShape) -> tuple[float, float]:
        """(min, max) px per frame as the point's video processor decides them (data.video_processor):

        - transformers (Qwen2VLVideoProcessor.resize, 5.25): the processor's bounds or the point's; with a total
          budget (cap_pixels_per_frame) the cap lowered to an even share of it, floored at 1.05 x the minimum. A
          minimum above the cap is not refused: smart_resize tests the cap first, so such frames are scaled up
          to the minimum.
        - qwen_vl_utils (qwen-vl-utils 0.0.14 fetch_video): the cap is the smaller of 768 tokens' worth and an
          even share of the total budget (VIDEO_TOTAL_PIXELS; by default 90 % of MODEL_SEQ_LEN = 128,000 tokens'
          worth) over the frames rounded up to even, raised to 1.05 x the minimum where that is larger; a
          max_pixels given lowers it, never raises it; smart_resize asserts max >= min (refused here)."""
        step = self.vision["temporal_patch_size"]
        if data.video_processor == "qwen_vl_utils":
            low = data.video_min_pixels or QWEN_VL_UTILS_VIDEO_TOKENS[0] * self.factor**2
            total = data.video_total_pixels or QWEN_VL_UTILS_SEQ_LEN * self.factor**2 * 0.9
            frames = -(-data.video_frames // 2) * 2  # FRAME_FACTOR
            cap = max(min(QWEN_VL_UTILS_VIDEO_TOKENS[1] * self.factor**2, total / frames * 2), int(low * 1.05))
            high = min(data.video_max_pixels, cap) if data.video_max_pixels else cap
            if high < low:
                raise ConfigError(f"data.video_max_pixels={data.video_max_pixels} is not allowed for {self.name} with "
                                  f"data.video_processor=qwen_vl_utils: it must be at least video_min_pixels={low} "
                                  f"(qwen-vl-utils' smart_resize asserts max_pixels >= min_pixels)")
            return self._checked(low, high, "video_", "a frame")
        low = data.video_min_pixels or self.video_min_pixels
        high = data.video_max_pixels or self.video_max_pixels
        if data.video_total_pixels:  # the per-frame cap lowered to an even share of the video's budget
            high = max(min(high, data.video_total_pixels * step // data.video_frames), int(low * 1.05))
        return self._checked(low, high, "video_", "a frame", crossed=True)

    def _resized(self, size: int, field: str, low: int, high: int) -> tuple[int, int]:
        """(rows, cols) of 14 px patches of a `size` px square image or frame resized within [low, high] px."""
        if size < self.factor and not self.scales_up_small_sides:
            # Qwen2VLImageProcessor's smart_resize refused a side below `factor` ("height:.. or width:.. must
            # be larger than factor:28", transformers 4.45-4.52). 4.53 and later (the 5.x admitted here) drop
            # the check and upsample such an image to min_pixels, so a row for it would describe an image
            # the model never sees at that size.
            raise ConfigError(f"data.{field}={size} is not allowed for {self.name}: a side must be at least "
                              f"{self.factor} px, one {self.vision['patch_size']} px patch x merge "
                              f"{self.vision['spatial_merge_size']} (Qwen2VLImageProcessor's smart_resize: \"must be "
                              f"larger than factor:{self.factor}\"; transformers >= 4.53 upsamples it instead)")
        try:
            height, width = smart_resize(size, size, self.factor, low, high, self.frames_in_budget,
                                         self.scales_up_small_sides)
        except ValueError as exc:  # the processor's own refusal (aspect ratio above 200)
            raise ConfigError(f"data.{field}={size} is not allowed for {self.name}: Qwen2VLImageProcessor's "
                              f"smart_resize refuses it: {exc}") from None
        patch = self.vision["patch_size"]
        return height // patch, width // patch

    def image_tokens(self, data: DataShape) -> int:
        rows, cols = self.grid(data)
        return data.images_per_sample * rows * cols // self.vision["spatial_merge_size"] ** 2

    def video_tokens(self, data: DataShape) -> int:
        if not data.videos_per_sample:
            return 0
        if self.frame_timestamps_as_text:
            # how many tokens "<1.5 seconds>" (Qwen3-VL, before each temporal patch) or a frame's "12" (GLM-4.1V,
            # after it) takes only the model's tokenizer can say, which vlmprobe does not have (nothing downloaded)
            raise ConfigError(f"data.videos_per_sample={data.videos_per_sample} is not allowed for {self.name}: its "
                              f"processor writes every frame's timestamp into the prompt as text that only its "
                              f"tokenizer can count; videos are modelled for Qwen2-VL and Qwen2.5-VL; use 0")
        frames, rows, cols = self.video_grid(data)
        return data.videos_per_sample * frames * rows * cols // self.vision["spatial_merge_size"] ** 2

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: smart_resize (already (height, width)) within the spec's pixel bounds or the
        caller's, then (H / patch)(W / patch) patches merged (transformers 5.25 image_processing_pil_qwen2_vl.py,
        image_processing_pil_glm4v.py); Qwen2.5-VL, Qwen3-VL (16 px patches) and GLM-4.1V inherit it."""
        rows, cols = self.grid_at(height, width, min_pixels or self.min_pixels, max_pixels or self.max_pixels,
                                  self.frames_in_budget)
        return rows * cols // self.vision["spatial_merge_size"] ** 2

    def video_tokens_at(self, frames: int, height: int, width: int) -> int:
        """A video of `frames` frames of `height` x `width` px (Qwen2VLVideoProcessor): frames padded to the
        temporal patch, each frame resized within the spec's video bounds. Refused where the processor writes
        timestamps as text (Qwen3-VL, GLM-4.1V), as video_tokens refuses them."""
        if self.frame_timestamps_as_text:
            return super().video_tokens_at(frames, height, width)  # the base refusal
        rows, cols = self.grid_at(height, width, self.video_min_pixels, self.video_max_pixels, 1)
        temporal = -(-frames // self.vision["temporal_patch_size"])
        return temporal * rows * cols // self.vision["spatial_merge_size"] ** 2

    def sized_for(self, data: DataShape) -> Qwen2VLSpec:
        bounded = copy.copy(self)
        bounded.min_pixels, bounded.max_pixels = self.pixel_bounds(data)
        return bounded

    def dataset_patches(self, images: list[tuple[int, int]], data: DataShape) -> int:
        low, high = self.pixel_bounds(data)
        return sum(r * c for r, c in (self.grid_at(h, w, low, high, self.frames_in_budget) for h, w in images))

    def grid_at(self, height: int, width: int, low: int, high: int, frames: int) -> tuple[int, int]:
        """(rows, cols) of patches of one `height` x `width` image or frame after smart_resize within [low, high]
        px; ConfigError where the processor refuses it (aspect ratio above 200)."""
        try:
            h, w = smart_resize(height, width, self.factor, low, high, frames, self.scales_up_small_sides)
        except ValueError as exc:  # the processor's own refusal (aspect ratio above 200)
            raise ConfigError(f"an image of {height} x {width} px is not allowed for {self.name}: its processor's "
                              f"smart_resize refuses it: {exc}") from None
        return h // self.vision["patch_size"], w // self.vision["patch_size"]

    size_decides_tokens = True

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        # vision_start / vision_end around each image and each video
        return self.image_markers * (data.images_per_sample + data.videos_per_sample), " plus 2 vision markers each"

    # -- model ----------------------------------------------------------------------------------------
    def config(self):
        import transformers

        text = {**self.text, "use_cache": False, "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.token_ids["bos_token_id"], "eos_token_id": self.token_ids["eos_token_id"]}
        ids = {k: v for k, v in self.token_ids.items() if k not in ("bos_token_id", "eos_token_id")}
        return getattr(transformers, self.config_class)(
            text_config=text, vision_config=dict(self.vision), **ids, tie_word_embeddings=self.tie_word_embeddings,
            attn_implementation=self.attn_implementation)

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        # The patch merger (the projector) lives inside `visual`, the vision PreTrainedModel that checkpointing
        # is enabled on, so it goes with the vision tower here (frozen with it).
        return {"vision": [model.model.visual], "lm": [model.model.language_model, model.lm_head]}

    # -- inputs ---------------------------------------------------------------------------------------
    def _sample(self, data: DataShape) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """input_ids, labels, mm_token_type_ids and M-RoPE positions (3 rows) of one sample."""
        ids = self.token_ids
        merge = self.vision["spatial_merge_size"]
        rows, cols = (n // merge for n in self.grid(data))
        per_image = rows * cols
        text_vocab = min(ids[k] for k in self.token_keys)  # ordinary text ids lie below the special tokens
        start, end = (ids[k] for k in self.markers)
        input_ids, types, layout = [], [], []
        for _ in range(data.images_per_sample):
            input_ids += [start] + [ids["image_token_id"]] * per_image + [end]
            types += [0] + [1] * per_image + [0]
            layout += [("text", 1), ("image", (rows, cols)), ("text", 1)]
        if data.videos_per_sample:
            frames, v_rows, v_cols = self.video_grid(data)
            v_rows, v_cols = v_rows // merge, v_cols // merge
            per_video = frames * v_rows * v_cols
            for _ in range(data.videos_per_sample):
                input_ids += [start] + [ids["video_token_id"]] * per_video + [end]
                types += [0] + [2] * per_video + [0]
                layout += [("text", 1), ("video", (frames, v_rows, v_cols, self.video_time_interval())), ("text", 1)]
        n_text = data.lm_max_length - len(input_ids)
        input_ids += filler_text(n_text, text_vocab)
        types += [0] * n_text
        layout.append(("text", n_text))
        labels = [IGNORE_INDEX if t or i in (start, end) else i
                  for i, t in zip(input_ids, types)]
        return input_ids, labels, types, mrope_position_ids(layout)

    def batch(self, data: DataShape, device: torch.device) -> dict:
        self.validate(data)
        input_ids, labels, types, positions = self._sample(data)
        b = data.batch_size
        rows, cols = self.grid(data)
        n_images = b * data.images_per_sample
        frames, v_rows, v_cols = self.video_grid(data) if data.videos_per_sample else (0, 0, 0)
        n_videos = b * data.videos_per_sample
        patch_values = (self.vision["in_channels"] * self.vision["temporal_patch_size"]
                        * self.vision["patch_size"] ** 2)

        # The limit stays raised while the batch lives: the forward reads the constants, and so does the
        # backward when activation checkpointing recomputes vision blocks (cu_seqlens split sizes). It covers
        # one value per patch as well: Qwen3-VL's vision tower repeats each image's grid size per patch
        # (repeat_interleave, whose output size fake tensors know only from constants) to resample its
        # position table.
        def inputs() -> dict:
            if data.packing:  # one row (vlmprobe.models.packing): the M-RoPE rows under a text row, (4, 1, B x L)
                text = list(range(data.lm_max_length))
                made = {"mm_token_type_ids": constant_tensor(packed_rows(data, [types]), device),
                        "position_ids": constant_tensor([[row] for row in packed_rows(data, [text, *positions])],
                                                        device)}
            else:
                made = {"mm_token_type_ids": constant_tensor([types] * b, device),
                        "position_ids": constant_tensor([[row] * b for row in positions], device)}  # (3, B, L)
            if n_images:
                made.update({
                    "image_grid_thw": constant_tensor([[1, rows, cols]] * n_images, device),
                    "pixel_values": torch.randn(n_images * rows * cols, patch_values, dtype=torch.float32,
                                                device=device),
                    **self.vision_inputs([(rows, cols)] * n_images, device),
                })
            if n_videos:  # what the video processor returns: float32 patches, one (t, rows, cols) row per video
                made.update({
                    "video_grid_thw": constant_tensor([[frames, v_rows, v_cols]] * n_videos, device),
                    "pixel_values_videos": torch.randn(n_videos * frames * v_rows * v_cols, patch_values,
                                                       dtype=torch.float32, device=device),
                    **self.vision_inputs([(v_rows, v_cols)] * (n_videos * frames), device, "video"),
                })
            return made

        limit = max(n_images * rows * cols, n_videos * frames * v_rows * v_cols)
        if data.packing:  # transformers reads the text row of the positions: constant, all four rows
            return packed(data, device, input_ids, labels, inputs, limit=max(limit, 4 * b * data.lm_max_length))
        return collated(data, device, input_ids, labels, inputs, limit=limit)

    def dataset_batch(self, samples: list[tuple[list[tuple[int, int]], int]], padded_length: int, data: DataShape,
                      device: torch.device) -> dict:
        """The inputs of one micro batch of a dataset's samples (vlmprobe.point.dataset_steps), as the processor and
        a padding collator hand them: `samples` holds each sample's images ((height, width) px, in order) and its
        LM tokens after truncation (vlmprobe.dataset.plan_batches). Per image, smart_resize within the point's
        pixel bounds gives its image_grid_thw row [1, rows, cols] and rows x cols pixel_values rows (float32, as
        the image processor returns them), framed by vision_start / vision_end and followed by the sample's text
        (the plan counts the markers: ModelSpec.image_markers). Each sample is then
        right-padded to `padded_length` with the pad token (Qwen2-VL's tokenizer pads with <|endoftext|>, the
        config's bos_token_id), attention_mask 0 and labels -100 at the pads: transformers 5.25's
        DataCollatorForSeq2Seq, whose padding side is the tokenizer's (PreTrainedTokenizerBase's default
        "right"). M-RoPE positions are those of get_rope_index given the mask: the sample's own, 0 at the pads.
        ConfigError where a sample's images and their markers do not fit its tokens. The caller holds fake tensors'
        constant limit over the batch's tokens and patches (vlmprobe.point.dataset_steps.constant_limit), as
        `collated` holds it for batch(). With data.packing the samples are not padded but packed end to end into
        one row of their tokens together (ms-swift's --padding_free / --packing rows, vlmprobe.models.packing)."""
        ids = self.token_ids
        merge, patch = self.vision["spatial_merge_size"], self.vision["patch_size"]
        low, high = self.pixel_bounds(data)
        # the tokenizer's pad token: the text config's where it names one (GLM-4.1V's <|endoftext|>), else Qwen's
        # <|endoftext|>, the config's bos_token_id
        start, end, pad = ids[self.markers[0]], ids[self.markers[1]], self.text.get("pad_token_id", ids["bos_token_id"])
        prompts, layouts, grids = [], [], []
        for images, tokens in samples:
            prompt, layout = [], []
            for height, width in images:
                grid = self.grid_at(height, width, low, high, self.frames_in_budget)  # (rows, cols) of patches
                grids.append(grid)
                prompt += [start] + [ids["image_token_id"]] * (grid[0] * grid[1] // merge**2) + [end]
                layout += [("text", 1), ("image", (grid[0] // merge, grid[1] // merge)), ("text", 1)]
            prompts.append(prompt)
            layouts.append(layout + [("text", tokens - len(prompt))])
        rows = dataset_samples(self.name, prompts, [tokens for _, tokens in samples],
                               min(ids[k] for k in self.token_keys))
        rows["mm_token_type_ids"] = [[int(i == ids["image_token_id"]) for i in sample] for sample in rows["input_ids"]]
        positions = [mrope_position_ids(layout) for layout in layouts]  # each sample's own: 3 rows
        fills = {"input_ids": pad, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
        if data.packing:  # a text row restarting at each sample over each sample's M-RoPE rows: (4, 1, N)
            text = restarting([len(sample) for sample in rows["input_ids"]])
            joined = [[sum((p[axis] for p in positions), [])] for axis in range(3)]
            batch = padded_or_packed(rows, fills, padded_length, True, device, positions=[[text], *joined])
        else:  # get_rope_index's positions given the mask: 0 at the pads, (3, B, L)
            batch = padded_or_packed(rows, fills, padded_length, False, device)
            batch["position_ids"] = constant_tensor(
                [[p[axis] + [0] * (padded_length - len(p[axis])) for p in positions] for axis in range(3)], device)
        patch_values = self.vision["in_channels"] * self.vision["temporal_patch_size"] * patch**2
        if grids:
            batch.update({
                "image_grid_thw": constant_tensor([[1, rows, cols] for rows, cols in grids], device),
                "pixel_values": torch.randn(sum(rows * cols for rows, cols in grids), patch_values,
                                            dtype=torch.float32, device=device),
                **self.vision_inputs(grids, device),
            })
        return batch

    # -- generation (step=grpo) -----------------------------------------------------------------------
    can_generate = True

    def generation_inputs(self, model: nn.Module, data: DataShape, device: torch.device):
        """generate() (transformers 5.17-5.23) reads two things from values that fake tensors cannot give:
        the M-RoPE positions of the prompt (`get_rope_index`, fresh aranges per image) and, before the
        prefill, the image features through `get_image_features(pixel_values, image_grid_thw)` alone, so
        Qwen2.5-VL's vision tower would compute its window index itself. In the context both come from the
        collator, as for the training forward: get_rope_index returns the batch's positions and the rope
        delta of `mrope_position_ids` (what transformers computes, checked in the tests), and
        get_image_features gets the family's vision_inputs. On every backend, so cpu and estimate run the
        same program. attention_mask is left out (every prompt fills lm_max_length): generate then makes
        its own all-ones mask, as a real run with TRL's all-ones mask keeps."""
        import contextlib
        import functools

        batch = self.batch(data, device)
        positions = self._sample(data)[3]
        delta = max(max(row) for row in positions) + 1 - len(positions[0])  # next position - length
        deltas = constant_tensor([[delta]] * data.batch_size, device)
        # the towers' own inputs (Qwen2.5-VL's window index): each get_*_features keeps its modality's
        # (transformers' accepts_precomputed_kwargs drops the other's)
        window = {k: batch.pop(k) for k in list(batch)
                  if k.startswith(("image_", "video_")) and k not in ("image_grid_thw", "video_grid_thw")}
        position_ids = batch.pop("position_ids")
        batch.pop("labels")

        @contextlib.contextmanager
        def context():
            inner = model.model
            inner.get_rope_index = lambda input_ids, **_: (position_ids, deltas)
            inner.get_image_features = functools.partial(inner.get_image_features, **window)
            inner.get_video_features = functools.partial(inner.get_video_features, **window)
            try:
                yield
            finally:  # back to the class's methods
                del inner.get_rope_index, inner.get_image_features, inner.get_video_features
                inner.rope_deltas = None

        return batch, context()


def pixel_bounds_of(preprocessor: dict, published: tuple[int, int]) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen preprocessor_config.json: older files name them, newer ones (and
    transformers 5) keep them as size.shortest_edge / size.longest_edge; the `published` values otherwise."""
    size = preprocessor.get("size") or {}
    low = preprocessor.get("min_pixels") or size.get("shortest_edge") or published[0]
    high = preprocessor.get("max_pixels") or size.get("longest_edge") or published[1]
    return int(low), int(high)
