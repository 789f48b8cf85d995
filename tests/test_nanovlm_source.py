"""model.source: a nanoVLM checkout's own model code run in vlmprobe's step (vlmprobe.models.nanovlm_source).

No checkout of huggingface/nanoVLM is here (nothing is downloaded in CI): `checkout` writes a stand-in with
nanoVLM's API (731d8c6) whose model is built from nothing but its VLMConfig and computes what nanoVLM's forward
computes (image features written over the placeholders the tokenizer's id marks, cross-entropy over every
position); its data/processors.py fails to import as the real one does on a machine without torchvision. A
point run through it must be the point vlmprobe runs with its own nanoVLM, to the byte: that holds only if the
config's dimensions reach the checkout's VLMConfig, the placeholders carry the id its tokenizer gives, and its
forward gets its arguments in nanoVLM's order. With VLMPROBE_NANOVLM_DIR naming a real checkout, the last test
builds nanoVLM's own code.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from vlmprobe.config.plan import plan_overrides
from vlmprobe.errors import ConfigError
from vlmprobe.point.measure import measure

CONFIG = '''
from dataclasses import dataclass

@dataclass
class VLMConfig:
    vit_hidden_dim: int = 768
    vit_inter_dim: int = 3072
    vit_patch_size: int = 16
    vit_img_size: int = 224
    vit_n_heads: int = 12
    vit_dropout: float = 0.1
    vit_n_blocks: int = 12
    vit_ln_eps: float = 1e-6
    vit_cls_flag: bool = True
    lm_hidden_dim: int = 576
    lm_inter_dim: int = 1536
    lm_rms_eps: float = 1e-5
    lm_re_base: int = 100000
    lm_max_position_embeddings: int = 2048
    lm_vocab_size: int = 49153
    lm_n_heads: int = 9
    lm_n_kv_heads: int = 3
    lm_dropout: float = 0.1
    lm_n_blocks: int = 30
    lm_use_tokens: bool = True
    lm_tie_weights: bool = False
    mp_pixel_shuffle_factor: int = 2
    mp_image_token_length: int = 49
    vlm_load_backbone_weights: bool = True
'''

# the defaults above are not the point's (dropout, CLS token, untied head, backbone weights): a setting left to
# them would make a model other than the config's, and the bytes would say so
MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

from data.processors import get_tokenizer
from vlmprobe.models.nanovlm import NanoVLM

class VisionLanguageModel(nn.Module):
    def __init__(self, cfg, load_backbone=True):
        super().__init__()
        assert not load_backbone and not cfg.vlm_load_backbone_weights, "no weights to download"
        assert cfg.vit_dropout == cfg.lm_dropout == 0.0 and not cfg.vit_cls_flag and cfg.lm_tie_weights
        assert not cfg.lm_use_tokens
        self.cfg = cfg
        self.tokenizer = get_tokenizer("HuggingFaceTB/SmolLM2-135M", {"image_token": "<|image|>"})
        vision = {"hidden_size": cfg.vit_hidden_dim, "intermediate_size": cfg.vit_inter_dim,
                  "num_hidden_layers": cfg.vit_n_blocks, "num_attention_heads": cfg.vit_n_heads,
                  "patch_size": cfg.vit_patch_size, "layer_norm_eps": cfg.vit_ln_eps}
        text = {"vocab_size": cfg.lm_vocab_size, "hidden_size": cfg.lm_hidden_dim,
                "intermediate_size": cfg.lm_inter_dim, "num_hidden_layers": cfg.lm_n_blocks,
                "num_attention_heads": cfg.lm_n_heads, "num_key_value_heads": cfg.lm_n_kv_heads,
                "rms_norm_eps": cfg.lm_rms_eps, "rope_theta": float(cfg.lm_re_base),
                "max_position_embeddings": cfg.lm_max_position_embeddings}
        model = NanoVLM(vision, text, cfg.vit_img_size, cfg.mp_pixel_shuffle_factor, "sdpa",
                        self.tokenizer.image_token_id)
        self.vision_encoder, self.decoder, self.MP = model.vision, model.lm, model.projector
        self._model = [model]  # not a submodule: its parts are registered above under nanoVLM's names

    def forward(self, input_ids, image, attention_mask=None, targets=None):
        n = self.cfg.mp_image_token_length
        if not isinstance(input_ids, torch._subclasses.FakeTensor):  # real tensors: the placeholders are there
            assert bool((input_ids[:, :n] == self.tokenizer.image_token_id).all()), "no image placeholders"
        return self._model[0](input_ids, image, attention_mask, targets)
'''


def write_checkout(root, config=CONFIG, model=MODEL):
    (root / "models").mkdir(parents=True)
    (root / "models" / "__init__.py").write_text("")
    (root / "models" / "config.py").write_text(textwrap.dedent(config))
    (root / "models" / "vision_language_model.py").write_text(textwrap.dedent(model))
    (root / "data").mkdir()
    (root / "data" / "__init__.py").write_text("")
    (root / "data" / "processors.py").write_text("import torchvision_that_is_not_here\n")
    return root


@pytest.fixture
def checkout(tmp_path):
    return write_checkout(tmp_path / "nanoVLM")


def run(backend, *extra):
    (planned,) = plan_overrides(["+sweep=smoke", "model=nanovlm_tiny", f"measure.backend={backend}", "device=rtx3090",
                                 "sweep.axes.data.batch_size=[2]", "sweep.axes.data.lm_max_length=[64]", *extra])
    return planned, measure(planned.config)


FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "forward_peak_bytes", "backward_peak_bytes",
           "optimizer_peak_bytes", "activations_bytes", "params_bytes")


@pytest.mark.parametrize("backend", ["cpu", "estimate"])
def test_a_checkouts_code_with_nanovlms_api_runs_the_point_ours_runs_to_the_byte(checkout, backend):
    ours_planned, ours = run(backend)
    theirs_planned, theirs = run(backend, f"model.source={checkout}")
    assert ours["status"] == theirs["status"] == "ok"
    assert ours_planned.inputs["params"] == theirs_planned.inputs["params"]
    assert (ours_planned.inputs["model_source"], theirs_planned.inputs["model_source"]) == (None, str(checkout.resolve()))
    assert {k: theirs[k] for k in FIGURES} == {k: ours[k] for k in FIGURES}
    assert "data" not in sys.modules or not hasattr(sys.modules["data"], "processors")  # the stand-in is gone


def test_knobs_reach_a_checkouts_towers(checkout):
    """Freezing the vision tower and checkpointing the LM's blocks act on nanoVLM's vision_encoder and decoder."""
    knobs = ["train.freeze_vision=true", "train.grad_ckpt.lm=true"]
    _, ours = run("estimate", *knobs)
    _, theirs = run("estimate", f"model.source={checkout}", *knobs)
    _, plain = run("estimate", f"model.source={checkout}")
    assert theirs["peak_allocated_bytes"] == ours["peak_allocated_bytes"] != plain["peak_allocated_bytes"]


def test_a_source_that_is_no_nanovlm_checkout_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model.source='.*' is not allowed: give a checkout of huggingface/nanoVLM "
                                          r"\(a directory with models/vision_language_model.py; tested at 731d8c6\)"):
        run("estimate", f"model.source={tmp_path}")


@pytest.mark.parametrize("config, model, line", [
    (CONFIG.replace("    mp_image_token_length: int = 49\n", ""), MODEL, "its VLMConfig has no mp_image_token_length"),
    (CONFIG, MODEL.replace("def forward(self, input_ids, image,", "def forward(self, input_ids, images,"),
     "VisionLanguageModel.forward takes (input_ids, images, attention_mask, targets), not (input_ids, image, "
     "attention_mask, targets)"),
    (CONFIG, MODEL.replace("class VisionLanguageModel", "class VLM"), "has no VisionLanguageModel"),
    (CONFIG, "import nothing_of_that_name\n", "importing its models package failed (ModuleNotFoundError"),
], ids=["config field", "forward", "model class", "import"])
def test_a_checkout_with_another_api_is_one_line_naming_what_differs(tmp_path, config, model, line):
    source = write_checkout(tmp_path / "other", config, model)
    with pytest.raises(ConfigError, match=r"the API taken is nanoVLM's at 731d8c6") as raised:
        run("estimate", f"model.source={source}")
    assert line in str(raised.value)


@pytest.mark.parametrize("override, line", [
    ("model.attn_implementation=eager", "model.attn_implementation='eager' is not allowed with model.source"),
    ("data.images_per_sample=2", "data.images_per_sample=2 is not allowed with model.source"),
])
def test_what_nanovlms_code_cannot_run_is_refused_with_a_source(checkout, override, line):
    with pytest.raises(ConfigError, match=line):
        run("estimate", f"model.source={checkout}", override)


def test_check_nanovlm_code_prints_both_codes_and_their_difference(checkout):
    """(Its bad values: tests/test_scripts.py.)"""
    script = [sys.executable, str(REPO / "scripts" / "check_nanovlm_code.py")]
    proc = subprocess.run([*script, "--nanovlm-dir", str(checkout), "--model", "nanovlm_tiny", "--lengths", "64",
                           "--batch-sizes", "8,16"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("|") and "ok / ok" in line]
    assert len(table) == 2 and all(line.split("|")[-3].strip() == "0" for line in table)  # nanoVLM's - ours: 0 B
    assert "## Per sample, batch 8 -> 16" in proc.stdout


@pytest.mark.skipif(not os.environ.get("VLMPROBE_NANOVLM_DIR"), reason="VLMPROBE_NANOVLM_DIR names no nanoVLM checkout")
@pytest.mark.parametrize("knobs", [[], ["train.grad_ckpt.lm=true", "train.grad_ckpt.vision=true"],
                                   ["train.freeze_vision=true"], ["train.lora_r=8"],
                                   ["measure.alloc_conf=expandable_segments:True"], ["train.autocast_dtype=float16"]])
def test_nanovlms_own_code_is_ours_to_the_byte(knobs):
    """nanoVLM's code (a checkout at 731d8c6) built from nanovlm_222m has its 222,083,328 parameters (FACTS), and
    a point of the seq_len sweep estimated with it is the point estimated with ours, every figure to the byte,
    with the knobs that change what is kept (checkpointing, a frozen tower, LoRA on the same named layers), the
    allocator's rules or the autocast dtype."""
    source = f"model.source={os.environ['VLMPROBE_NANOVLM_DIR']}"
    points = [plan_overrides(["+sweep=seq_len", "measure.backend=estimate", "device=rtx3090", *knobs, *extra,
                              "sweep.axes.data.batch_size=[2]", "sweep.axes.data.lm_max_length=[128]"])[0]
              for extra in ([], [source])]
    ours_params, their_params = (p.inputs["params"] for p in points)  # LoRA's adapters on the same layers
    assert ours_params == their_params and (knobs or ours_params == 222_083_328)
    ours, theirs = (measure(p.config) for p in points)
    assert ours["status"] == theirs["status"] == "ok"
    assert {k: theirs[k] for k in FIGURES} == {k: ours[k] for k in FIGURES}
