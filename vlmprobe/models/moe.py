"""What a mixture-of-experts LM adds to a family (Qwen3-VL-MoE, GLM-4.5V): transformers' `experts_implementation`,
checked where it enters and set on the model's config, and the top-k checked against the experts there are.

The routed experts are two fused 3-D weights per layer (transformers 5.24, integrations/moe.py). "grouped_mm" (the
default) and "batched_mm" allocate by tokens x top_k, whichever experts the router picks, so fake tensors give them
exactly; "eager" is refused: its sizes are how many tokens each expert got, which random weights decide. The
experts are not modules of their own, so LoRA's target_modules leaves them (and the router) frozen unless
train.lora_target_parameters names their weights (vlmprobe.knobs.add_lora).
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
