#!/usr/bin/env python
"""vlmprobe's GRPO and DPO steps against TRL's own GRPOTrainer and DPOTrainer, both on the cpu backend (real CPU
tensors, vlmprobe's tracker counting every storage as the CUDA caching allocator would), printed as one table.

TRL side: the tiny Qwen2.5-VL (conf/model/qwen2_5_vl_tiny.yaml, random weights, saved to a temporary dir so
TRL loads the policy and its reference copy itself), a word-level tokenizer and Qwen2VLImageProcessorPil made
here (no hub access), an in-memory dataset of one batch (GRPO: two prompts; DPO: --rows pairs), one 112 px
image + a few words each (DPO: a chosen and a rejected completion of --completion words each), float32, no checkpointing, max_steps=1. GRPO: a constant
reward function, completions forced to full length with generation_kwargs min_new_tokens. The peak is read over
trainer.train() with the models already loaded. vlmprobe side: the same settings as a step=grpo / step=dpo
point, data.lm_max_length = the prompt length TRL's processor made, the optimizer implementation TRL's AdamW ran
with, step.compact=false (TRL without Triton projects every position), measure.steps=1; its peak minus what it
had loaded before the step (after_load_bytes) against TRL's peak minus the same (models + dataset when train()
starts).

    pip install -e ".[trl]"; python scripts/check_trl.py [--step grpo|dpo]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

from vlmprobe.sizes import MiB

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


def prompt_of(settings: dict) -> list[dict]:
    """Every sample's prompt: one image and `prompt_words` words (one token each)."""
    words = " ".join(f"w{i}" for i in range(settings["prompt_words"]))
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words}]}]


def trainer_of(step: str, model_dir: Path, processor, settings: dict, out: Path):
    """TRL's trainer for `step` on a dataset of one batch: GRPO's two prompts (x 2 generations), DPO's `rows` pairs."""
    import torch
    from datasets import Dataset
    from PIL import Image

    size = settings["image_size"]
    samples = [{"prompt": prompt_of(settings), "image": Image.new("RGB", (size, size), color=(i * 60, 90, 30))}
               for i in range(2 if step == "grpo" else settings["rows"])]
    common = dict(output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                  max_steps=1, per_device_train_batch_size=settings["rows"], report_to=[], save_strategy="no",
                  logging_strategy="no", dataloader_num_workers=0, seed=0, model_init_kwargs={"dtype": torch.float32})
    if step == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(num_generations=settings["generations"], max_completion_length=settings["completion"],
                            beta=settings["beta"], loss_type="grpo",
                            generation_kwargs={"min_new_tokens": settings["completion"]}, **common)
        return GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [1.0] * len(completions),
                           args=config, train_dataset=Dataset.from_list(samples), processing_class=processor)
    from trl import DPOConfig, DPOTrainer

    def answer(first):  # an assistant turn of exactly `completion` words (one token each)
        text = " ".join(f"w{first + i}" for i in range(settings["completion"]))
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    for sample in samples:
        sample.update(chosen=answer(100), rejected=answer(200))
    config = DPOConfig(max_length=None, **common)
    trainer = DPOTrainer(model=str(model_dir), args=config, train_dataset=Dataset.from_list(samples),
                         processing_class=processor)
    # On CUDA the HF Trainer's _prepare_inputs copies the collated batch to the device, where the allocator counts
    # it; on the CPU that move is a no-op, and the tensors the processor made from numpy arrays (pixel_values,
    # image_grid_thw) never pass an op the tracker sees. A copy of each tensor here is the device's copy.
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda inputs: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                              for k, v in prepare(inputs).items()}
    return trainer


