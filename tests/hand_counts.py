"""Parameter counts by hand from a config's numbers (no transformers), shared by the families' tests."""


def llama_params(t: dict) -> int:
    """A Llama LM without its head: embedding, per layer q/k/v/o and a SwiGLU MLP without bias and two
    RMSNorms, the final norm."""
    d, f, head = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    layer = d * t["num_attention_heads"] * head * 2 + 2 * d * t["num_key_value_heads"] * head + 3 * d * f + 2 * d
    return t["vocab_size"] * d + t["num_hidden_layers"] * layer + d
