"""What every model family provides to the worker, and the build helpers they share."""

from __future__ import annotations

import abc
import contextlib
import importlib
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from vlmprobe.errors import ConfigError, require_flags, whole
from vlmprobe.models.packing import check_packing

__all__ = ["count_params", "DataShape", "dataset_samples", "filler_text", "hyperparameters", "IGNORE_INDEX",
           "is_transformers_model", "ModelSpec", "prompt_then_text", "torch_init_skipped", "TRANSFORMERS_MODULES",
           "unwrapped"]


VIDEO_PROCESSORS = ("transformers", "qwen_vl_utils")  # data.video_processor: whose frame-sizing rule a point follows


@dataclass(frozen=True)
class DataShape:
    """The input sizes of one grid point (the `data` config group, validated)."""

    batch_size: int = 0  # samples per optimizer step (micro batch); 0 = not given, rejected
    lm_max_length: int = 0  # whole LM sequence per sample, image and video tokens included; 0 = not given, rejected
    image_size: int | None = None  # pixels per image side; None = the model's native size
    images_per_sample: int = 1  # 0 only beside videos
    max_pixels: int | None = None  # Qwen-style cap on H*W per image; None = the model's
    min_pixels: int | None = None  # Qwen-style floor on H*W per image; None = the model's
    videos_per_sample: int = 0  # videos (Qwen2-VL / Qwen2.5-VL); 0 = none
    video_frames: int | None = None  # frames each video hands the processor (after sampling); needed with videos
    video_size: int | None = None  # pixels per frame side; None = the model's default image side
    video_min_pixels: int | None = None  # floor on H*W per frame; None = the model's video processor's
    video_max_pixels: int | None = None  # cap on H*W per frame; None = the model's video processor's
    video_total_pixels: int | None = None  # cap on frames x H*W per video (qwen-vl-utils' VIDEO_TOTAL_PIXELS); None = none
    video_processor: str = "transformers"  # whose rule sizes the frames: transformers | qwen_vl_utils
    packing: bool = False  # the micro batch's samples as one row, positions restarting per sample (models/packing.py)
    # a dataset's batches step after step (vlmprobe.point.dataset_steps); None = the synthetic batch above
    source: object = None  # a shapes file / dataset path / synthetic spec, as vlmprobe.dataset.read_samples takes it
    steps: int | None = None  # optimizer steps over the dataset; None = one epoch, at most 20 steps
    sampler: str = "random"  # the trainer's sampler (vlmprobe.dataset.SAMPLERS, checked in vlmprobe.config.checks)
    seed: int = 42  # the sampler's seed
    pad_to_multiple_of: int | None = None  # a micro batch padded to its longest sample, rounded up to this
    image_dir: str | None = None  # the folder relative image paths are read from; None = the dataset's own

    @classmethod
    def from_config(cls, data) -> "DataShape":
        shape = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        for name in ("batch_size", "lm_max_length"):
            value = getattr(shape, name)
            if not whole(value) or value <= 0:
                raise ConfigError(f"data.{name}={value!r} is not allowed: it must be a positive integer")
        for name in ("images_per_sample", "videos_per_sample"):
            value = getattr(shape, name)
            if not whole(value) or value < 0:
                raise ConfigError(f"data.{name}={value!r} is not allowed: it must be 0 or a positive integer")
        require_flags("data", {"packing": shape.packing}, ["packing"])
        if shape.video_processor not in VIDEO_PROCESSORS:
            raise ConfigError(f"data.video_processor={shape.video_processor!r} is not allowed: use one of "
                              f"{', '.join(VIDEO_PROCESSORS)}")
        if shape.images_per_sample == 0 and shape.videos_per_sample == 0:
            raise ConfigError("data.images_per_sample=0 is not allowed without videos: a sample needs an image or a "
                              "video (data.videos_per_sample > 0)")
        for name in ("image_size", "max_pixels", "min_pixels", "video_frames", "video_size", "video_min_pixels",
                     "video_max_pixels", "video_total_pixels"):
            value = getattr(shape, name)
            if value is not None and (not whole(value) or value <= 0):
                raise ConfigError(f"data.{name}={value!r} is not allowed: it must be a positive integer or null")
        if shape.videos_per_sample and shape.video_frames is None:
            raise ConfigError(f"data.video_frames=None is not allowed with data.videos_per_sample="
                              f"{shape.videos_per_sample}: give the frames each video hands the processor (after "
                              f"sampling: fps x seconds, capped as your pipeline caps them)")
        shape.check_source_fields()
        return shape

    def check_source_fields(self) -> None:
        """The dataset fields' types (data.source's): what they mean is checked where the source is read
        (vlmprobe.config.checks.check_source)."""
        if self.source is not None and not isinstance(self.source, (str, dict)):
            raise ConfigError(f"data.source={self.source!r} is not allowed: give a shapes file or dataset path, "
                              f"synthetic:{{...}}, or null")
        for name in ("steps", "pad_to_multiple_of"):
            value = getattr(self, name)
            if value is not None and (not whole(value) or value <= 0):
                raise ConfigError(f"data.{name}={value!r} is not allowed: it must be a positive integer or null")
        if not whole(self.seed) or self.seed < 0:
            raise ConfigError(f"data.seed={self.seed!r} is not allowed: it must be an integer >= 0")
        if not isinstance(self.sampler, str):
            raise ConfigError(f"data.sampler={self.sampler!r} is not allowed: give a sampler's name")
        if self.image_dir is not None and not isinstance(self.image_dir, str):
            raise ConfigError(f"data.image_dir={self.image_dir!r} is not allowed: give a folder path or null")


