"""nanoVLM: a SigLIP-style ViT, a pixel-shuffle projector and a Llama-style LM, computed as nanoVLM's own
code computes them (huggingface/nanoVLM at the commit of issue #103), so that what the step allocates, keeps for
backward and frees, in what order, is nanoVLM's, not that of another implementation of the same weights. The
behaviour is written independently: its dtypes, the RoPE and padding mask made per call, K and V expanded before
SDPA, each block's key and value kept until the forward returns, its call structure and module order. Not
reproduced: dropout (p = 0 there); with pure bf16 weights cos and sin are cast to the weights' dtype, where
nanoVLM's SDPA call fails. The LM's linear layers carry nanoVLM's names (LoRA's target_modules match them). With
model.source (a nanoVLM checkout), nanoVLM's own modules run instead (vlmprobe.models.nanovlm_source).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models import nanovlm_source
from vlmprobe.models.base import IGNORE_INDEX, DataShape, ModelSpec

__all__ = ["attention", "LM", "NanoVLM", "NanoVLMSpec", "pixel_shuffle", "RMSNorm", "ViT"]

ATTENTION = ("sdpa", "eager")
ROPE_SCALING = 1.0  # nanoVLM's lm_attn_scaling: its cos and sin are multiplied by it


def attention(q, k, v, mask, is_causal: bool, implementation: str) -> torch.Tensor:
    """SDPA, or the unfused math (softmax(QK^T / sqrt(d) + mask) V, which keeps the (B, H, L, L) weights)."""
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        length = q.shape[-2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    if mask is not None:
        scores = scores + mask
    return F.softmax(scores, dim=-1) @ v


class ViTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int, eps: float, implementation: str):
        super().__init__()
        self.heads, self.implementation = heads, implementation
        self.norm1 = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, mlp)
        self.fc2 = nn.Linear(mlp, hidden)

    def forward(self, x):
        # each sublayer is a call that gets its normed input as an argument, as nanoVLM's attention and MLP
        # modules do: the normed input stays alive until the sublayer returns, which decides where the
        # allocator places what comes after it
        x = x + self.attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def attend(self, h):
        b, s, d = h.shape
        # split, then one view per head layout: backward joins the three gradients with one cat (unbinding a
        # (B, S, 3, H, hd) view instead stacks them and copies the stack once more to undo its permute)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(h).split(d, dim=2))
        y = attention(q, k, v, None, False, self.implementation)
        y = y.transpose(1, 2).contiguous().view(b, s, d)
        return self.out(y)

    def mlp(self, h):
        return self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class ViT(nn.Module):
    def __init__(self, cfg: dict, image_size: int, implementation: str):
        super().__init__()
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.patch = nn.Conv2d(cfg.get("num_channels", 3), hidden, kernel_size=patch, stride=patch)
        self.position = nn.Parameter(torch.empty(1, (image_size // patch) ** 2, hidden))
        self.blocks = nn.ModuleList(
            ViTBlock(hidden, cfg["num_attention_heads"], cfg["intermediate_size"], cfg["layer_norm_eps"], implementation)
            for _ in range(cfg["num_hidden_layers"]))
        self.norm = nn.LayerNorm(hidden, eps=cfg["layer_norm_eps"])

    def forward(self, pixel_values):
        # images arrive fp32; with bf16 weights and no autocast they take the weights' dtype (as HF towers do)
        x = self.patch(pixel_values.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden))

    def forward(self, x):
        # bound to a name, the inverse RMS lives until return as nanoVLM's does: past the weight's multiply
        # where nothing saves it (activation checkpointing's first pass)
        inverse_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * inverse_rms * self.weight


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class LMBlock(nn.Module):
    def __init__(self, cfg: dict, implementation: str):
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.implementation = implementation
        # made in nanoVLM's order (its MLP, its attention, then the norms): the order of parameters() is the
        # order in which the optimizer's foreach kernels make their temporaries, and creation order places them
        self.gate_proj = nn.Linear(hidden, cfg["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(hidden, cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], hidden, bias=False)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)
        self.norm1 = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.norm2 = RMSNorm(hidden, cfg["rms_norm_eps"])
        self._kept: list | None = None  # where the forward keeps this block's key and value (LM.forward)

    def forward(self, x, cos, sin, attention_mask):
        # sublayers as calls, as in the ViT's blocks (nanoVLM's attention and MLP are modules). The key and
        # value live until the block returns, as nanoVLM's block returns them, and past it in the forward's
        # list (LM.forward); not when checkpointing recomputes the block in backward, whose caller drops them
        key_value = []
        x = x + self.attend(self.norm1(x), cos, sin, attention_mask, key_value)
        if self._kept is not None:
            self._kept.append(key_value)
        return x + self.mlp(self.norm2(x))

    def attend(self, h, cos, sin, attention_mask, key_value: list):
        b, s, d = h.shape
        # the projections stay bound until this returns, as nanoVLM's attention keeps them in locals: q's and
        # k's (bf16) are dropped only then, though nothing after RoPE reads them
        q_proj = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k_proj = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q_proj, cos, sin), rope(k_proj, cos, sin)  # bf16 x fp32: fp32, as in nanoVLM
        key_value += (k, v)
        groups = self.heads // self.kv_heads
        k_all, v_all = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # additive padding mask (B, 1, 1, L), made by each block as nanoVLM's attention makes it: 0 where
        # attended, the dtype's minimum where padded. Built in the residual stream's dtype, which is the query's
        # where no autocast casts it: CUDA's memory-efficient kernel refuses a bias of another dtype ("invalid
        # dtype for bias"), as pure bf16 training would meet with an fp32 mask (nanoVLM's is always fp32: the
        # same under fp32 weights + autocast, where SDPA gets both cast to the autocast dtype).
        mask = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
        y = attention(q, k_all, v_all, mask, True, self.implementation)
        y = y.transpose(1, 2).contiguous().view(b, s, d)
        return self.out_proj(y)

    def mlp(self, h):
        gate, up = F.silu(self.gate_proj(h)), self.up_proj(h)  # bound until return, as nanoVLM's are
        return self.down_proj(gate * up)


class LM(nn.Module):
    def __init__(self, cfg: dict, implementation: str):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.max_positions = cfg["max_position_embeddings"]
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.register_buffer(
            "inv_freq", 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim),
            persistent=False)
        self.blocks = nn.ModuleList(LMBlock(cfg, implementation) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.head.weight = self.embed.weight  # tied

    def rope(self, positions):
        """cos, sin of shape (B, 1, L, head_dim) for the batch's positions (B, L), recomputed every call, in the
        weights' dtype (fp32 in nanoVLM's fp32 + autocast training; bf16 for pure bf16 weights, where fp32
        would leave q, k and v in different dtypes). As nanoVLM computes them: past the positions the LM was
        trained on its frequencies are stretched (one value read back from the device; the estimate reads it
        as within them, where the step allocates 128 B less), and both are scaled by its attention scaling
        (1.0 in every config of it: a multiply that allocates)."""
        with torch.no_grad():
            longest = positions.max() + 1
            inv_freq = self.inv_freq
            if longest > self.max_positions:
                inv_freq = inv_freq / (longest / self.max_positions)
            flat = positions.reshape(-1).float()  # the expanded positions cannot be viewed flat: a copy
            freqs = (flat.unsqueeze(-1) * inv_freq.unsqueeze(0)).reshape(*positions.shape, -1)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * ROPE_SCALING, emb.sin() * ROPE_SCALING
            dtype = self.embed.weight.dtype
            return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def forward(self, embeds, attention_mask, kept: list):
        """The final norm's output (B, L, D); the head is the caller's, as in nanoVLM.

        Each block's key (after RoPE) and value go into `kept`, as nanoVLM's LM returns them in its KV-cache
        list, which its VisionLanguageModel.forward holds in a local until it returns: past the head and the
        loss, through the forward's peak. Backward needs none of them (the attention keeps its own expanded
        copies): they raise the forward's peak and what it leaves reserved. The list reaches the blocks as an
        attribute for the loop, not as an argument: activation checkpointing keeps a block's arguments until
        its backward (and would keep every key and value with them), and the blocks' calls stay alike for the
        estimate's replay (vlmprobe.estimate.replay.blocks)."""
        b, s, _ = embeds.shape
        positions = torch.arange(s, device=embeds.device).unsqueeze(0).expand(b, -1)
        cos, sin = self.rope(positions)
        x = embeds
        try:
            for block in self.blocks:
                block._kept = kept
                x = block(x, cos, sin, attention_mask)
        finally:
            for block in self.blocks:
                block._kept = None
        return self.norm(x)


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """(B, S, D) patch features -> (B, S / factor^2, D * factor^2): each factor x factor block of the patch
    grid becomes one token."""
    b, s, d = x.shape
    side = math.isqrt(s)
    x = x.view(b, side, side, d).reshape(b, side // factor, factor, side // factor, factor, d)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().reshape(b, s // factor**2, d * factor**2)


class NanoVLM(nn.Module):
    def __init__(self, vision: dict, text: dict, image_size: int, pixel_shuffle_factor: int, implementation: str,
                 image_token_id: int):
        super().__init__()
        self.pixel_shuffle_factor = pixel_shuffle_factor
        self.image_token_id = image_token_id
        self.vision = ViT(vision, image_size, implementation)  # nanoVLM's order: vision, LM, projector
        self.lm = LM(text, implementation)
        self.projector = nn.Linear(vision["hidden_size"] * pixel_shuffle_factor**2, text["hidden_size"], bias=False)

    def forward(self, input_ids, image, attention_mask, targets):
        """(logits (B, L, V), loss), with nanoVLM's arguments: each sample's images are written over its image
        placeholders, the run of tokens from the first one; the loss is cross-entropy over every position.
        What is bound to a name here lives until this returns, as in nanoVLM's forward: the ViT's output until
        the projection returns, the token embeddings and the LM's keys and values through the head and the
        loss."""
        image = self.vision(image)
        image = self.project(image).reshape(input_ids.shape[0], -1, self.lm.embed.embedding_dim)
        tokens = self.lm.embed(input_ids)
        embeds = with_images(tokens, input_ids, image, self.image_token_id)
        kept = []  # each block's key and value, dropped when this returns (LM.forward)
        logits = self.lm.head(self.lm(embeds, attention_mask, kept))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    def project(self, features):
        return self.projector(pixel_shuffle(features, self.pixel_shuffle_factor))


def with_images(tokens: torch.Tensor, input_ids: torch.Tensor, image: torch.Tensor, token_id: int) -> torch.Tensor:
    """A copy of the token embeddings (B, L, D) with each sample's image features (B, n, D) written over its n
    image positions, the run from its first placeholder (found on the device with argmax, as nanoVLM finds it;
    no value is read back). The index tensors live until this returns, as nanoVLM's do."""
    embeds = tokens.clone()
    count = image.shape[1]
    first = (input_ids == token_id).int().argmax(dim=1)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1).expand(-1, count)
    offsets = torch.arange(count, device=input_ids.device).unsqueeze(0)
    columns = first.unsqueeze(1) + offsets
    embeds[rows, columns] = image.to(embeds.dtype)
    return embeds


