#!/usr/bin/env python
"""vlmprobe's GRPO step against TRL's own GRPOTrainer, both on the cpu backend (real CPU tensors, vlmprobe's
tracker counting every storage as the CUDA caching allocator would), printed as one table.

TRL side: the tiny Qwen2.5-VL (conf/model/qwen2_5_vl_tiny.yaml, random weights, saved to a temporary dir so
TRL loads the policy and its reference copy itself), a word-level tokenizer and Qwen2VLImageProcessorPil made
here (no hub access), a two-sample in-memory dataset (one 112 px image + a few words each), a constant reward
function; GRPOConfig(use_cpu, float32, no checkpointing, max_steps=1, completions forced to full length with
generation_kwargs min_new_tokens). The peak is read over trainer.train() with the models already loaded.
vlmprobe side: the same settings as a step=grpo point, data.lm_max_length = the prompt length TRL's processor
made, the optimizer implementation TRL's AdamW ran with, step.compact=false (TRL without Triton projects every
position), measure.steps=1; its peak minus what it had loaded before the step (after_load_bytes) against TRL's
peak minus the same (models + dataset when train() starts).

    pip install -e ".[trl]"; python scripts/check_grpo_trl.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

from vlmprobe.results import MiB

WORDS = 400  # word-level vocabulary: ids 0..399; the tiny model's special tokens sit at 500..505
TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")


def tiny_processor(spec):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    ids = spec.token_ids
    special = {"<|endoftext|>": ids["bos_token_id"], "<|im_end|>": ids["eos_token_id"],
               "<|vision_start|>": ids["vision_start_token_id"], "<|vision_end|>": ids["vision_end_token_id"],
               "<|image_pad|>": ids["image_token_id"], "<|video_pad|>": ids["video_token_id"]}
    vocab = {f"w{i}": i for i in range(WORDS)} | {"[UNK]": WORDS} | special
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(special))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", unk_token="[UNK]", chat_template=TEMPLATE)
    image = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                     patch_size=spec.vision["patch_size"], merge_size=spec.vision["spatial_merge_size"],
                                     temporal_patch_size=spec.vision["temporal_patch_size"])

    class Processor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, name, argument):
            if argument is None:  # no video processor: its class needs torchvision, absent on CPU machines
                return None
            return super().check_argument_for_proper_class(name, argument)

    return Processor(image_processor=image, tokenizer=tokenizer, chat_template=TEMPLATE)


def trl_peak(spec, out: Path, settings: dict, fold_in_place: bool) -> dict:
    """TRL's GRPOTrainer, one step, under the cpu backend's tracker. fold_in_place: TRL's torch fold of each
    logits tile (its CPU stand-in for the Triton kernel) replaced by one that allocates nothing, as the Triton
    kernel on CUDA (values become meaningless; allocations are then the CUDA path's)."""
    import contextlib

    import torch
    from datasets import Dataset
    from PIL import Image
    from trl import GRPOConfig, GRPOTrainer

    from vlmprobe.backends import get

    model_dir = out / "tiny"
    spec.build(torch.device("cpu"), torch.float32).save_pretrained(model_dir)
    processor = tiny_processor(spec)
    size = spec.native_image_size
    words = " ".join(f"w{i}" for i in range(settings["prompt_words"]))
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words}]}],
                                  "image": Image.new("RGB", (size, size), color=(i * 60, 90, 30))} for i in range(2)])
    config = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                        max_steps=1, per_device_train_batch_size=settings["rows"], num_generations=settings["generations"],
                        max_completion_length=settings["completion"], beta=settings["beta"], loss_type="grpo",
                        generation_kwargs={"min_new_tokens": settings["completion"]}, report_to=[], save_strategy="no",
                        logging_strategy="no", dataloader_num_workers=0, seed=0,
                        model_init_kwargs={"dtype": torch.float32})
    from trl.kernels import chunked_logprob

    folds = (chunked_logprob._forward_tile, chunked_logprob._backward_tile)
    if fold_in_place:
        chunked_logprob._forward_tile = chunked_logprob._backward_tile = lambda *args, **kwargs: None
    with contextlib.ExitStack() as restore, get("cpu").session(None) as meter:
        restore.callback(setattr, chunked_logprob, "_forward_tile", folds[0])
        restore.callback(setattr, chunked_logprob, "_backward_tile", folds[1])
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [1.0] * len(completions),
                              args=config, train_dataset=dataset, processing_class=processor)
        before = meter.current()
        meter.reset_peak()
        trainer.train()
        peak = meter.peaks()["allocated"]
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    impl = "fused" if optimizer.defaults.get("fused") else "foreach" if optimizer.defaults.get("foreach") else "single_tensor"
    prompt = processor.apply_chat_template(dataset[0]["prompt"], tokenize=False)
    length = len(processor(images=[dataset[0]["image"]], text=[prompt])["input_ids"][0])
    return {"before": before, "peak": peak, "optimizer": impl, "prompt_length": length}


def vlmprobe_peak(settings: dict, prompt_length: int, optimizer: str) -> dict:
    from vlmprobe.plan import plan_overrides
    from vlmprobe.worker import measure

    option = {"foreach": "adamw", "fused": "adamw_fused", "single_tensor": "adamw_single_tensor"}[optimizer]
    (point,) = plan_overrides(["model=qwen2_5_vl_tiny", "step=grpo", "measure.backend=cpu", "measure.steps=1",
                               f"optimizer={option}", "train.autocast_dtype=null", "step.compact=false",
                               f"data.batch_size={settings['rows']}", f"data.lm_max_length={prompt_length}",
                               f"step.num_generations={settings['generations']}",
                               f"step.max_completion_length={settings['completion']}", f"step.beta={settings['beta']}"])
    row = measure(point.config)
    return {"before": row["after_load_bytes"], "peak": row["peak_allocated_bytes"], "phase": row["peak_phase"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--completion", type=int, default=16)
    args = parser.parse_args()
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from vlmprobe.overrides import CONF

    spec = instantiate(OmegaConf.load(CONF / "model" / "qwen2_5_vl_tiny.yaml"), _convert_="all")
    rows = []
    for beta, fold_in_place in ((0.04, False), (0.0, False), (0.04, True)):
        settings = {"rows": args.rows, "generations": 2, "completion": args.completion, "beta": beta, "prompt_words": 8}
        with tempfile.TemporaryDirectory() as tmp:
            trl = trl_peak(spec, Path(tmp), settings, fold_in_place)
        ours = vlmprobe_peak(settings, trl["prompt_length"], trl["optimizer"])
        trl_step, our_step = trl["peak"] - trl["before"], ours["peak"] - ours["before"]
        rows.append({"beta": beta, "TRL fold": "in place (as Triton)" if fold_in_place else "torch (TRL on CPU)",
                     "rows": args.rows, "prompt": trl["prompt_length"], "completion": args.completion,
                     "optimizer": trl["optimizer"], "TRL step peak MiB": trl_step / MiB,
                     "vlmprobe step peak MiB": our_step / MiB, "ratio": our_step / trl_step,
                     "vlmprobe peak phase": ours["phase"]})
    print(pd.DataFrame(rows).round(4).to_string(index=False))
    print("\nstep peak = peak over one optimizer step minus what was allocated when it started (vlmprobe: its models, "
          "after_load_bytes; TRL: what it had made by then, its weights loaded from safetensors pass no op the tracker sees); "
          "MiB = 2**20 bytes; both on the cpu backend (real CPU tensors). vlmprobe allocates what TRL's CUDA path "
          "(Triton fold, in place) allocates: the row with TRL's fold in place compares like with like.")


if __name__ == "__main__":
    main()
