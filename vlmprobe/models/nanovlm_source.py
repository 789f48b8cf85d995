"""nanoVLM's own model code, from a checkout of huggingface/nanoVLM (model.source=DIR on a nanovlm_* model).

The checkout's `models` package builds the model from the config's dimensions and its forward computes the loss, so
a user who changed nanoVLM's modules measures their own code. The API taken is that of the commit of nanoVLM issue
#103 (`models.config.VLMConfig`, `models.vision_language_model.VisionLanguageModel`); a checkout with another API is
refused with one line naming what is missing. nanoVLM's tokenizer is replaced by a stand-in that has only the image
token's id, and backbone weights are not loaded (weights do not change memory).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from pathlib import Path

from vlmprobe.errors import ConfigError

__all__ = ["checked_source", "config_fields", "image_token_id", "load", "make_config", "TESTED"]

TESTED = "731d8c6"  # huggingface/nanoVLM commit whose models/ API this takes
FORWARD = ("input_ids", "image", "attention_mask", "targets")
PACKAGE = "models"  # the checkout's top-level package; its modules import each other as models.*
MARKER = Path(PACKAGE) / "vision_language_model.py"


def checked_source(source) -> Path:
    """The checkout directory `source` names, if it holds nanoVLM's model code; else one line (ConfigError)."""
    path = Path(str(source)).expanduser()
    if not (path / MARKER).is_file():
        raise ConfigError(f"model.source={source!r} is not allowed: give a checkout of huggingface/nanoVLM (a "
                          f"directory with {MARKER}; tested at {TESTED}), or null for vlmprobe's implementation")
    return path.resolve()


def image_token_id(vocab_size: int) -> int:
    """The id the image placeholders carry: the last id of the vocabulary, where nanoVLM's tokenizer puts the
    special tokens it adds (which id it is changes nothing in memory; the embedding must hold it)."""
    return vocab_size - 1


def _stand_in_tokenizer_module(token_id: int) -> types.ModuleType:
    module = types.ModuleType("data.processors")
    tokenizer = types.SimpleNamespace(image_token_id=token_id)
    module.get_tokenizer = lambda *args, **kwargs: tokenizer
    return module


def load(source: Path, token_id: int):
    """(VLMConfig, VisionLanguageModel) of the checkout at `source`. The checkout's `models` package replaces
    any other of that name in this process (a worker measures one source at a time; a second source in the
    same process must not run the first one's modules)."""
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    saved = {name: sys.modules.get(name) for name in ("data", "data.processors")}
    sys.modules["data"] = types.ModuleType("data")
    sys.modules["data.processors"] = _stand_in_tokenizer_module(token_id)
    sys.path.insert(0, str(source))
    try:
        import importlib

        config = importlib.import_module(f"{PACKAGE}.config")
        vlm = importlib.import_module(f"{PACKAGE}.vision_language_model")
    except Exception as exc:  # noqa: BLE001 - anything the checkout's import raises is a bad source
        raise ConfigError(f"model.source={str(source)!r}: importing its {PACKAGE} package failed "
                          f"({type(exc).__name__}: {exc}); the API taken is nanoVLM's at {TESTED}") from None
    finally:
        sys.path.remove(str(source))
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    missing = [name for name in ("VLMConfig",) if not hasattr(config, name)]
    missing += [name for name in ("VisionLanguageModel",) if not hasattr(vlm, name)]
    if missing:
        raise ConfigError(f"model.source={str(source)!r} has no {', '.join(missing)}: the API taken is nanoVLM's "
                          f"at {TESTED}")
    forward = list(inspect.signature(vlm.VisionLanguageModel.forward).parameters)[1:]
    if tuple(forward[:len(FORWARD)]) != FORWARD:
        raise ConfigError(f"model.source={str(source)!r}: VisionLanguageModel.forward takes ({', '.join(forward)}), "
                          f"not ({', '.join(FORWARD)}); the API taken is nanoVLM's at {TESTED}")
    return config.VLMConfig, vlm.VisionLanguageModel


def config_fields(vision: dict, text: dict, image_size: int, pixel_shuffle_factor: int,
                  image_tokens: int) -> dict:
    """VLMConfig's fields for vlmprobe's nanoVLM config: the dimensions, and the settings whose default the
    point relies on (no dropout, no CLS token, tied head, embeddings in, no backbone weights) said outright, so
    that a checkout with other defaults still builds the model the config describes."""
    return {
        "vit_hidden_dim": vision["hidden_size"], "vit_inter_dim": vision["intermediate_size"],
        "vit_patch_size": vision["patch_size"], "vit_img_size": image_size,
        "vit_n_heads": vision["num_attention_heads"], "vit_n_blocks": vision["num_hidden_layers"],
        "vit_ln_eps": vision["layer_norm_eps"], "vit_dropout": 0.0, "vit_cls_flag": False,
        "lm_hidden_dim": text["hidden_size"], "lm_inter_dim": text["intermediate_size"],
        "lm_rms_eps": text["rms_norm_eps"], "lm_re_base": text["rope_theta"], "lm_vocab_size": text["vocab_size"],
        "lm_max_position_embeddings": text["max_position_embeddings"],
        "lm_n_heads": text["num_attention_heads"], "lm_n_kv_heads": text["num_key_value_heads"],
        "lm_n_blocks": text["num_hidden_layers"], "lm_dropout": 0.0, "lm_tie_weights": True,
        "lm_use_tokens": False, "mp_pixel_shuffle_factor": pixel_shuffle_factor,
        "mp_image_token_length": image_tokens, "vlm_load_backbone_weights": False,
    }


def make_config(config_class, fields: dict, source: Path):
    known = {f.name for f in dataclasses.fields(config_class)}
    missing = sorted(set(fields) - known)
    if missing:
        raise ConfigError(f"model.source={str(source)!r}: its VLMConfig has no {', '.join(missing)}; the API "
                          f"taken is nanoVLM's at {TESTED}")
    return config_class(**fields)
