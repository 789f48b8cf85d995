"""`model=hf model.config=PATH`: any model of a supported family from its transformers config.json.

PATH is a config.json file, a folder holding one, or a hub name whose config.json is already in the local Hugging
Face cache. Its `model_type` picks the family class, which builds the spec from the file's values (and the
preprocessor configs beside it, where the family reads them); the model is then built with random weights. Nothing
is downloaded and no code from the model's repository runs (no trust_remote_code): a model_type without a family
here is refused in one line naming it and the families there are.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import hf_hub_download, try_to_load_from_cache  # transformers' own dependency
from huggingface_hub.errors import EntryNotFoundError
from hydra.utils import get_class

from vlmprobe.errors import ConfigError, first_line
from vlmprobe.hub import HUB_NAME
from vlmprobe.models.base import ModelSpec

__all__ = ["FAMILIES", "cached_hub_file", "family"]


# model_type -> the family's spec class, named as conf/model/*.yaml name it (`_target_`): each family's module
# imports its transformers classes, so only the family a config.json names is imported
FAMILIES = {
    "qwen2_vl": "qwen2_vl.Qwen2VLSpec", "qwen2_5_vl": "qwen2_5_vl.Qwen2_5_VLSpec", "qwen3_vl": "qwen3_vl.Qwen3VLSpec",
    "qwen3_vl_moe": "qwen3_vl.Qwen3VLMoeSpec", "llava": "llava.LlavaSpec", "llava_next": "llava_next.LlavaNextSpec",
    "llava_onevision": "llava_onevision.LlavaOnevisionSpec", "idefics3": "idefics3.Idefics3Spec",
    "smolvlm": "idefics3.SmolVLMSpec", "gemma3": "gemma3.Gemma3Spec", "mllama": "mllama.MllamaSpec",
    "internvl": "internvl.InternVLSpec", "paligemma": "paligemma.PaliGemmaSpec", "mistral3": "mistral3.Mistral3Spec",
    "glm4v": "glm4v.Glm4vSpec", "glm4v_moe": "glm4v.Glm4vMoeSpec",
    "deepseek_vl_v2": "deepseek_vl2.DeepseekVL2Spec",
    "internvl_chat": "internvl.InternVLSpec",  # the InternVL repository's format, mapped to the native model
}


def family(model_type: str) -> type[ModelSpec]:
    """The spec class of a supported model_type (a key of FAMILIES)."""
    return get_class(f"vlmprobe.models.{FAMILIES[model_type]}")


def spec_from_config(config: str | None, name: str | None = None, attn_implementation: str = "sdpa",
                     fetch: bool = False) -> ModelSpec:
    """Hydra target of conf/model/hf.yaml."""
    if not config:
        raise ConfigError("model.config=null is not allowed with model=hf: give model.config=PATH, a config.json "
                          "file or a folder holding one (or a hub name whose config.json is in the local cache)")
    if not isinstance(fetch, bool):
        raise ConfigError(f"model.fetch={fetch!r} is not allowed: use true or false")
    path = find_config(str(config), fetch)
    raw = read_json(path, f"model.config={config}")
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model.config={config} is not allowed: its model_type {model_type!r} is not a family "
                          f"vlmprobe builds (supported: {', '.join(sorted(FAMILIES))})")
    spec_class = family(model_type)
    files = ["preprocessor"] + (["video_preprocessor"] if spec_class.reads_video_preprocessor else [])
    processors = {key: beside(path, f"{key}_config.json", config) for key in files}
    return spec_class.from_hf_config(raw, name=name or default_name(str(config), path),
                                     attn_implementation=attn_implementation, **processors)


def beside(path: Path, filename: str, config: str) -> dict | None:
    """The JSON file `filename` in the folder of config.json `path` (a processor's settings), or None."""
    other = path.parent / filename
    return read_json(other, f"{other} (beside model.config={config})") if other.is_file() else None


def find_config(config: str, fetch: bool = False) -> Path:
    """The config.json that model.config names; ConfigError saying how to get it where there is none. With `fetch`
    a hub name not in the cache is fetched (fetched_hub_config)."""
    path = Path(config).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.config={config} is not allowed: the folder has no config.json")
        return path / "config.json"
    if path.is_file():
        return path
    if HUB_NAME.match(config) and not config.startswith("."):
        cached = cached_hub_file(config, "config.json")
        if cached is not None:
            return cached
        if fetch:
            return fetched_hub_config(config)
        raise ConfigError(f"model.config={config} is not allowed: no such file or folder, and no config.json of the "
                          f"hub model {config} in the local Hugging Face cache (vlmprobe downloads nothing unless "
                          f"asked); add model.fetch=true to fetch its config.json alone (no weights, no code), or get "
                          f"it with `hf download {config} config.json preprocessor_config.json`, or copy the file here "
                          f"and give its path")
    raise ConfigError(f"model.config={config} is not allowed: no such file or folder (give a config.json file or a "
                      f"folder holding one)")


PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")  # fetched beside config.json where the
# model has them (a family reads them for its image sizes)


def fetched_hub_config(repo: str) -> Path:
    """config.json of hub model `repo` downloaded into the Hugging Face cache (huggingface_hub.hf_hub_download), with
    the processor configs the model has; only these JSON files, never weights or code. One line where it fails."""
    try:
        path = Path(hf_hub_download(repo, "config.json"))
    except Exception as exc:  # offline, no such repository, gated: the library's own words
        raise ConfigError(f"model.config={repo} is not allowed: its config.json could not be fetched "
                          f"({type(exc).__name__}: {first_line(exc)})") from None
    for name in PROCESSOR_FILES:
        try:
            hf_hub_download(repo, name)
        except EntryNotFoundError:  # a model without that file: its family's defaults stand
            pass
        except Exception as exc:
            raise ConfigError(f"model.config={repo} is not allowed: its {name} could not be fetched "
                              f"({type(exc).__name__}: {first_line(exc)})") from None
    return path


def cached_hub_file(repo: str, filename: str, cache_dir: str | Path | None = None) -> Path | None:
    """`filename` of hub model `repo` from the local Hugging Face cache (or `cache_dir`), without any network
    access."""
    found = try_to_load_from_cache(repo, filename, cache_dir=cache_dir)
    return Path(found) if isinstance(found, str) else None  # None, or a marker that the file does not exist


def read_json(path: Path, what: str) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what} is not allowed: it cannot be read as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} is not allowed: it is JSON but not an object of config keys")
    return raw


def default_name(config: str, path: Path) -> str:
    """The row's model name: the hub name, else the model's folder (or the file's stem for a loose file)."""
    if not Path(config).expanduser().exists():
        return config  # a hub name found in the cache
    return path.parent.name if path.name == "config.json" else path.stem
