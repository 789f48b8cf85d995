"""model=hf model.config=PATH: a transformers config.json picks its family by model_type and builds the model
its shipped YAML builds; every way the path can be wrong is one line; nothing is downloaded.

tests/data/hf/ holds config.json files in the Hub's own layouts (flat Qwen configs with the legacy
rope_scaling and in_chans, LLaVA's nested sub-configs that leave Llama/CLIP defaults out), written from the
published files of Qwen/Qwen2.5-VL-7B-Instruct, Qwen/Qwen2-VL-2B-Instruct, llava-hf/llava-1.5-7b-hf,
Qwen/Qwen3-VL-8B-Instruct and llava-hf/llava-v1.6-mistral-7b-hf (the last two from copies of the Hub files in
public code: no hub access here), and Qwen/Qwen3-VL-30B-A3B-Instruct (a public copy of its architecture fields; the
text tower's bos/eos ids and hidden_act, which that copy leaves out, as the Qwen3-VL-8B file has them; no
preprocessor_config.json, so Qwen3-VL's published pixel bounds), zai-org/GLM-4.5V (its config as a public report
of the downloaded model prints it, transformers 5.7.0's nested layout; no preprocessor_config.json, so the GLM
processor class's bounds),
and tiny ones in the same layouts (internvl_chat_tiny: the InternVL repository's internvl_chat format of
internvl_tiny; its published files are in test_internvl.py)."""

import pytest
import torch

from conftest import CONF, TESTS
from vlmprobe.errors import ConfigError
from vlmprobe.models.base import count_params
from vlmprobe.point.measure import measure

DATA = TESTS / "data" / "hf"
# keys a config.json may carry that transformers keeps but no model reads (the Hub files have them)
UNREAD = {"vision_config.in_chans", "vision_config.spatial_patch_size", "vision_config.vocab_size",
          "text_config._flash_attn_2_enabled", "vision_config.max_image_size", "vision_config.size",
          "vision_config.use_base_siglip", "vision_config.tie_word_embeddings",
          "text_config.norm_topk_prob",  # Qwen3-VL-MoE's router always renormalises its top-k weights
          # GLM-4.5V's text config repeats the top-level image token ids, which the model reads from there
          "text_config.image_start_token_id", "text_config.image_end_token_id", "text_config.image_token_id"}


def flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out.update(flat(value, f"{prefix}{key}."))
        elif key == "rope_parameters":  # the legacy rope_scaling's "type": "mrope" stays beside rope_type
            out[prefix + key] = {k: v for k, v in value.items() if k != "type"}
        elif prefix + key not in UNREAD:
            out[prefix + key] = value
    return out


@pytest.fixture
def spec(compose):
    from vlmprobe.point.build import build_spec  # as the planner and the worker build it (a ConfigError stays one

    return lambda *overrides: build_spec(compose(list(overrides)).model)


@pytest.mark.parametrize("folder,shipped,params", [
    ("Qwen2.5-VL-7B-Instruct", "qwen2_5_vl_7b", 8_292_166_656),
    ("Qwen2-VL-2B-Instruct", "qwen2_vl_2b", 2_208_985_600),
    ("llava-1.5-7b-hf", "llava_1_5_7b", 7_063_427_072),
    ("SmolVLM-256M-Instruct", "smolvlm_256m", 256_484_928),
    ("gemma-3-4b-it", "gemma3_4b", 4_300_079_472),
    ("Qwen3-VL-8B-Instruct", "qwen3_vl_8b", 8_767_123_696),
    ("Qwen3-VL-30B-A3B-Instruct", "qwen3_vl_30b_a3b", 31_070_754_032),
    ("llava-v1.6-mistral-7b-hf", "llava_v1_6_mistral_7b", 7_566_747_648),
    ("paligemma2-3b-pt-224", "paligemma2_3b_224", 3_032_242_416),
    ("llava-onevision-qwen2-7b-ov-hf", "llava_onevision_qwen2_7b", 8_030_807_584),
    ("GLM-4.5V", "glm4_5v", 107_710_927_360),
])
def test_a_published_config_json_builds_what_its_shipped_yaml_builds(spec, folder, shipped, params):
    from_json = spec("model=hf", f"model.config={DATA / folder}")
    from_yaml = spec(f"model={shipped}")
    assert type(from_json) is type(from_yaml) and from_json.name == folder
    assert flat(from_json.config().to_dict()) == flat(from_yaml.config().to_dict())
    json_model, yaml_model = (s.build("meta", torch.bfloat16, init=False) for s in (from_json, from_yaml))
    assert count_params(json_model) == count_params(yaml_model) == (params, params)
    assert [(n, p.shape) for n, p in json_model.named_parameters()] == [(n, p.shape) for n, p in yaml_model.named_parameters()]
    if hasattr(from_yaml, "min_pixels"):  # Qwen: the pixel bounds, from preprocessor_config.json where there is one
        assert (from_json.min_pixels, from_json.max_pixels) == (from_yaml.min_pixels, from_yaml.max_pixels)
    assert from_json.native_image_size == from_yaml.native_image_size  # SmolVLM: the processor's longest edge


