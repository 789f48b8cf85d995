"""What a mixture-of-experts LM adds to a family (Qwen3-VL-MoE, GLM-4.5V): transformers' `experts_implementation`,
checked where it enters and set on the model's config, and the top-k checked against the experts there are.

Every such LM in transformers 5.24 keeps its routed experts as two fused 3-D weights per layer, gate_up_proj
(experts, 2 x moe_intermediate, width) and down_proj (experts, width, moe_intermediate), run as
`experts_implementation` says (integrations/moe.py):
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
every forward, vlmprobe.knobs.add_lora). A shared expert (GLM-4.5V) is an ordinary MLP of nn.Linear modules.
"""

from __future__ import annotations

from vlmprobe.errors import ConfigError, whole

__all__ = ["MixtureOfExperts"]

EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")  # transformers' experts_implementation values modelled here


class MixtureOfExperts:
    """Mixed into a family spec before its base class (class XMoeSpec(MixtureOfExperts, XSpec)): the spec's
    `text` dict names the routed experts under `experts_key`."""

    experts_key = "num_experts"  # the text config's count of routed experts (GLM-4.5V: n_routed_experts)

    def __init__(self, *args, experts_implementation: str = "grouped_mm", **kwargs):
        super().__init__(*args, **kwargs)
        if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            why = (" (eager's tensors are sized by how many tokens the router sends each expert, which fake tensors "
                   "cannot know)" if experts_implementation == "eager" else "")
            raise ConfigError(f"model.experts_implementation={experts_implementation!r} is not allowed for "
                              f"{self.name}: use {' or '.join(EXPERTS_IMPLEMENTATIONS)}{why}")
        self.experts_implementation = experts_implementation
        experts, top_k = self.text.get(self.experts_key, 0), self.text.get("num_experts_per_tok", 0)
        # the router's topk would refuse more experts than there are (an error row after the model is built) and
        # route nothing with none: refused here, before any work
        if whole(experts) and experts > 0 and not (whole(top_k) and 1 <= top_k <= experts):
            raise ConfigError(f"model.text.num_experts_per_tok={top_k!r} is not allowed for {self.name}: each token "
                              f"goes to 1 to {self.experts_key} ({experts}) experts")

    def config(self):
        config = super().config()
        config._experts_implementation = self.experts_implementation  # transformers' setter sets the sub-configs too
        return config