class NanoVLMSpec(ModelSpec):
    """Hydra target for conf/model/nanovlm_*.yaml."""

    uses_transformers = False  # nanoVLM's own modules, above

    def __init__(self, name: str, vision: dict, text: dict, pixel_shuffle_factor: int, image_size: int,
                 attn_implementation: str = "sdpa", source: str | None = None):
        if attn_implementation not in ATTENTION:
            raise ConfigError(f"model.attn_implementation={attn_implementation!r} is not allowed for nanoVLM: "
                              f"use one of {', '.join(ATTENTION)}")
        positions = text.get("max_position_embeddings")
        if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
            raise ConfigError(f"model.text.max_position_embeddings={positions!r} is not allowed: give the positions "
                              f"RoPE covers, a positive integer (8192 for SmolLM2)")
        self.source = None if source is None else nanovlm_source.checked_source(source)
        if self.source is not None and attn_implementation != "sdpa":
            raise ConfigError(f"model.attn_implementation={attn_implementation!r} is not allowed with model.source: "
                              f"nanoVLM's code picks its attention itself (SDPA where torch has it); use sdpa")
        self.name = name
        self.vision = dict(vision)
        self.text = dict(text)
        self.pixel_shuffle_factor = pixel_shuffle_factor
        self.native_image_size = image_size  # pixels per side the ViT's position embedding covers
        self.attn_implementation = attn_implementation

    def image_tokens(self, data: DataShape) -> int:
        size = self.image_size(data)
        if size != self.native_image_size:
            raise ConfigError(
                f"data.image_size={size} is not allowed for {self.name}: its vision tower takes "
                f"{self.native_image_size} px only (or null for that)"
            )
        if self.source is not None and data.images_per_sample != 1:
            raise ConfigError(f"data.images_per_sample={data.images_per_sample} is not allowed with model.source: "
                              f"nanoVLM's code at {nanovlm_source.TESTED} takes one image a sample")
        return data.images_per_sample * self.tokens_per_image()

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """Any image: nanoVLM's processor resizes it to the tower's size, so tokens_per_image."""
        return self.tokens_per_image()

    def tokens_per_image(self) -> int:
        patches = (self.native_image_size // self.vision["patch_size"]) ** 2
        return patches // self.pixel_shuffle_factor**2

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        if self.source is not None:  # nanoVLM's names; its ViT and LM keep their layers in .blocks, as ours do
            return {"vision": [model.vision_encoder], "lm": [model.decoder]}
        return {"vision": [model.vision], "lm": [model.lm]}

    def repeated_blocks(self, model: nn.Module) -> list[list[nn.Module]]:
        if self.source is not None:  # someone else's blocks: nothing is known of what their forward reads
            return []
        # our own blocks: each one's forward reads only its own settings and arguments, never its index
        return [list(model.vision.blocks), list(model.lm.blocks)]

    def _construct(self) -> nn.Module:
        if self.source is not None:
            config_class, model_class = nanovlm_source.load(self.source, self.image_token_id())
            fields = nanovlm_source.config_fields(self.vision, self.text, self.native_image_size,
                                                  self.pixel_shuffle_factor, self.tokens_per_image())
            return model_class(nanovlm_source.make_config(config_class, fields, self.source), load_backbone=False)
        return NanoVLM(self.vision, self.text, self.native_image_size, self.pixel_shuffle_factor,
                       self.attn_implementation, self.image_token_id())

    def image_token_id(self) -> int:
        return nanovlm_source.image_token_id(self.text["vocab_size"])

    def batch(self, data: DataShape, device: torch.device) -> dict:
        size = self.image_size(data)
        n_image = self.image_tokens(data)
        shape = (data.batch_size, data.lm_max_length)
        input_ids = torch.randint(0, self.text["vocab_size"], shape, device=device)
        input_ids[:, :n_image].fill_(self.image_token_id())  # the image's placeholders (nanoVLM's code finds them)
        labels = input_ids.clone()
        labels[:, :n_image].fill_(IGNORE_INDEX)  # no loss on image positions
        pixel_values = torch.randn(data.batch_size * data.images_per_sample, self.vision.get("num_channels", 3),
                                   size, size, device=device)
        # nanoVLM's collator pads every sample to lm_max_length; synthetic samples fill it, so the mask is all ones
        attention_mask = torch.ones(shape, dtype=torch.long, device=device)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values,
                "labels": labels}

    def loss(self, model: nn.Module, batch: dict):
        # nanoVLM's forward computes its loss itself (ours, as its code does; with model.source, its code)
        logits, loss = model(batch["input_ids"], batch["pixel_values"], batch["attention_mask"], batch["labels"])
        return loss, logits