def trl_peak(step: str, spec, out: Path, settings: dict, fold_in_place: bool) -> dict:
    """TRL's trainer, one step, under the cpu backend's tracker. fold_in_place: TRL's torch fold of each
    logits tile (its CPU stand-in for the Triton kernel) replaced by one that allocates nothing, as the Triton
    kernel on CUDA (values become meaningless; allocations are then the CUDA path's)."""
    import contextlib

    import torch
    from PIL import Image
    from trl.kernels import chunked_logprob

    from vlmprobe.backends import get

    model_dir = out / "tiny"
    spec.build(torch.device("cpu"), torch.float32).save_pretrained(model_dir)
    processor = tiny_processor(spec)
    folds = (chunked_logprob._forward_tile, chunked_logprob._backward_tile)
    if fold_in_place:
        chunked_logprob._forward_tile = chunked_logprob._backward_tile = lambda *args, **kwargs: None
    with contextlib.ExitStack() as restore, get("cpu").session(None) as meter:
        restore.callback(setattr, chunked_logprob, "_forward_tile", folds[0])
        restore.callback(setattr, chunked_logprob, "_backward_tile", folds[1])
        trainer = trainer_of(step, model_dir, processor, settings, out)
        before = meter.current()
        meter.reset_peak()
        trainer.train()
        peak = meter.peaks()["allocated"]
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    impl = "fused" if optimizer.defaults.get("fused") else "foreach" if optimizer.defaults.get("foreach") else "single_tensor"
    text = processor.apply_chat_template(prompt_of(settings), tokenize=False)
    size = settings["image_size"]
    length = len(processor(images=[Image.new("RGB", (size, size))], text=[text])["input_ids"][0])
    return {"before": before, "peak": peak, "optimizer": impl, "prompt_length": length}


def vlmprobe_peak(step: str, settings: dict, prompt_length: int, optimizer: str) -> dict:
    from vlmprobe.config.plan import plan_overrides
    from vlmprobe.point.measure import measure

    option = {"foreach": "adamw", "fused": "adamw_fused", "single_tensor": "adamw_single_tensor"}[optimizer]
    knobs = ([f"step.num_generations={settings['generations']}", f"step.max_completion_length={settings['completion']}",
              f"step.beta={settings['beta']}"] if step == "grpo" else [f"step.completion_length={settings['completion']}"])
    (point,) = plan_overrides(["model=qwen2_5_vl_tiny", f"step={step}", "measure.backend=cpu", "measure.steps=1",
                               f"optimizer={option}", "train.autocast_dtype=null", "step.compact=false",
                               f"data.batch_size={settings['rows']}", f"data.lm_max_length={prompt_length}", *knobs])
    row = measure(point.config)
    return {"before": row["after_load_bytes"], "peak": row["peak_allocated_bytes"], "phase": row["peak_phase"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", choices=("grpo", "dpo"), action="append",
                        help="the step(s) to check (default: both)")
    parser.add_argument("--rows", type=int, default=4, help="per_device_train_batch_size (DPO: preference pairs)")
    parser.add_argument("--completion", type=int, default=16, help="completion tokens (DPO: of each of the pair)")
    args = parser.parse_args()
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from vlmprobe.paths import CONF

    spec = instantiate(OmegaConf.load(CONF / "model" / "qwen2_5_vl_tiny.yaml"), _convert_="all")
    cases = {"grpo": ((0.04, False), (0.0, False), (0.04, True)), "dpo": ((None, False), (None, True))}
    rows = []
    for step in args.step or ("grpo", "dpo"):
        for beta, fold_in_place in cases[step]:
            settings = {"rows": args.rows, "generations": 2, "completion": args.completion, "beta": beta,
                        "prompt_words": 8, "image_size": spec.native_image_size}
            with tempfile.TemporaryDirectory() as tmp:
                trl = trl_peak(step, spec, Path(tmp), settings, fold_in_place)
            ours = vlmprobe_peak(step, settings, trl["prompt_length"], trl["optimizer"])
            trl_step, our_step = trl["peak"] - trl["before"], ours["peak"] - ours["before"]
            rows.append({"step": step, "beta": "" if beta is None else beta,
                         "TRL fold": "in place (as Triton)" if fold_in_place else "torch (TRL on CPU)",
                         "rows": args.rows, "prompt": trl["prompt_length"], "completion": args.completion,
                         "optimizer": trl["optimizer"], "TRL step peak MiB": trl_step / MiB,
                         "vlmprobe step peak MiB": our_step / MiB, "ratio": our_step / trl_step,
                         "vlmprobe peak phase": ours["phase"]})
    print(pd.DataFrame(rows).round(4).to_string(index=False))
    print("\nstep peak = peak over one optimizer step minus what was allocated when it started (vlmprobe: its models, "
          "after_load_bytes; TRL: what it had made by then, its weights loaded from safetensors pass no op the tracker sees); "
          "MiB = 2**20 bytes; both on the cpu backend (real CPU tensors). vlmprobe allocates what TRL's CUDA path "
          "(Triton fold, in place) allocates: the rows with TRL's fold in place compare like with like. DPO: rows = "
          "preference pairs (2 x rows sequences per forward), beta = TRL's default.")


if __name__ == "__main__":
    main()
