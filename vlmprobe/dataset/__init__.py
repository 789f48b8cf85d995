"""A dataset's shapes and the batches a trainer makes of them: the data side of issue 49 (the engine side, each
step through the allocator model, consumes `plan_batches`' output: vlmprobe.point.dataset_steps).

read_samples (samples.py: shapes files, LLaMA-Factory / ms-swift / TRL datasets, save_to_disk folders;
synthetic.py) -> image_tokens (image_tokens.py, per family) -> plan_batches (batches.py: the Trainer's samplers,
accelerate's split across ranks, gradient accumulation) -> summarize_plan / write_steps_csv (summary.py).
Pure and fast: no model is built. docs/datasets.md gives the formats, the rules and their sources.
"""

from vlmprobe.dataset.batches import SAMPLERS, StepBatch, lm_tokens, plan_batches
from vlmprobe.dataset.image_tokens import image_tokens, video_tokens
from vlmprobe.dataset.samples import FORMATS, Sample, read_samples, sample_notes
from vlmprobe.dataset.summary import COLUMNS, summarize_plan, worst, write_steps_csv

__all__ = ["COLUMNS", "FORMATS", "image_tokens", "lm_tokens", "plan_batches", "read_samples", "Sample",
           "sample_notes", "SAMPLERS", "StepBatch", "summarize_plan", "video_tokens", "worst", "write_steps_csv"]