@pytest.mark.parametrize("folder,shipped", [("qwen2_5_vl_tiny", "qwen2_5_vl_tiny"), ("qwen2_vl_tiny", "qwen2_vl_tiny"),
                                            ("llava_tiny", "llava_tiny"), ("idefics3_tiny", "idefics3_tiny"),
                                            ("gemma3_tiny", "gemma3_tiny"), ("mllama_tiny", "mllama_tiny"),
                                            ("internvl_tiny", "internvl_tiny"), ("paligemma_tiny", "paligemma_tiny"),
                                            ("llava_onevision_tiny", "llava_onevision_tiny"),
                                            ("internvl_chat_tiny", "internvl_tiny")])
def test_a_tiny_config_json_point_uses_the_memory_of_its_shipped_yaml_to_the_byte(plan_points, folder, shipped):
    data = ["data.batch_size=2", "data.lm_max_length=48", "measure.backend=estimate", "measure.steps=1"]
    data += ["data.image_size=112"] if shipped.startswith("qwen") else []  # a Qwen config.json has no image size
    (hf,) = plan_points(["model=hf", f"model.config={DATA / folder / 'config.json'}", *data])
    (yaml,) = plan_points([f"model={shipped}", *data])
    assert hf.inputs["model"] == folder and hf.inputs["params"] == yaml.inputs["params"]
    assert hf.inputs["image_tokens"] == yaml.inputs["image_tokens"]
    rows = [measure(p.config) for p in (hf, yaml)]
    assert rows[0]["status"] == "ok" and {k: v for k, v in rows[0].items() if k.endswith("_bytes")} == {
        k: v for k, v in rows[1].items() if k.endswith("_bytes")}


def test_a_smolvlm2_config_json_builds_smolvlm_classes_and_its_estimate_equals_the_cpu_backend(plan_points):
    # SmolVLM2 (model_type smolvlm) is Idefics3's architecture under other class names, with code of its own
    # (its forward peak differs from Idefics3's by a few KiB on the same sizes)
    data = ["data.batch_size=2", "data.lm_max_length=48", "measure.steps=1"]
    rows = {}
    for backend in ("estimate", "cpu"):
        (point,) = plan_points(["model=hf", f"model.config={DATA / 'smolvlm_tiny'}", *data, f"measure.backend={backend}"])
        rows[backend] = measure(point.config)
    (yaml,) = plan_points(["model=idefics3_tiny", *data])
    assert point.inputs["params"] == yaml.inputs["params"] and point.inputs["image_tokens"] == yaml.inputs["image_tokens"]
    assert rows["cpu"]["status"] == rows["estimate"]["status"] == "ok"
    assert {k: v for k, v in rows["estimate"].items() if k.endswith("_bytes")} == {
        k: v for k, v in rows["cpu"].items() if k.endswith("_bytes")}


