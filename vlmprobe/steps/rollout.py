"""The rollout of a GRPO step: the policy generates `max_completion_length` tokens for every row with the
model's own `generate`, under no_grad, as TRL's GRPOTrainer does (trl 1.16 grpo_trainer.py,
_generate_single_turn). Every row is forced to the full length (EOS is masked out), the worst case a run reaches.

Two ways to run it, the same peak: `full` generates token by token, as TRL does; `last_step` (the default) runs
the real prefill and the last decode step, the KV cache grown in place of the C - 2 middle steps. Nothing in the
loop grows faster than the KV cache, so the peak is at the prefill or at the last decode step.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["rollout", "ROLLOUTS"]

ROLLOUTS = ("last_step", "full")


@contextlib.contextmanager
def checkpointing_off(model: torch.nn.Module):
    """Gradient checkpointing off for generation (TRL's unwrap_model_for_generation), back on after."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


@contextlib.contextmanager
def stop_after(model: torch.nn.Module, tokens: int):
    """generate's loop stops after exactly `tokens` tokens. It asks `_has_unfinished_sequences` before each
    token (transformers 5.17-5.23 _sample: the first pass samples from the prefill); that answer comes from
    reading whether any row is unfinished, which fake tensors cannot give (the tracker answers "not
    finished", so the loop would never end). With every row forced to the full length the real answer is
    "unfinished" for exactly `tokens` passes: the count gives it on every backend."""
    left = [tokens]

    def has_unfinished_sequences(this_peer_finished, synced_gpus, device):
        left[0] -= 1
        return left[0] >= 0

    model._has_unfinished_sequences = has_unfinished_sequences
    try:
        yield
    finally:
        del model._has_unfinished_sequences


def generation_config(spec, new_tokens: int) -> dict:
    """TRL's generation kwargs (GRPOTrainer.__init__, trl 1.16) with the full length forced."""
    eos = spec.token_ids["eos_token_id"]
    # TRL passes the tokenizer's pad id: the model's own where its config names one (GLM's <|endoftext|>), else
    # its end-of-sequence id (the first, where the config lists several: GLM's)
    pad = spec.text.get("pad_token_id", eos if isinstance(eos, int) else eos[0])
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": True, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "pad_token_id": pad, "eos_token_id": eos,
            "suppress_tokens": [spec.token_ids["image_token_id"]], "use_cache": True}


def rollout(spec, model, data, device, completion_length: int, how: str) -> torch.Tensor:
    """(rows, prompt + completion) ids the policy generated for one synthetic prompt batch of `data`."""
    kwargs, context = spec.generation_inputs(model, data, device)
    with torch.no_grad(), checkpointing_off(model), context:
        if how == "full" or completion_length < 3:  # nothing between the first and the last step to skip
            with stop_after(model, completion_length):
                return model.generate(**kwargs, **generation_config(spec, completion_length))
        return _last_step(model, spec, kwargs, completion_length)


def _last_step(model, spec, kwargs: dict, completion_length: int) -> torch.Tensor:
    from transformers import DynamicCache
    from transformers.generation.utils import ALL_CACHE_NAMES

    # generate's name for a cache it is given, its first "cache name": past_key_values up to transformers 5.23,
    # cache from 5.24 (which warns that past_key_values goes in 6.0)
    cache_kwarg = ALL_CACHE_NAMES[0]

    features = []  # the image features generate encodes before the prefill and holds until it returns
    encode = model.model.get_image_features

    @functools.wraps(encode)  # generate picks the encoder's inputs by its signature
    def get_image_features(*args, **kw):
        features.append(encode(*args, **kw))
        return features[-1]

    model.model.get_image_features = get_image_features  # an instance attribute over the context's own
    try:
        with stop_after(model, 1):
            first = model.generate(**kwargs, **generation_config(spec, 1), return_dict_in_generate=True)
    finally:
        model.model.get_image_features = encode
    cache: DynamicCache = first.past_key_values
    grow = completion_length - 2  # tokens the skipped middle steps would have added to the cache
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(*layer.keys.shape[:2], grow, layer.keys.shape[3])], dim=-2)
        layer.values = torch.cat([layer.values, layer.values.new_zeros(*layer.values.shape[:2], grow, layer.values.shape[3])], dim=-2)
    ids = first.sequences
    del first
    # the sequence before the last step: prompt + C - 1 tokens, of which the cache holds all but the newest
    ids = torch.cat([ids, ids[:, -1:].expand(-1, grow)], dim=1)
    rest = {k: torch.cat([v, v.new_zeros(v.shape[0], ids.shape[1] - v.shape[1])], dim=1)
            for k, v in kwargs.items() if k.endswith("token_type_ids")}  # text from here on
    with stop_after(model, 1):
        out = model.generate(input_ids=ids, **{cache_kwarg: cache}, **rest, **generation_config(spec, 1))
    features.clear()  # generate has returned: the image features it held go now
    return out
