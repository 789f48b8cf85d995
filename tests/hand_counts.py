"""Parameter counts by hand from a config's numbers (no transformers), shared by the families' tests."""


def llama_params(t: dict) -> int:
    """A Llama LM without its head: embedding, per layer q/k/v/o and a SwiGLU MLP without bias and two
    RMSNorms, the final norm."""
    d, f, head = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    layer = d * t["num_attention_heads"] * head * 2 + 2 * d * t["num_key_value_heads"] * head + 3 * d * f + 2 * d
    return t["vocab_size"] * d + t["num_hidden_layers"] * layer + d


def siglip_params(v: dict) -> int:
    """A SigLIP vision transformer without pooling head (Idefics3's and Gemma 3's towers): Conv2d patch
    embedding with bias, a position embedding per patch, per layer four attention Linears and two MLP Linears
    with bias and two LayerNorms, the post-LayerNorm."""
    d, f, side = v["hidden_size"], v["intermediate_size"], v["image_size"] // v["patch_size"]
    embeddings = v["num_channels"] * v["patch_size"] ** 2 * d + d + side**2 * d
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    return embeddings + v["num_hidden_layers"] * layer + 2 * d


def qk_norm_lm_params(t: dict, norms_per_layer: int) -> int:
    """An LM without its head whose attention normalises each head's q and k (Gemma 3, Qwen3): embedding, per
    layer q/k/v/o without bias, an RMSNorm of head_dim over q and one over k, a gated MLP without bias and
    `norms_per_layer` RMSNorms of the width (Qwen3 2, Gemma 3 4), the final norm."""
    d, f, head = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * head, t["num_key_value_heads"] * head
    layer = 2 * d * q + 2 * d * kv + 2 * head + 3 * d * f + norms_per_layer * d
    return t["vocab_size"] * d + t["num_hidden_layers"] * layer + d


def clip_vision_params(v: dict) -> int:
    """transformers' CLIPVisionModel (LLaVA's and LLaVA-NeXT's tower): class embedding, Conv2d patch embedding
    without bias, a position embedding per patch + class token, the pre-LayerNorm, per layer four attention
    Linears and two MLP Linears with bias and two LayerNorms, the post-LayerNorm."""
    d, f, patches = v["hidden_size"], v["intermediate_size"], (v["image_size"] // v["patch_size"]) ** 2
    embeddings = d + v["num_channels"] * v["patch_size"] ** 2 * d + (patches + 1) * d
    layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    return embeddings + 2 * d + v["num_hidden_layers"] * layer + 2 * d


def qwen2_params(t: dict) -> int:
    """A Qwen2 LM without its head: as Llama, plus biases on q, k and v."""
    d, f, head = t["hidden_size"], t["intermediate_size"], t["hidden_size"] // t["num_attention_heads"]
    q, kv = t["num_attention_heads"] * head, t["num_key_value_heads"] * head
    layer = (d * q + q) + 2 * (d * kv + kv) + q * d + 3 * d * f + 2 * d
    return t["vocab_size"] * d + t["num_hidden_layers"] * layer + d


def qwen3_vl_vision_params(v: dict) -> int:
    """Hand count of a Qwen3-VL vision tower from its config (no transformers): Conv3d patch embedding with
    bias, the learned position table; per block two LayerNorms, qkv and proj with bias, a 2-Linear MLP with
    bias; the merger (LayerNorm over the width, two Linears 4 * width -> 4 * width -> out) and one DeepStack
    projector per deepstack index (the same, its LayerNorm over 4 * width)."""
    d, f, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * d + d
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    merged = d * v["spatial_merge_size"] ** 2
    linears = (merged * merged + merged) + (merged * out + out)
    deepstack = len(v["deepstack_visual_indexes"]) * (2 * merged + linears)
    return patch + v["num_position_embeddings"] * d + v["depth"] * block + (2 * d + linears) + deepstack


def qwen3_moe_lm_params(t: dict) -> int:
    """A Qwen3-MoE LM without its head (Qwen3-VL-MoE's): qk_norm_lm_params' Qwen3 layers whose MLP is, in each
    layer not in mlp_only_layers, a router (num_experts x width, no bias) and num_experts SwiGLU experts of
    moe_intermediate_size without bias (gate, up and down: 3 x width x moe_intermediate each)."""
    d, experts = t["hidden_size"], t["num_experts"]
    sparse = [i for i in range(t["num_hidden_layers"]) if i not in t["mlp_only_layers"]
              and (i + 1) % t["decoder_sparse_step"] == 0]
    moe = experts * d + experts * 3 * d * t["moe_intermediate_size"]
    return qk_norm_lm_params(t, 2) + len(sparse) * (moe - 3 * d * t["intermediate_size"])


def glm4v_vision_params(v: dict) -> int:
    """A GLM-4.1V / GLM-4.5V vision tower: Conv3d patch embedding with bias, a learned position table of
    (image_size / patch)^2 entries, RMSNorms after the patch embedding and after the blocks; per block two
    RMSNorms, qkv and proj without bias (attention_bias false) and a gated SiLU MLP out_hidden_size wide without
    bias; a merge x merge stride-merge Conv2d to out_hidden_size with bias; the merger: a square Linear, a
    LayerNorm and a gated MLP of intermediate_size, no biases."""
    d, out, f = v["hidden_size"], v["out_hidden_size"], v["intermediate_size"]
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * d + d
    positions = (v["image_size"] // v["patch_size"]) ** 2 * d
    block = 2 * d + 3 * d * d + d * d + 3 * d * out
    downsample = d * out * v["spatial_merge_size"] ** 2 + out
    merger = out * out + 2 * out + 3 * out * f
    return patch + positions + 2 * d + v["depth"] * block + downsample + merger


def glm4_lm_params(t: dict) -> int:
    """GLM-4.1V's LM without its head: Qwen2's layers (q, k and v with bias) with two more RMSNorms each (after
    attention and after the MLP)."""
    return qwen2_params(t) + t["num_hidden_layers"] * 2 * t["hidden_size"]


def glm4_moe_lm_params(t: dict) -> int:
    """GLM-4.5V's LM without its head: embedding; per layer q (heads x head_dim, wider than the model), k and v
    with bias, o without, two RMSNorms; a SwiGLU MLP of intermediate_size in the first first_k_dense_replace
    layers, in the others a router (n_routed_experts x width, no bias), n_routed_experts SwiGLU experts and
    n_shared_experts shared ones of moe_intermediate_size; the final norm."""
    d, head, layers = t["hidden_size"], t["head_dim"], t["num_hidden_layers"]
    q, kv = t["num_attention_heads"] * head, t["num_key_value_heads"] * head
    attention = (d * q + q) + 2 * (d * kv + kv) + q * d
    experts = t["n_routed_experts"] + t["n_shared_experts"]
    moe = t["n_routed_experts"] * d + experts * 3 * d * t["moe_intermediate_size"]
    dense = t["first_k_dense_replace"]
    return (t["vocab_size"] * d + layers * (attention + 2 * d) + dense * 3 * d * t["intermediate_size"]
            + (layers - dense) * moe + d)