def test_a_hub_name_is_read_from_the_local_cache_only(spec, tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "models--llava-hf--llava-1.5-7b-hf" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((DATA / "llava-1.5-7b-hf" / "config.json").read_text())
    (tmp_path / "models--llava-hf--llava-1.5-7b-hf" / "refs").mkdir()
    (tmp_path / "models--llava-hf--llava-1.5-7b-hf" / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a download attempt would fail, not reach the network
    llava = spec("model=hf", "model.config=llava-hf/llava-1.5-7b-hf")
    assert llava.name == "llava-hf/llava-1.5-7b-hf"
    assert count_params(llava.build("meta", torch.bfloat16, init=False))[0] == 7_063_427_072
    with pytest.raises(ConfigError, match=r"model.config=Qwen/Qwen2.5-VL-3B-Instruct is not allowed: no such file or "
                                          r"folder, and no config.json of the hub model .* in the local Hugging Face "
                                          r"cache \(vlmprobe downloads nothing unless asked\); add model.fetch=true "
                                          r".*`hf download Qwen/Qwen2.5-VL-3B-Instruct config.json"):
        spec("model=hf", "model.config=Qwen/Qwen2.5-VL-3B-Instruct")


def test_model_fetch_downloads_only_the_json_configs_of_an_uncached_hub_id(spec, tmp_path, monkeypatch):
    import vlmprobe.models.hf as hf
    from huggingface_hub.errors import EntryNotFoundError

    source, asked = DATA / "Qwen2.5-VL-7B-Instruct", []

    def download(repo, filename):  # huggingface_hub.hf_hub_download's contract: a path in the cache, or raise
        asked.append((repo, filename))
        if not (source / filename).is_file():
            raise EntryNotFoundError(f"{filename} not in {repo}")
        (tmp_path / filename).write_text((source / filename).read_text())
        return str(tmp_path / filename)

    monkeypatch.setattr(hf, "try_to_load_from_cache", lambda repo, filename, cache_dir=None: None)
    monkeypatch.setattr(hf, "hf_hub_download", download)
    model = spec("model=hf", "model.config=Qwen/Qwen2.5-VL-7B-Instruct", "model.fetch=true")
    assert count_params(model.build("meta", torch.bfloat16, init=False))[0] == 8_292_166_656  # its config's hand count
    assert {name for _, name in asked} <= {"config.json", *hf.PROCESSOR_FILES}  # JSON files only, never weights
    assert model.max_pixels == 12845056  # read from the fetched preprocessor_config.json

    def offline(repo, filename):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(hf, "hf_hub_download", offline)
    with pytest.raises(ConfigError, match=r"^model.config=acme/New-VLM is not allowed: its config.json could not be "
                                          r"fetched \(OSError: We couldn't connect"):
        spec("model=hf", "model.config=acme/New-VLM", "model.fetch=true")


def test_the_name_can_be_given(plan_points):
    (point,) = plan_points(["model=hf", f"model.config={DATA / 'llava_tiny'}", "model.name=mine"])
    assert point.inputs["model"] == "mine"


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case,message", [
    ("no config", r"model.config=null is not allowed with model=hf: give model.config=PATH, a config.json file or a "
                  r"folder holding one"),
    ("missing", r"model.config=.*/nowhere is not allowed: no such file or folder \(give a config.json file or a "
                r"folder holding one\)"),
    ("folder without config.json", r"model.config=.*/empty is not allowed: the folder has no config.json"),
    ("not JSON", r"model.config=.*/broken.json is not allowed: it cannot be read as JSON"),
    ("not an object", r"model.config=.*/list.json is not allowed: it is JSON but not an object of config keys"),
    ("unsupported family", r"model.config=.*/molmo is not allowed: its model_type 'molmo' is not a family vlmprobe "
                           r"builds \(supported: deepseek_vl_v2, gemma3, glm4v, glm4v_moe, idefics3, internvl, internvl_chat, llava, llava_next, llava_onevision, mistral3, mllama, "
                           r"paligemma, qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3_vl_moe, smolvlm\)"),
    ("no model_type", r"model.config=.*/bare.json is not allowed: its model_type None is not a family"),
])
def test_a_config_path_that_cannot_be_used_is_one_line(plan_points, tmp_path, case, message):
    (tmp_path / "empty").mkdir()
    paths = {
        "no config": "null",
        "missing": tmp_path / "nowhere",
        "folder without config.json": tmp_path / "empty",
        "not JSON": _write(tmp_path / "broken.json", "{not json"),
        "not an object": _write(tmp_path / "list.json", "[1, 2]"),
        "unsupported family": _write(tmp_path / "molmo" / "config.json", '{"model_type": "molmo"}').parent,
        "no model_type": _write(tmp_path / "bare.json", '{"hidden_size": 8}'),
    }
    with pytest.raises(ConfigError, match=message) as error:
        plan_points(["model=hf", f"model.config={paths[case]}"])
    assert "\n" not in str(error.value)


def test_the_cli_refuses_a_missing_config_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from vlmprobe.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["model=hf", f"model.config={tmp_path / 'nowhere'}", f"results_dir={tmp_path / 'r'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "model.config=" in lines[0] and "no such file or folder" in lines[0]
    assert not (tmp_path / "r").exists()


def test_a_hub_id_is_the_shipped_config_of_that_model_or_its_cached_config_json():
    from vlmprobe.config.overrides import with_hub_ids
    from vlmprobe.hub import HUB_IDS

    assert with_hub_ids(["model=Qwen/Qwen2.5-VL-7B-Instruct", "data.batch_size=4"]) == ["model=qwen2_5_vl_7b",
                                                                                          "data.batch_size=4"]
    assert with_hub_ids(["model=qwen/qwen2-vl-2b-instruct"]) == ["model=qwen2_vl_2b"]  # the Hub ignores case
    assert with_hub_ids(["model=acme/Some-VLM"]) == ["model=hf", "model.config=acme/Some-VLM"]
    assert with_hub_ids(["model=qwen2_vl_2b", "+sweep=smoke"]) == ["model=qwen2_vl_2b", "+sweep=smoke"]
    for option in set(HUB_IDS.values()):  # each shipped config names one of the ids that map to it, as its source
        text = (CONF / "model" / f"{option}.yaml").read_text()
        assert any(hub_id in text for hub_id, target in HUB_IDS.items() if target == option), option
