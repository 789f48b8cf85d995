"""Per-token log-probabilities of the completion tokens: the two logits paths TRL has had, VLM-R1's own, and
LLaMA-Factory's DPO one (`full_fp32`, documented where it is defined).
- `chunked` (TRL >= 1.x; trl 1.16 trainer/utils.py add_fused_lm_head): the LM head in tiles of 4096 tokens x
  32768 vocabulary columns, folded into online-logsumexp statistics; no [tokens, vocab] tensor ever lives. This
  module allocates what TRL's CUDA path allocates, op for op, projecting only the completion positions
  (`compact`); `compact=False` projects every position, as TRL does on the CPU.
- `logits_to_keep` (TRL 0.17, what VLM-R1 pins): the model's own head over the last C + 1 positions.
- `full_sequence` (VLM-R1's own VLMGRPOTrainer._get_per_token_logps): the model's head over every position.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from vlmprobe.models.base import unwrapped

__all__ = ["chunked", "full_fp32", "full_sequence", "gathered", "logits_to_keep"]

TOKEN_CHUNK = 4096  # tokens per projection tile (TOKEN_CHUNK_SIZE)
VOCAB_CHUNK = 32768  # vocabulary columns per tile (_CHUNKED_LOGPROB_CHUNK_SIZE)
STATISTICS = 7  # float32 vectors of N the forward keeps while it folds (max, sums, target logit, ...)


class ChunkedLogProb(torch.autograd.Function):
    """ChunkedLogProbFunction's allocations on CUDA: the per-token log-probabilities of `hidden @ weight.T` at
    `targets`, and the `extras` asked for among entropy, mean_logits and is_top1 (each None when not asked for): its
    `outputs` argument."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, extras: tuple[str, ...]):
        # no zeros are made for an output backward gets no gradient for (entropy logged, not in the loss)
        ctx.set_materialize_grads(False)
        n, device = hidden.shape[0], hidden.device
        compute = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        # running max, sum exp, x sum exp, sq sum exp, z sum, max before target, target logit
        stats = [torch.zeros(n, device=device, dtype=torch.float32) for _ in range(STATISTICS)]
        buf = torch.empty(min(n, TOKEN_CHUNK), VOCAB_CHUNK, device=device, dtype=compute)
        _project(hidden, weight, compute, buf, lambda tile, rows, cols, chunk, w: None)
        del buf
        log_z = stats[0] + torch.log(stats[1])  # running max + log(sum exp)
        log_probs = stats[6] - log_z  # target logit - log Z
        entropy = log_z - stats[2] / stats[1] if "entropy" in extras else None
        mean_logits = stats[4] / weight.shape[0] if "mean_logits" in extras else None
        is_top1 = (stats[6] >= stats[0]) & (stats[6] > stats[5]) if "is_top1" in extras else None
        del stats
        ctx.save_for_backward(hidden, weight, targets, log_z, log_z if entropy is None else entropy)
        ctx.mark_non_differentiable(*(x for x in (mean_logits, is_top1) if x is not None))
        ctx.compute = compute
        return log_probs, entropy, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, *_):
        hidden, weight, _, _, _ = ctx.saved_tensors
        with gathered(weight):  # the backward recomputes the tiles: the ZeRO-3 head is gathered again
            needs_hidden, needs_weight = ctx.needs_input_grad[:2]
            grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if needs_hidden else None
            grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if needs_weight else None
            buf = torch.empty(min(hidden.shape[0], TOKEN_CHUNK), VOCAB_CHUNK, device=hidden.device, dtype=ctx.compute)
            incoming = [g.float().contiguous() for g in (grad_log_probs, grad_entropy) if g is not None]  # live through the loop

            def accumulate(tile, rows, cols, hidden_chunk, w_chunk):
                # the fold turns the tile into d(loss)/d(logits) in place; then grad_hidden[rows] += tile @ w_chunk
                # and grad_weight[cols] += tile.T @ hidden_chunk, in float32 accumulators
                if grad_hidden is not None and tile.dtype == torch.float32:
                    grad_hidden[rows].addmm_(tile, w_chunk)
                if grad_weight is not None and tile.dtype == torch.float32:
                    grad_weight[cols].addmm_(tile.t(), hidden_chunk)

            _project(hidden, weight, ctx.compute, buf, accumulate)
            del buf, incoming
            return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                    grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None)