# transformers' modules that a family built on transformers runs through, and where the estimate answers what
# a real run reads (vlmprobe.estimate.fake_patches, flash_attn_standin): those answers are given where the
# modules are imported, so a transformers family imports them with its own module, before any of its models is
# built (ModelSpec.__init_subclass__). Importing them costs ~5 s here (torch._dynamo, torch.distributed.tensor,
# generation), which a family of our own (nanoVLM) does not pay.
TRANSFORMERS_MODULES = ("transformers.modeling_utils", "transformers.masking_utils",
                        "transformers.modeling_flash_attention_utils")


class ModelSpec(abc.ABC):
    """A model family with its hyperparameters. Subclasses are Hydra `_target_`s."""

    name: str
    uses_transformers = True  # built from transformers' model classes (False: our own modules, nanoVLM)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.uses_transformers:
            for module in TRANSFORMERS_MODULES:
                importlib.import_module(module)

    native_image_size: int  # px per side when data.image_size is null
    # LM tokens a processor writes around each image or video of a prompt beside its image tokens (Qwen2-VL's
    # vision_start / vision_end): a dataset's samples hold them (vlmprobe.dataset.plan_batches)
    image_markers = 0

    def image_size(self, data: DataShape) -> int:
        """Pixels per image side this point asks for."""
        return data.image_size or self.native_image_size

    @abc.abstractmethod
    def image_tokens(self, data: DataShape) -> int:
        """LM tokens that one sample's images occupy. Raises ConfigError for sizes the model cannot take."""

    size_decides_tokens = False  # the too-short line names the image size (the family's tokens follow it)
    source = None  # a checkout whose own model code the point runs instead of this spec's (nanoVLM's model.source)

    def native_size_only(self, data: DataShape, resizes: str, why: str) -> None:
        """ConfigError (one line) unless the point asks for the size the family's processor gives every image
        (`resizes`: who does it and how; `why`: what makes that the only size): any other would be a point whose
        memory is that of the native size."""
        size, native = self.image_size(data), self.native_image_size
        if size != native:
            raise ConfigError(f"data.image_size={size} is not allowed for {self.name}: {resizes} every image to "
                              f"{native} x {native} px ({why}), so the model's memory is that of {native} px; use "
                              f"{native} or null")

    reads_video_preprocessor = False  # model=hf: from_hf_config takes video_preprocessor_config.json's settings too

    def video_tokens(self, data: DataShape) -> int:
        """LM tokens that one sample's videos occupy: none, or a ConfigError where the point asks for videos (a family
        that models them overrides this)."""
        if data.videos_per_sample:
            raise ConfigError(f"data.videos_per_sample={data.videos_per_sample} is not allowed for {self.name}: videos "
                              f"are modelled for Qwen2-VL and Qwen2.5-VL (qwen2_vl_*, qwen2_5_vl_*, hf); use 0")
        return 0

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """LM tokens of one `height` x `width` px image of a dataset (vlmprobe.dataset): the family's processor
        rule taken to both sides (a family that has one overrides this). `images_in_sample` matters where a family
        treats several images apart (LLaVA-OneVision, DeepSeek-VL2); min / max pixels override a Qwen-style
        spec's bounds. ConfigError here: no rule for this family."""
        raise ConfigError(f"model={getattr(self, 'name', type(self).__name__)} is not allowed for a dataset's images: "
                          f"vlmprobe has no per-image token rule for {type(self).__name__}")

    def sized_for(self, data: DataShape) -> ModelSpec:
        """This spec as a dataset's images are tokenized for the point `data` (a Qwen-style spec: within its
        data.min_pixels / max_pixels); the spec itself where the point's settings change no image's tokens."""
        return self

    def dataset_patches(self, images: list[tuple[int, int]], data: DataShape) -> int:
        """Vision patches of these (height, width) images as the point's batch hands them to the tower, where a
        family's inputs count them (Qwen's pixel_values rows); 0 where the tower takes whole images."""
        return 0

    def video_tokens_at(self, frames: int, height: int, width: int) -> int:
        """LM tokens of one video of a dataset, `frames` frames (as handed to the processor) of `height` x `width`
        px (a family that models videos overrides this). ConfigError here: videos are not modelled."""
        raise ConfigError(f"videos are not allowed for {getattr(self, 'name', type(self).__name__)} in a dataset: "
                          f"they are modelled for Qwen2-VL and Qwen2.5-VL only")

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        """Tokens the processor writes into the prompt beside the image tokens (markers, <bos>), and how the
        too-short line names them."""
        return 0, ""

    def validate(self, data: DataShape) -> None:
        """Raise ConfigError (one line) if this model cannot run `data`; cheap, no torch work: the prompt must
        hold the images, their framing and at least one text token; a packed batch needs a family that packs."""
        if data.packing:
            check_packing(self)
        tokens = self.video_tokens(data) + self.image_tokens(data)  # videos first: a family without them says so
        framing, named = self.prompt_framing(data)
        needed = tokens + framing + 1
        if data.lm_max_length < needed:
            at = f" at {self.image_size(data)} px" if self.size_decides_tokens and data.images_per_sample else ""
            what = ("the images" if not data.videos_per_sample else
                    "the videos" if not data.images_per_sample else "the images and videos")
            raise ConfigError(f"data.lm_max_length={data.lm_max_length} is too short for {self.name}{at}: {what} "
                              f"take {tokens} tokens{named}, so it must be at least {needed}")

    @abc.abstractmethod
    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """{"vision": [...], "lm": [...]}: the modules the freeze / checkpointing / LoRA knobs act on (the LM
        with its head; a projector between the two belongs to neither and stays trainable)."""

    def repeated_blocks(self, model: nn.Module) -> list[list[nn.Module]]:
        """Lists of blocks that run one program, whatever their place (vlmprobe.estimate.replay.blocks replays
        all but the first and last of each in the estimate's first step). None here: a family says so only
        where its block code has nothing that depends on a block's index (transformers' layers read theirs:
        sliding-window and full-attention layers alternate in some families)."""
        return []

    model_class: str  # a transformers family's model class, by name (imported when a model is built)

    def _construct(self) -> nn.Module:
        """Create the module (called under the device, dtype and no-init contexts): a transformers family's
        `model_class` from its config(), with its weights tied, as from_pretrained leaves them (post_init does not
        tie under no_init_weights; a no-op where untied). A family of our own modules overrides it."""
        import transformers

        model = getattr(transformers, self.model_class)(self.config())
        model.tie_weights()
        return model

    @abc.abstractmethod
    def batch(self, data: DataShape, device: torch.device) -> dict:
        """Forward kwargs (with labels) for one synthetic micro batch: shapes decide memory, content does not."""

    can_generate = False  # whether generation_inputs() below exists (step=grpo needs it)

    def generation_inputs(self, model: nn.Module, data: DataShape, device: torch.device):
        """(kwargs, context) for `model.generate(**kwargs)` on one synthetic prompt batch of `data` (the prompt
        fills lm_max_length): the prompt's inputs, and a context the call runs in (what the family needs so
        that generate runs on fake tensors as on real ones). step=grpo's rollout (vlmprobe.steps.rollout)."""
        raise ConfigError(f"step=grpo is not allowed with model={self.name}: {type(self).__name__} cannot "
                          f"generate here; use a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4.1V / GLM-4.5V model "
                          f"(qwen2_vl_*, qwen2_5_vl_*, qwen3_vl_*, glm4_1v_9b, glm4_5v, hf)")

    def loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, object]:
        """(loss, outputs) of `batch`, as the family's own training code computes them; `outputs` is what the
        model returned (logits), which a training loop may keep alive (measure.hold_outputs). Here the
        transformers model's own loss (`labels=` -> outputs.loss: logits upcast to fp32, shifted cross-entropy,
        mean over labels); attention_mask is None: every sample fills lm_max_length, and a mask would make
        transformers build a (B, 1, L, L) tensor for fake tensors that a CUDA run without padding never makes."""
        outputs = model(**batch, attention_mask=None, use_cache=False)
        return outputs.loss, outputs

    def build(self, device: torch.device | str, dtype: torch.dtype, *, init: bool = True) -> nn.Module:
        """The model with random weights, created directly on `device` in `dtype`.

        Construction skips transformers' weight init (an 8B model is never initialised on the CPU, and fake
        tensors cannot run data-dependent init); `init=True` then fills the weights in place on the target
        device, which allocates nothing new. Weights do not change memory, only shapes do.
        """
        with torch.device(device), default_dtype(dtype), self._init_skipped():
            model = self._construct()
        if init:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, 0.02)
        return model

    def build_empty(self, dtype: torch.dtype) -> nn.Module:
        """The model as from_pretrained makes it before it loads a checkpoint: parameters on the meta device (no
        memory), buffers computed as construction computes them, on the host and outside any tensor mode (no
        tracker or fake mode sees them), in `dtype`. The loader puts each tensor on the device
        (vlmprobe.quantization.loading)."""
        with _disable_current_modes(), torch.device("cpu"), default_dtype(dtype), self._init_skipped(), \
                parameters_on_meta():
            return self._construct()

    def _init_skipped(self) -> contextlib.AbstractContextManager:
        """The context that skips weight init: transformers' own (torch's init functions and its models'
        init_weights), or for our own modules torch's init functions alone."""
        if self.uses_transformers:
            from transformers.initialization import no_init_weights

            return no_init_weights()
        return torch_init_skipped()


