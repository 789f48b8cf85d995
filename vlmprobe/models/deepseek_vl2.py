"""DeepSeek-VL2 (deepseek-ai/deepseek-vl2-tiny, -small; model_type deepseek_vl_v2): a module of our own composing
transformers' SiglipVisionModel (so400m, 384 px tiles, its pooling head built and never run), DeepSeek's
downsample_mlp_gelu projector with the learned image_newline / view_seperator, and DeepseekV2ForCausalLM (MLA
where kv_lora_rank is set, LlamaAttention where not; shared + routed experts), as github deepseek-ai/DeepSeek-VL2
(ef9f91e) composes its own. Image tokens: a global view plus select_best_resolution's tiles (one tile each from
three images a sample): 421 for one tile, 1023 for 2 x 2. Limits (the original's xformers tower, per-expert loop
and balance loss; the casts and copies made where its code raises): docs/models.md.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, SiglipVisionConfig, SiglipVisionModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (DeepseekV2DecoderLayer, DeepseekV2MLP,
                                                                  DeepseekV2Model, DeepseekV2Moe,
                                                                  DeepseekV2PreTrainedModel, DeepseekV2RMSNorm,
                                                                  DeepseekV2RotaryEmbedding)
from transformers.models.llama.modeling_llama import LlamaAttention

from vlmprobe.errors import ConfigError, whole
from vlmprobe.models.base import DataShape, ModelSpec, prompt_then_text
from vlmprobe.models.fake_constants import collated, constant_tensor
from vlmprobe.models.llava_next import select_best_resolution
from vlmprobe.models.moe import MixtureOfExperts

__all__ = ["DeepseekVL2ForCausalLM", "DeepseekVL2Layout", "DeepseekVL2Spec", "best_resolution"]

TILE_TAGS = ("2D",)  # "1D" is the original's abandoned layout (its code reads a config.aligner that no config has)
VIEW_POSITIONS = ("head", "tail")  # the global view before or after the tiles
TOPK_METHODS = ("greedy", "group_limited_greedy")  # what both DeepSeek's training gate and transformers' router run
IMAGE_TOKEN_ID = 128815  # <image> in the 129,280-token tokenizer of deepseek-vl2-tiny (and of DeepSeek-OCR)

# DeepSeek's config classes' defaults (configuration_deepseek.py, modeling_deepseek_vl_v2.py): what a config.json
# that leaves a key out gets from them
VISION_DEFAULTS = {"image_size": 384, "patch_size": 16, "width": 1024, "layers": 24, "heads": 16, "mlp_ratio": 4,
                   "global_pool": "map", "ignore_head": True, "class_token": False}
PROJECTOR_DEFAULTS = {"projector_type": "downsample_mlp_gelu", "input_dim": 1152, "n_embed": 2048, "depth": 2,
                      "mlp_ratio": 1, "downsample_ratio": 2, "token_pooling": False}
LANGUAGE_DEFAULTS = {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                     "moe_intermediate_size": 1407, "num_hidden_layers": 30, "num_attention_heads": 32,
                     "num_key_value_heads": 32, "n_shared_experts": None, "n_routed_experts": None,
                     "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                     "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "gready", "n_group": None,
                     "topk_group": None, "num_experts_per_tok": None, "moe_layer_freq": 1, "first_k_dense_replace": 0,
                     "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
                     "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 100000,
                     "eos_token_id": 100001, "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
                     "attention_bias": False, "attention_dropout": 0.0, "use_mla": True, "ep_size": 1}
# language_config keys the spec's text takes as they are (the rest are mapped, or refused where they cannot map)
TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
             "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
             "qk_nope_head_dim", "topk_method", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
             "norm_topk_prob", "hidden_act", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
             "tie_word_embeddings", "attention_bias", "attention_dropout")


def best_resolution(width: int, height: int, candidates) -> tuple[int, int]:
    """select_best_resolution over DeepSeek's (w, h) candidates: LLaVA-NeXT's rule (the most of the image shown,
    then the least area empty, the first of equals), which takes and gives (h, w)."""
    h, w = select_best_resolution(height, width, [(ch, cw) for cw, ch in candidates])
    return w, h


# -- the model --------------------------------------------------------------------------------------------------
class MultiHeadAttention(LlamaAttention):
    """DeepSeek's multi-head attention (use_mla false: its decoder layer takes transformers' LlamaAttention): q, k, v,
    o of head_dim = hidden / heads, RoPE over the whole head in Llama's half-rotation layout. The decoder layer hands
    it DeepSeek-V2's rotary angles (complex, head_dim / 2 of them), turned into Llama's cos and sin here."""

    def forward(self, hidden_states, attention_mask=None, cache=None, position_embeddings=None, **kwargs):
        cos = torch.cat([position_embeddings.real] * 2, dim=-1).to(hidden_states.dtype)
        sin = torch.cat([position_embeddings.imag] * 2, dim=-1).to(hidden_states.dtype)
        return super().forward(hidden_states, position_embeddings=(cos, sin), attention_mask=attention_mask,
                               cache=cache, **kwargs)


class MultiHeadDecoderLayer(DeepseekV2DecoderLayer):
    """transformers' DeepSeek-V2 decoder layer (its forward) with multi-head attention in place of MLA."""

    def __init__(self, config: DeepseekV2Config, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # not DeepseekV2DecoderLayer's: it builds MLA's weights
        self.hidden_size = config.hidden_size
        self.self_attn = MultiHeadAttention(config, layer_idx)
        self.mlp = DeepseekV2Moe(config) if layer_idx >= config.first_k_dense_replace else DeepseekV2MLP(config)
        self.input_layernorm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MultiHeadDeepseekV2Model(DeepseekV2Model):
    """transformers' DeepseekV2Model (its forward) whose layers are MultiHeadDecoderLayer."""

    # The experts are transformers' DeepseekV2Experts, which take experts_implementation; transformers 5.25 decides
    # whether a class does by looking for its decorator in the class's module source (modeling_utils.py,
    # _can_set_experts_implementation), which is this module: its cached answer, given
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config: DeepseekV2Config):
        DeepseekV2PreTrainedModel.__init__(self, config)  # not DeepseekV2Model's: its layers are MLA's
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(MultiHeadDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DeepseekV2RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class MultiHeadDeepseekV2ForCausalLM(DeepseekV2ForCausalLM):
    """transformers' DeepseekV2ForCausalLM (its forward, its head) over MultiHeadDeepseekV2Model."""

    _can_set_experts_implementation_cached_value = True  # as MultiHeadDeepseekV2Model's

    def __init__(self, config: DeepseekV2Config):
        DeepseekV2PreTrainedModel.__init__(self, config)
        self.model = MultiHeadDeepseekV2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class DownsampleProjector(nn.Module):
    """downsample_mlp_gelu: a tile's square of patches zero-padded to a multiple of `ratio`, each ratio x ratio block
    concatenated channel-major (F.unfold), then Linear, (GELU, Linear) x (depth - 2), GELU, Linear."""

    def __init__(self, width: int, out: int, depth: int, mlp_ratio: int, ratio: int):
        super().__init__()
        self.ratio = ratio
        hidden = out * mlp_ratio
        layers = [nn.Linear(width * ratio * ratio, hidden)]
        for _ in range(1, depth - 1):
            layers += [nn.GELU(), nn.Linear(hidden, hidden)]
        self.layers = nn.Sequential(*layers, nn.GELU(), nn.Linear(hidden, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, patches, width = x.shape
        side = math.isqrt(patches)
        pad = -side % self.ratio
        x = x.reshape(tiles, side, side, width)
        if pad:
            x = F.pad(x, (0, 0, 0, pad, 0, pad))
        x = F.unfold(x.permute(0, 3, 1, 2), kernel_size=self.ratio, stride=self.ratio).permute(0, 2, 1)
        return self.layers(x)


class DeepseekVL2Model(nn.Module):
    """The tower, the projector, the two learned tile tokens and the LM (with its head), as the original's
    DeepseekVLV2ForCausalLM holds them (vision, projector, image_newline, view_seperator, language)."""

    def __init__(self, vision: SiglipVisionConfig, text: DeepseekV2Config, projector: dict, multi_head: bool,
                 global_view_pos: str):
        super().__init__()
        self.vision = SiglipVisionModel(vision)
        self.projector = DownsampleProjector(vision.hidden_size, text.hidden_size, projector["depth"],
                                             projector["mlp_ratio"], projector["downsample_ratio"])
        self.image_newline = nn.Parameter(torch.empty(text.hidden_size))
        self.view_seperator = nn.Parameter(torch.empty(text.hidden_size))  # the original's spelling
        self.language = (MultiHeadDeepseekV2ForCausalLM if multi_head else DeepseekV2ForCausalLM)(text)
        self.global_view_pos = global_view_pos

    def image_features(self, tiles: torch.Tensor) -> torch.Tensor:
        """The tower's last layer after its LayerNorm, the pooling head left out (the original's ignore_head)."""
        hidden = self.vision.embeddings(tiles)
        hidden = self.vision.encoder(inputs_embeds=hidden).last_hidden_state
        return self.vision.post_layernorm(hidden)

    def inputs_embeds(self, input_ids, images, images_seq_mask, images_spatial_crop) -> torch.Tensor:
        """prepare_inputs_embeds: every sample's tiles through the tower and the projector at once, then each image
        laid out (global view with a newline per row, the separator, the tiles' rows with a newline each) and the
        sample's images scattered into its embeddings where images_seq_mask is set."""
        # [tiles across, tiles down] per image, up to the first [0, 0] (padding), read on the host as the original
        grids = [list(itertools.takewhile(lambda grid: grid[0] and grid[1], sample))
                 for sample in images_spatial_crop.tolist()]
        tiles = torch.cat([images[i, :sum(1 + w * h for w, h in sample)] for i, sample in enumerate(grids)])
        features = self.projector(self.image_features(tiles))
        side, width = math.isqrt(features.shape[1]), features.shape[2]
        embeds = self.language.get_input_embeddings()(input_ids)
        if embeds.is_leaf and embeds.requires_grad:
            # frozen embeddings under transformers' checkpointing, whose enable_input_require_grads hook makes the
            # output a leaf that requires grad: the original's in-place scatter raises there; a copy takes it
            embeds = embeds.clone()
        first = 0
        for i, sample in enumerate(grids):
            views = []
            for across, down in sample:
                whole_view = torch.cat([features[first].view(side, side, width),
                                        self.image_newline.expand(side, 1, width)], dim=1).view(-1, width)
                grid = features[first + 1:first + 1 + across * down].view(down, across, side, side, width)
                grid = grid.permute(0, 2, 1, 3, 4).reshape(down * side, across * side, width)
                grid = torch.cat([grid, self.image_newline.expand(down * side, 1, width)], dim=1).view(-1, width)
                # expanded, not indexed as the original's [None, :]: the gradient is then a sum of its own rather
                # than a slice of the image's, which CUDA's engine may add the other samples' into in place and
                # keep whole as .grad (module docstring)
                separator = self.view_seperator.expand(1, width)
                head = self.global_view_pos == "head"
                views.append(torch.cat([whole_view, separator, grid] if head else [grid, separator, whole_view]))
                first += 1 + across * down
            if views:
                embeds[i].masked_scatter_(images_seq_mask[i].unsqueeze(-1), torch.cat(views).to(embeds.dtype))
        return embeds


class DeepseekVL2ForCausalLM(nn.Module):
    """DeepSeek-VL2: the forward of the original's DeepseekVLV2ForCausalLM with its LM's loss (the logits in float32,
    shifted, cross-entropy, mean over labels that are not -100)."""

    def __init__(self, vision: SiglipVisionConfig, text: DeepseekV2Config, projector: dict, multi_head: bool,
                 global_view_pos: str):
        super().__init__()
        self.model = DeepseekVL2Model(vision, text, projector, multi_head, global_view_pos)

    @property
    def _supports_flash_attn(self) -> bool:
        """What transformers' models say of themselves (the planner reads it): flash attention where both parts
        have a path for it (SigLIP and DeepSeek-V2 do, as DeepSeek's training ran)."""
        return self.model.vision._supports_flash_attn and self.model.language._supports_flash_attn

    def forward(self, input_ids, images, images_seq_mask, images_spatial_crop, labels=None, attention_mask=None,
                use_cache=False) -> CausalLMOutputWithPast:
        embeds = self.model.inputs_embeds(input_ids, images, images_seq_mask, images_spatial_crop)
        logits = self.model.language(inputs_embeds=embeds, attention_mask=attention_mask,
                                     use_cache=use_cache).logits.float()
        loss = None
        if labels is not None:
            shifted = logits[..., :-1, :].contiguous()
            loss = F.cross_entropy(shifted.view(-1, shifted.shape[-1]), labels[..., 1:].contiguous().view(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


# -- the spec -----------------------------------------------------------------------------------------------------
class DeepseekVL2Layout(ModelSpec):
    """The family without its experts' checks (DeepseekVL2Spec adds them)."""

    size_decides_tokens = True

    def __init__(self, name: str, vision: dict, text: dict, projector: dict, candidate_resolutions: list,
                 image_token_id: int, image_size: int | None = None, global_view_pos: str = "head",
                 attn_implementation: str = "sdpa"):
        self.name = name
        self.vision = dict(vision)
        self.text = dict(text)
        self.projector = dict(projector)
        self.attn_implementation = attn_implementation
        self.image_token_id = image_token_id
        tile = self.vision.get("image_size")
        for key in ("image_size", "patch_size", "hidden_size", "num_hidden_layers"):
            if not whole(self.vision.get(key)) or self.vision[key] <= 0:
                raise ConfigError(f"model.vision.{key}={self.vision.get(key)!r} is not allowed for {name}: it must be "
                                  f"a positive integer")
        for key in ("depth", "mlp_ratio", "downsample_ratio"):
            if not whole(self.projector.get(key)) or self.projector[key] <= 0:
                raise ConfigError(f"model.projector.{key}={self.projector.get(key)!r} is not allowed for {name}: it "
                                  f"must be a positive integer")
        if global_view_pos not in VIEW_POSITIONS:
            raise ConfigError(f"model.global_view_pos={global_view_pos!r} is not allowed for {name}: use head or tail")
        self.global_view_pos = global_view_pos
        pairs = candidate_resolutions if isinstance(candidate_resolutions, (list, tuple)) else []
        if not pairs or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                and all(whole(s) and s > 0 and s % tile == 0 for s in p) for p in pairs):
            raise ConfigError(f"model.candidate_resolutions={candidate_resolutions!r} is not allowed for {name}: give "
                              f"[width, height] pairs in multiples of the {tile} px tile (the processor cuts each "
                              f"into whole tiles)")
        if list(pairs[0]) != [tile, tile]:
            raise ConfigError(f"model.candidate_resolutions={candidate_resolutions!r} is not allowed for {name}: the "
                              f"first must be [{tile}, {tile}], the tile the processor cuts and the tower takes "
                              f"(model.vision.image_size)")
        self.candidate_resolutions = [tuple(p) for p in pairs]
        if image_size is not None and (not whole(image_size) or image_size <= 0):
            raise ConfigError(f"model.image_size={image_size!r} is not allowed for {name}: it must be a positive "
                              f"integer (px) or null")
        self.native_image_size = image_size or tile
        t = self.text
        for key in ("n_routed_experts", "n_shared_experts"):
            if not whole(t.get(key)) or t[key] <= 0:
                raise ConfigError(f"model.text.{key}={t.get(key)!r} is not allowed for {name}: it must be a positive "
                                  f"integer (DeepSeek-VL2's LMs are mixtures of experts with shared experts)")
        heads = t.get("num_attention_heads")
        if t.get("kv_lora_rank") is None and (not whole(heads) or heads <= 0 or t.get("hidden_size", 0) % heads
                                              or heads % (t.get("num_key_value_heads") or heads)):
            raise ConfigError(f"model.text.num_attention_heads={heads!r} is not allowed for {name} with multi-head "
                              f"attention (kv_lora_rank null): it must divide hidden_size and be a multiple of "
                              f"num_key_value_heads")
        if t.get("topk_method") not in TOPK_METHODS:
            why = " (DeepSeek-VL2's gate asserts it is not training)" if t.get("topk_method") == "noaux_tc" else ""
            raise ConfigError(f"model.text.topk_method={t.get('topk_method')!r} is not allowed for {name}: use "
                              f"{' or '.join(TOPK_METHODS)}{why}")

    # -- config.json ------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, raw: dict, *, name: str, attn_implementation: str, preprocessor: dict | None):
        """The spec of a deepseek_vl_v2 config.json, its sub-configs completed with DeepSeek's config classes'
        defaults. The processor's tile, patch and downsampling are the model's (processor_config.json says the
        same: 384, 14, 2); the <image> id is not in config.json (any id builds the same model: the forward finds
        the images by images_seq_mask)."""
        where = f"in {name}'s deepseek_vl_v2 config.json"
        vision = {**VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        projector = {**PROJECTOR_DEFAULTS, **(raw.get("projector_config") or {})}
        language = {**LANGUAGE_DEFAULTS, **(raw.get("language_config") or {})}
        refusals = [
            ("tile_tag", raw.get("tile_tag", "tile_tag"), lambda v: v in TILE_TAGS, "use 2D (the model's only working "
                                                                                    "layout)"),
            ("projector_config.projector_type", projector["projector_type"], lambda v: v == "downsample_mlp_gelu",
             "vlmprobe builds DeepSeek-VL2's downsample_mlp_gelu projector only"),
            ("projector_config.token_pooling", projector["token_pooling"], lambda v: not v,
             "token pooling is not built"),
            ("vision_config.ignore_head", vision["ignore_head"], bool,
             "the pooled output cannot feed the projector"),
            ("vision_config.class_token", vision["class_token"], lambda v: not v, "SigLIP has no class token"),
            ("vision_config.global_pool", vision["global_pool"], lambda v: v in ("map", ""),
             "use map (an unused attention-pooling head) or '' (none); avg and token move the final LayerNorm"),
            ("language_config.n_routed_experts", language["n_routed_experts"], whole,
             "vlmprobe builds DeepSeek-VL2's mixture-of-experts LMs"),
            ("language_config.n_shared_experts", language["n_shared_experts"], whole,
             "transformers' DeepSeek-V2 always has shared experts"),
            ("language_config.moe_layer_freq", language["moe_layer_freq"], lambda v: v == 1,
             "transformers' DeepSeek-V2 puts experts in every layer after first_k_dense_replace"),
            ("language_config.ep_size", language["ep_size"], lambda v: v == 1, "expert parallelism is not modelled"),
            ("language_config.scoring_func", language["scoring_func"], lambda v: v == "softmax",
             "transformers' DeepSeek-V2 router scores with softmax"),
            ("language_config.rope_scaling", language["rope_scaling"], lambda v: v is None,
             "only the default RoPE is mapped"),
            ("language_config.kv_lora_rank", language["kv_lora_rank"],
             lambda v: v is not None or not language["use_mla"], "use_mla true needs a kv_lora_rank"),
            ("projector_config.input_dim", projector["input_dim"], lambda v: v == vision["width"],
             f"it must be the tower's width ({vision['width']})"),
            ("projector_config.n_embed", projector["n_embed"], lambda v: v == language["hidden_size"],
             f"it must be the LM's hidden_size ({language['hidden_size']})"),
        ]
        for key, value, allowed, why in refusals:
            if not allowed(value):
                raise ConfigError(f"{key}={value!r} {where} is not allowed: {why}")
        text = {key: language[key] for key in TEXT_KEYS}
        if not language["use_mla"]:  # the original ignores the MLA fields then
            text.update(kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": float(language["rope_theta"])}
        return cls(name=name, vision={
            "hidden_size": vision["width"], "intermediate_size": int(vision["width"] * vision["mlp_ratio"]),
            "num_hidden_layers": vision["layers"], "num_attention_heads": vision["heads"], "num_channels": 3,
            "image_size": vision["image_size"], "patch_size": vision["patch_size"], "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6, "vision_use_head": vision["global_pool"] == "map"},
            text=text, projector={k: projector[k] for k in ("depth", "mlp_ratio", "downsample_ratio")},
            candidate_resolutions=raw.get("candidate_resolutions", [[384, 384]]),
            image_token_id=IMAGE_TOKEN_ID if text["vocab_size"] > IMAGE_TOKEN_ID else text["vocab_size"] - 1,
            global_view_pos=raw.get("global_view_pos", "head"), attn_implementation=attn_implementation)

    # -- image geometry -----------------------------------------------------------------------------------------
    def tile_side(self) -> int:
        """Tokens per side of a tile after the projector: ceil(patches per side / downsample_ratio)."""
        return -(-(self.vision["image_size"] // self.vision["patch_size"]) // self.projector["downsample_ratio"])

    def grid(self, data: DataShape) -> tuple[int, int]:
        """(tiles across, tiles down) of each image: tiled while a sample has at most two images."""
        if data.images_per_sample > 2:
            return 1, 1
        size, tile = self.image_size(data), self.vision["image_size"]
        width, height = best_resolution(size, size, self.candidate_resolutions)
        return width // tile, height // tile

    def tokens_per_image(self, data: DataShape) -> int:
        side, (across, down) = self.tile_side(), self.grid(data)
        return side * (side + 1) + 1 + (down * side) * (across * side + 1)

    def image_tokens(self, data: DataShape) -> int:
        return data.images_per_sample * self.tokens_per_image(data)

    def image_tokens_at(self, height: int, width: int, *, images_in_sample: int = 1, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> int:
        """A `height` x `width` image: best_resolution on (width, height) while a sample has at most two images
        (one tile each beyond), the global view and the tiles, each row of tokens closed by a newline, and the
        view separator (tokens_per_image's layout)."""
        across, down = 1, 1
        if images_in_sample <= 2:
            canvas_w, canvas_h = best_resolution(width, height, self.candidate_resolutions)
            across, down = canvas_w // self.vision["image_size"], canvas_h // self.vision["image_size"]
        side = self.tile_side()
        return side * (side + 1) + 1 + (down * side) * (across * side + 1)

    def prompt_framing(self, data: DataShape) -> tuple[int, str]:
        return 1, " plus <bos>"

    # -- model ----------------------------------------------------------------------------------------------------
    def multi_head(self) -> bool:
        return self.text.get("kv_lora_rank") is None

    def config(self) -> DeepseekV2Config:
        """The LM's config: language_config in transformers' DeepseekV2Config. Multi-head attention (no
        kv_lora_rank) has its head_dim as the rotary width (DeepseekV2Config's head_dim is qk_rope_head_dim)."""
        text = {**self.text, "use_cache": False}
        if self.multi_head():
            head = text["hidden_size"] // text["num_attention_heads"]
            text.update(kv_lora_rank=0, q_lora_rank=None, qk_nope_head_dim=0, qk_rope_head_dim=head, v_head_dim=head)
        return DeepseekV2Config(**text, attn_implementation=self.attn_implementation)

    def vision_config(self) -> SiglipVisionConfig:
        return SiglipVisionConfig(**self.vision, attn_implementation=self.attn_implementation)

    def _construct(self) -> nn.Module:
        model = DeepseekVL2ForCausalLM(self.vision_config(), self.config(), self.projector, self.multi_head(),
                                       self.global_view_pos)
        model.model.language.tie_weights()  # as from_pretrained leaves it (untied in every published model)
        return model

    def towers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return {"vision": [model.model.vision], "lm": [model.model.language]}

    # -- inputs ---------------------------------------------------------------------------------------------------
    def batch(self, data: DataShape, device: torch.device) -> dict:
        """What the original's processor and batchify hand the model for `data`: input_ids and labels (-100 at <bos>
        and the images' tokens), images [batch, tiles, 3, tile, tile] float32, images_seq_mask at the images'
        tokens, images_spatial_crop [batch, images, 2] of [tiles across, tiles down]."""
        self.validate(data)
        n = data.images_per_sample * self.tokens_per_image(data)
        prompt = [self.text.get("bos_token_id", 0)] + [self.image_token_id] * n
        text_ids = min(self.image_token_id, self.text["vocab_size"])  # ordinary text ids lie below <image>
        input_ids, labels = prompt_then_text(prompt, data.lm_max_length, text_ids)
        mask = [False] + [True] * n + [False] * (data.lm_max_length - 1 - n)
        across, down = self.grid(data)
        tile, rows = self.vision["image_size"], data.batch_size

        def inputs() -> dict:
            tiles = data.images_per_sample * (1 + across * down)
            return {"images": torch.randn(rows, tiles, self.vision.get("num_channels", 3), tile, tile,
                                          dtype=torch.float32, device=device),
                    "images_seq_mask": constant_tensor([mask] * rows, device, torch.bool),
                    "images_spatial_crop": constant_tensor([[[across, down]] * data.images_per_sample] * rows, device)}

        return collated(data, device, input_ids, labels, inputs)


class DeepseekVL2Spec(MixtureOfExperts, DeepseekVL2Layout):
    """Hydra target for conf/model/deepseek_vl2_*.yaml (and model=hf with a deepseek_vl_v2 config.json)."""

    experts_key = "n_routed_experts"
