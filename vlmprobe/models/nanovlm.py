"""nanoVLM: a SigLIP-style ViT, a pixel-shuffle projector and a Llama-style LM, computed as nanoVLM's own
code computes them (huggingface/nanoVLM at the commit of issue #103, 731d8c6 / 91a3b93), so that the
activations saved for backward are nanoVLM's, not those of another implementation of the same weights.

What matters for memory, and is reproduced here (behaviour, written independently):
- ViT: Conv2d patch embedding plus a learned position embedding (no CLS token); one fused qkv Linear with
  bias per block, split into views; SDPA without mask; tanh-GELU MLP; pre-norm LayerNorms; final LayerNorm.
- Projector: pixel shuffle (view, 6-d reshape, permute + contiguous copy, reshape), Linear without bias.
- LM: RMSNorm without dtype casts (fp32 residual stream); RoPE recomputed every call for the batch's
  position ids (B, L, head_dim) in fp32; K and V expanded to all heads with repeat_interleave before SDPA;
  an additive (B, 1, 1, L) padding mask passed with is_causal=True (CUDA runs the memory-efficient
  kernel), in the residual stream's dtype (fp32 in fp32 + autocast training, as nanoVLM's); SiLU-gated MLP; final RMSNorm; head tied to the token embedding.
- The image features replace the first n_image_tokens positions (nanoVLM writes them over the image
  placeholders; a fixed slice keeps shapes static for fake tensors); the head runs over every position and
  the loss is cross-entropy with ignore_index -100 over all of them.
Not reproduced: the per-layer KV-cache list nanoVLM builds and keeps until the forward returns (it raises
the forward-phase peak, not the backward peak that sets the step's peak); dropout layers (p = 0 there).
Parameter names differ from nanoVLM's; counts are the same (nanoVLM-222M: 222,083,328 with 3 added tokens).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlmprobe.errors import ConfigError
from vlmprobe.models.base import IGNORE_INDEX, DataShape, ModelSpec
ATTENTION = ("sdpa", "eager")


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
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, None, False, self.implementation)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


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
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LMBlock(nn.Module):
    def __init__(self, cfg: dict, implementation: str):
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.implementation = implementation
        self.norm1 = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.gate_proj = nn.Linear(hidden, cfg["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(hidden, cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], hidden, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # bf16 x fp32: q and k come out fp32, as in nanoVLM
        k = k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = attention(q, k, v, mask, True, self.implementation)
        x = x + self.o_proj(y.transpose(1, 2).contiguous().view(b, s, d))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LM(nn.Module):
    def __init__(self, cfg: dict, implementation: str):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.blocks = nn.ModuleList(LMBlock(cfg, implementation) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.head.weight = self.embed.weight  # tied
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.register_buffer(
            "inv_freq", 1.0 / cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
            persistent=False)

    def rope(self, batch: int, length: int, device):
        """cos, sin of shape (B, 1, L, head_dim) in the weights' dtype (fp32 in nanoVLM's fp32 + autocast
        training; bf16 for pure bf16 weights, where fp32 would leave q, k and v in different dtypes),
        recomputed every call for the batch's positions."""
        with torch.no_grad():
            positions = torch.arange(length, device=device).unsqueeze(0).expand(batch, -1)
            freqs = positions[..., None].float() * self.inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            dtype = self.embed.weight.dtype
            return emb.cos().unsqueeze(1).to(dtype), emb.sin().unsqueeze(1).to(dtype)

    def forward(self, embeds, attention_mask):
        b, s, _ = embeds.shape
        cos, sin = self.rope(b, s, embeds.device)
        # additive padding mask (B, 1, 1, L): 0 where attended, the dtype's minimum where padded. Built in
        # the residual stream's dtype, which is the query's where no autocast casts it: CUDA's
        # memory-efficient kernel refuses a bias of another dtype ("invalid dtype for bias"), as pure bf16
        # training would meet with an fp32 mask. Under autocast SDPA gets both cast to the autocast dtype.
        dtype = embeds.dtype
        mask = (1.0 - attention_mask.to(dtype))[:, None, None, :] * torch.finfo(dtype).min
        x = embeds
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(self.norm(x))


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """(B, S, D) patch features -> (B, S / factor^2, D * factor^2): each factor x factor block of the patch
    grid becomes one token."""
    b, s, d = x.shape
    side = math.isqrt(s)
    x = x.view(b, side, side, d).reshape(b, side // factor, factor, side // factor, factor, d)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().reshape(b, s // factor**2, d * factor**2)


class NanoVLM(nn.Module):
    def __init__(self, vision: dict, text: dict, image_size: int, pixel_shuffle_factor: int, implementation: str):
        super().__init__()
        self.pixel_shuffle_factor = pixel_shuffle_factor
        self.vision = ViT(vision, image_size, implementation)
        self.projector = nn.Linear(vision["hidden_size"] * pixel_shuffle_factor**2, text["hidden_size"], bias=False)
        self.lm = LM(text, implementation)

    def forward(self, input_ids, attention_mask, pixel_values):
        """Logits (B, L, V); the first n positions of each sample hold its n image tokens."""
        image = self.projector(pixel_shuffle(self.vision(pixel_values), self.pixel_shuffle_factor))
        image = image.reshape(input_ids.shape[0], -1, image.shape[-1])
        tokens = self.lm.embed(input_ids[:, image.shape[1]:])
        embeds = torch.cat([image.to(tokens.dtype), tokens], dim=1)
        return self.lm(embeds, attention_mask)


class NanoVLMSpec(ModelSpec):
    """Hydra target for conf/model/nanovlm_*.yaml."""

    uses_transformers = False  # nanoVLM's own modules, above

    def __init__(self, name: str, vision: dict, text: dict, pixel_shuffle_factor: int, image_size: int,
                 attn_implementation: str = "sdpa"):
        if attn_implementation not in ATTENTION:
            raise ConfigError(f"model.attn_implementation={attn_implementation!r} is not allowed for nanoVLM: "
                              f"use one of {', '.join(ATTENTION)}")
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
        patches = (size // self.vision["patch_size"]) ** 2
        return data.images_per_sample * patches // self.pixel_shuffle_factor**2

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.vision], "lm": [model.lm]}

    def repeated_blocks(self, model: nn.Module) -> list[list[nn.Module]]:
        # our own blocks: each one's forward reads only its own settings and arguments, never its index
        return [list(model.vision.blocks), list(model.lm.blocks)]

    def _construct(self) -> nn.Module:
        return NanoVLM(self.vision, self.text, self.native_image_size, self.pixel_shuffle_factor,
                       self.attn_implementation)

    def batch(self, data: DataShape, device: torch.device) -> dict:
        size = self.image_size(data)
        n_image = self.image_tokens(data)
        shape = (data.batch_size, data.lm_max_length)
        input_ids = torch.randint(0, self.text["vocab_size"], shape, device=device)
        labels = input_ids.clone()
        labels[:, :n_image].fill_(IGNORE_INDEX)  # no loss on image positions
        pixel_values = torch.randn(data.batch_size * data.images_per_sample, self.vision.get("num_channels", 3),
                                   size, size, device=device)
        # nanoVLM's collator pads every sample to lm_max_length; synthetic samples fill it, so the mask is all ones
        attention_mask = torch.ones(shape, dtype=torch.long, device=device)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values,
                "labels": labels}

    def loss(self, model: nn.Module, batch: dict):
        logits = model(batch["input_ids"], batch["attention_mask"], batch["pixel_values"])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                               ignore_index=IGNORE_INDEX)
        return loss, logits