def _project(hidden, weight, compute, buf, fold) -> None:
    """Every [token chunk, vocab chunk] tile of hidden @ weight.T into `buf`, handed to `fold`. The chunks
    are cast to the compute dtype first (a copy where the dtype differs, as `.to` makes)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    for start in range(0, n, TOKEN_CHUNK):
        rows = slice(start, min(start + TOKEN_CHUNK, n))
        hidden_chunk = hidden[rows].to(compute)
        for first in range(0, vocab, VOCAB_CHUNK):
            cols = slice(first, min(first + VOCAB_CHUNK, vocab))
            w_chunk = weight[cols].to(compute)
            tile = buf[: rows.stop - rows.start, : cols.stop - cols.start]
            torch.mm(hidden_chunk, w_chunk.t(), out=tile)
            fold(tile, rows, cols, hidden_chunk, w_chunk)


def chunked(model, batch: dict, completion: int, compact: bool, extras: tuple[str, ...]):
    """(log_probs, entropy, mean_logits, is_top1) [rows, completion] through TRL's fused LM head (each of the
    last three None unless in `extras`): add_fused_lm_head replaces the model's forward, so the call goes
    through whatever wraps the model (DDP, a DeepSpeed engine, FSDP2's hooks, which gather the root's
    parameters, the head's among them, for the forward)."""
    module = unwrapped(model)
    module.forward = functools.partial(_fused_forward, module, batch["labels"], completion, compact, extras)
    try:
        per_token = model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        del module.forward  # the class's forward again
    return tuple(None if x is None else x[:, -completion:] for x in per_token)


def _fused_forward(model, labels, completion: int, compact: bool, extras: tuple[str, ...], **inputs):
    """add_fused_lm_head's forward with fused_lm_head=True: the backbone, then the head over the scored
    positions; per-token values at every position, as the forward returns them (the caller slices)."""
    hidden = model.model(**inputs, attention_mask=None, use_cache=False).last_hidden_state  # (B, L, H)
    rows, length, width = hidden.shape
    if compact:  # hidden_states[mask], labels[mask]: the completion positions, gathered into new tensors
        states = fresh(hidden[:, length - 1 - completion:length - 1].reshape(-1, width))
        targets = fresh(labels[:, length - completion:].reshape(-1))
    else:  # every position: hidden_states.reshape(-1, H) of the shifted states
        states = hidden[:, :-1].reshape(-1, width)
        targets = labels[:, 1:].clamp(min=0).reshape(-1)
    with gathered(model.lm_head.weight):
        per_token = ChunkedLogProb.apply(states, model.lm_head.weight, targets, extras)
    mask = labels[:, 1:] != -100
    if compact:  # x.new_zeros(mask.shape).masked_scatter(mask, x)
        return tuple(None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token)
    return tuple(None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in per_token)  # every position


def gathered(weight: torch.Tensor):
    """TRL's maybe_gather_lm_head_ctx: under ZeRO-3 the head's weight is a partition outside its module's forward,
    and the fused head reads it without calling the module, so it is gathered whole around the kernel (forward, and
    again in backward) and partitioned again after; a null context elsewhere, or where it is gathered already (a
    head tied to the embedding)."""
    status = getattr(weight, "ds_status", None)
    if status is None:
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return contextlib.nullcontext() if status == ZeroParamStatus.AVAILABLE else deepspeed.zero.GatheredParameters([weight])


def fresh(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor of its own, as boolean-mask indexing always returns: reshape copies a strided slice
    already, and returns a view of a contiguous one (one row), which is copied here."""
    return t.clone() if t._base is not None else t


def logits_to_keep(model, batch: dict, completion: int, temperature: float = 1.0):
    """(log_probs, None) [rows, completion] as TRL 0.17's _get_per_token_logps: logits of the last C + 1
    positions, the last dropped, divided by the temperature, selective_log_softmax."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, attention_mask=None, use_cache=False, logits_to_keep=completion + 1).logits
    logits = logits[:, :-1] / temperature
    index = batch["input_ids"][:, -completion:]
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        log_z = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return selected - log_z, None
    rows = [torch.log_softmax(row, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1) for row, ids in zip(logits, index)]
    return torch.stack(rows), None


def full_sequence(model, batch: dict, completion: int):
    """(log_probs, None) [rows, completion] as VLM-R1's _get_per_token_logps: logits over every position, the
    last dropped, log_softmax and gather row by row (a loop "to reduce memory peak"), then the completion."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, attention_mask=None, use_cache=False).logits[:, :-1]
    ids = batch["input_ids"][:, 1:]
    rows = [torch.gather(row.log_softmax(dim=-1), dim=1, index=i.unsqueeze(1)).squeeze(1) for row, i in zip(logits, ids)]
    return torch.stack(rows)[:, -completion:], None


def full_fp32(model, batch: dict, clone: bool):
    """(summed log-probabilities [rows] of the labelled positions, the float32 logits) as LLaMA-Factory's
    CustomDPOTrainer.concatenated_forward + get_batch_logps: the model's logits of every position, upcast at once
    to float32 (a copy), log_softmax of all but the last (kept for backward), gathered at the next label, summed
    where labelled. The trainer keeps the logits for its metrics (chosen_logits / rejected_logits) until its loss
    is made. clone: the batch cloned first (nested_detach(batch, clone=True), which it does with a reference)."""
    if clone:
        batch = {k: v.detach().clone() for k, v in batch.items()}
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits.to(torch.float32)
    labels = batch["labels"][:, 1:].clone()
    loss_mask = labels != -100
    labels[labels == -100] = 0
    per_token = torch.gather(logits[:, :-1, :].log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token * loss_mask).sum(-1), logits