@contextlib.contextmanager
def torch_init_skipped():
    """torch.nn.init's in-place fills as no-ops (torch's modules call them from reset_parameters), as
    transformers' no_init_weights makes them, without importing transformers' modeling code."""
    names = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
    originals = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in originals.items():
            setattr(nn.init, name, function)


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter a module registers is moved to the meta device as it is registered (its host tensor, made
    empty under the no-init context, freed at once); buffers stay where they were made."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def is_transformers_model(module: nn.Module) -> bool:
    """Whether `module` is a transformers PreTrainedModel; no module is one unless transformers' modeling code
    is imported, which this does not import."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def unwrapped(model):
    """The model inside DDP or a DeepSpeed engine (both keep it as `.module`); the model itself otherwise."""
    from torch.nn.parallel import DistributedDataParallel

    deepspeed = sys.modules.get("deepspeed")  # no DeepSpeed engine exists unless DeepSpeed was imported
    wrappers = (DistributedDataParallel, *((deepspeed.DeepSpeedEngine,) if deepspeed else ()))
    return model.module if isinstance(model, wrappers) else model


IGNORE_INDEX = -100  # labels the loss skips (the prompt: image tokens and their markers)


def filler_text(n: int, vocab: int, first: int = 0) -> list[int]:
    """`n` ordinary text token ids from `first` up to below `vocab` (a sample's text: its content does not change
    memory; a family whose special tokens have the low ids starts above them)."""
    return [first + (17 * i + 3) % (vocab - first) for i in range(n)]


def dataset_samples(name: str, prompts: list[list[int]], lengths: list[int], vocab: int,
                    first: int = 0) -> dict[str, list[list[int]]]:
    """The input_ids and labels rows of a dataset's micro batch (ModelSpec.dataset_batch): each sample its
    prompt (images and their markers) then text up to its planned LM tokens; a ConfigError (one line) where a
    sample's prompt does not fit them."""
    ids, labels = [], []
    for prompt, length in zip(prompts, lengths):
        if len(prompt) > length:
            raise ConfigError(f"a sample of {length} tokens is not allowed for {name}: its images and their markers "
                              f"take {len(prompt)}; give a larger data.lm_max_length or smaller images")
        sample_ids, sample_labels = prompt_then_text(prompt, length, vocab, first)
        ids.append(sample_ids)
        labels.append(sample_labels)
    return {"input_ids": ids, "labels": labels}


def prompt_then_text(prompt: list[int], length: int, vocab: int, first: int = 0) -> tuple[list[int], list[int]]:
    """input_ids and labels of one sample of `length` tokens: the `prompt` (start token, images and their
    markers; not learned, -100) and text up to the length (learned), ids in [first, vocab)."""
    text = filler_text(length - len(prompt), vocab, first)
    return prompt + text, [IGNORE_INDEX] * len(prompt) + text


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create floating tensors in `dtype` (modules read the default at construction)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def count_params(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters; `parameters()` yields a tied tensor once, so tied embeddings count once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


# Bookkeeping keys of a transformers config that do not describe the architecture (or that vlmprobe sets
# itself: the dtype per point, use_cache off for training)
NOT_HYPERPARAMETERS = ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype", "use_cache")


def hyperparameters(config) -> dict:
    """A transformers (sub-)config's own settings as plain data: what differs from PreTrainedConfig's
    generic defaults (every field of the model's class, plus any extra key its config.json had), without
    bookkeeping. Building the same config class from it gives the same model."""
    return {k: v for k, v in config.to_diff_dict().items() if k not in NOT_HYPERPARAMETERS}
