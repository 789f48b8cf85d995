"""Qwen3-VL: transformers' Qwen3VLForConditionalGeneration with random weights. The processor, the image
arithmetic, the batch, the loss and generation are Qwen2-VL's (qwen2_vl.py), read from transformers 5.23:

- Images: Qwen3VLProcessor uses Qwen2VLImageProcessor (image_processing_auto maps qwen3_vl to it), the same
  smart_resize with patch 16 instead of 14, so a side is a multiple of 16 x merge 2 = 32 px and a patch is
  3 x 2 x 16 x 16 = 1536 values; the published bounds are min_pixels 65536 (256 x 256) and max_pixels
  16777216 (4096 x 4096). One <|image_pad|> per merged token, between <|vision_start|> and <|vision_end|>.
- M-RoPE positions: Qwen3VLModel.get_rope_index gives a still image (p, p + row, p + col) and continues at
  p + max(rows, cols) // merge, as Qwen2-VL does (the interleaved frequency layout, mrope_interleaved,
  changes which frequencies each axis gets, not the positions); generate reads them through the same
  _prepare_position_ids_for_generation, so step=grpo runs as for Qwen2-VL.

What differs is inside the model, and runs as the model runs it (no input of its own):
- Vision tower: LayerNorm blocks with a plain GELU MLP, a learned 48 x 48 position table bilinearly resampled
  to each image's patch grid (added to the patch embeddings) besides the 2-D rope, and a 2 x 2 patch merger.
- DeepStack: the hidden states after the blocks in `deepstack_visual_indexes` ([8, 16, 24] in the 8B) go
  through merger-shaped projectors of their own (`deepstack_merger_list`); the LM adds the k-th of them to
  its hidden states at the image-token positions after decoder layer k (Qwen3VLTextModel._deepstack_process:
  a clone of the hidden states, a boolean-mask gather, add and scatter per layer), so the first
  len(deepstack_visual_indexes) LM layers each keep an image-sized tensor alive for backward. The estimate
  traces that path because it runs the real forward: the boolean masks come from the constant input_ids
  (vlmprobe/models/fake_constants.py), so the gathers have known sizes under fake tensors.
- LM: Qwen3 (per-head RMSNorm on q and k, no q/k/v bias).

Videos are refused: Qwen3VLProcessor writes each temporal patch's timestamp ("<1.5 seconds>") as text before
its tokens, and how many tokens that text takes only the model's tokenizer can say.

Towers: the merger and the DeepStack projectors live inside `visual`, so they go with the vision tower
(frozen with it), as for Qwen2-VL's merger.

Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B; `Qwen3VLMoeSpec`) is this model with a mixture-of-experts LM: in each
layer a router (a num_experts x width weight, softmax, top num_experts_per_tok, renormalised) and the experts as
two fused 3-D weights, gate_up_proj (experts, 2 x moe_intermediate, width) and down_proj (experts, width,
moe_intermediate), run as transformers' `experts_implementation` says (transformers 5.24, integrations/moe.py):
- "grouped_mm" (its default): the (token, choice) pairs sorted by expert, the tokens gathered in that order
  (tokens x top_k rows), one grouped multiply per projection over every expert's weights (torch._grouped_mm),
  the routing weights applied and the rows put back in order and summed per token. What it allocates and keeps
  for backward is sized by tokens x top_k, whichever experts the router picks, so fake tensors give it exactly.
  grouped_mm has no autocast kernel and transformers casts the tokens to the experts' dtype: fp32 weights under
  bf16 autocast run the experts in fp32 on CUDA (its fallback kernel), and so here (estimate/grouped_mm.py).
- "batched_mm": each (token, choice) pair gathers its expert's weights, (tokens x top_k, 2 x moe_intermediate,
  width) and (tokens x top_k, width, moe_intermediate) per layer, and multiplies them one by one (bmm): meant
  for decoding a few tokens, a training sequence's gathered weights alone are tokens x top_k times one expert.
- "eager" (a Python loop over the experts the router hit, each taking its tokens) is refused: its tensors' sizes
  are how many tokens each expert got, which random weights decide, and fake tensors cannot know.
LoRA (train.lora_target_modules) adapts nn.Linear modules by name: the experts are not modules of their own, so
they stay frozen under LoRA, as peft's target_modules leaves them (the router `gate` likewise), unless
train.lora_target_parameters names their weights (peft's target_parameters: the whole stack merged with B A in
every forward, vlmprobe.knobs.add_lora).
"""

from __future__ import annotations

from vlmprobe.errors import ConfigError, whole
from vlmprobe.models.base import DataShape
from vlmprobe.models.qwen2_vl import Qwen2VLSpec


class Qwen3VLSpec(Qwen2VLSpec):
    """Hydra target for conf/model/qwen3_vl_*.yaml."""

    config_class = "Qwen3VLConfig"
    model_class = "Qwen3VLForConditionalGeneration"
    # Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json: size.shortest_edge 65536 (256 * 256), size.longest_edge
    # 16777216 (4096 * 4096)
    published_pixels = (65536, 16777216)

    def video_tokens(self, data: DataShape) -> int:
        # Qwen3VLProcessor writes each temporal patch's timestamp as text ("<1.5 seconds>") before its tokens: a
        # count only the model's tokenizer gives, which vlmprobe does not have (no hub access, nothing downloaded)
        if data.videos_per_sample:
            raise ConfigError(f"data.videos_per_sample={data.videos_per_sample} is not allowed for {self.name}: "
                              f"Qwen3-VL writes every frame's timestamp into the prompt as text that only its "
                              f"tokenizer can count; videos are modelled for Qwen2-VL and Qwen2.5-VL; use 0")
        return 0


EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")  # transformers' experts_implementation values modelled here


class Qwen3VLMoeSpec(Qwen3VLSpec):
    """Hydra target for conf/model/qwen3_vl_30b_a3b.yaml and qwen3_vl_moe_tiny.yaml: Qwen3-VL, mixture-of-experts LM."""

    config_class = "Qwen3VLMoeConfig"
    model_class = "Qwen3VLMoeForConditionalGeneration"

    def __init__(self, *args, experts_implementation: str = "grouped_mm", **kwargs):
        super().__init__(*args, **kwargs)
        if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            why = (" (eager's tensors are sized by how many tokens the router sends each expert, which fake tensors "
                   "cannot know)" if experts_implementation == "eager" else "")
            raise ConfigError(f"model.experts_implementation={experts_implementation!r} is not allowed for "
                              f"{self.name}: use {' or '.join(EXPERTS_IMPLEMENTATIONS)}{why}")
        self.experts_implementation = experts_implementation
        experts, top_k = self.text.get("num_experts", 0), self.text.get("num_experts_per_tok", 0)
        # the router's topk would refuse more experts than there are (an error row after the model is built) and
        # route nothing with none: refused here, before any work
        if whole(experts) and experts > 0 and not (whole(top_k) and 1 <= top_k <= experts):
            raise ConfigError(f"model.text.num_experts_per_tok={top_k!r} is not allowed for {self.name}: each token "
                              f"goes to 1 to num_experts ({experts}) experts")

    def config(self):
        config = super().config()
        config._experts_implementation = self.experts_implementation  # transformers' setter sets the sub-configs too
        return config
