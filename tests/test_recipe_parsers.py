"""A person's training file read as vlmprobe settings (vlmprobe/recipes): each small file under tests/data/recipes
follows a framework's example (a comment in it says which); the settings are checked against the values written in
the file (read here with yaml / json / by hand, not through the parser), every key of the file is named in the
lines printed, every setting exists in conf/, and each bad input is one ConfigError line saying what is allowed."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from conftest import REPO
from vlmprobe.errors import ConfigError
from vlmprobe.hub import shipped_option
from vlmprobe.recipes import KINDS, detect_kind, mapping_lines, read_recipe_file

DATA = REPO / "tests" / "data" / "recipes"
LM_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def settings(name: str, kind: str | None = None) -> dict:
    return read_recipe_file(DATA / name, kind).overrides()


def test_llamafactory_lora_yaml_becomes_the_values_it_writes():
    written = yaml.safe_load((DATA / "llamafactory_qwen2_5vl_lora_sft.yaml").read_text())
    recipe = read_recipe_file(DATA / "llamafactory_qwen2_5vl_lora_sft.yaml")
    got = recipe.overrides()
    assert (recipe.kind, recipe.recipe) == ("llamafactory", "llamafactory")
    assert got["model"] == written["model_name_or_path"] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert shipped_option(got["model"]) == "qwen2_5_vl_7b"  # the command line takes the id as is
    assert got["data.max_pixels"] == written["image_max_pixels"]
    assert got["data.video_max_pixels"] == written["video_max_pixels"]
    assert got["train.lora_r"] == written["lora_rank"] == 16
    assert got["train.lora_alpha"] == 2 * written["lora_rank"]  # LLaMA-Factory: lora_alpha defaults to 2 x rank
    assert got["train.lora_target_modules"] == LM_LINEAR  # `all`, vision tower frozen: the LM's linear layers
    assert got["train.freeze_vision"] is True and got["train.lora_towers"] == ["lm"]
    assert got["model.attn_implementation"] == "flash_attention_2"  # flash_attn: fa2
    assert got["dist"] == "zero3"  # the JSON beside it names stage 3
    assert got["dist.deepspeed_config"] == str(DATA / "ds_z3_config.json")
    assert got["data.lm_max_length"] == written["cutoff_len"]
    assert got["data.batch_size"] == written["per_device_train_batch_size"]
    assert got["train.grad_accum_steps"] == written["gradient_accumulation_steps"]
    assert got["train.autocast_dtype"] == "bfloat16" and got["train.param_dtype"] == "bfloat16"  # LoRA + bf16
    assert got["optimizer"] == "adamw_fused"  # optim: adamw_torch_fused
    assert got["step"] == "sft"


def test_llamafactory_full_bf16_upcasts_the_trained_weights_and_dpo_splits_the_row(tmp_path):
    """init_adapter upcasts trainable weights to float32 outside ZeRO-3; a DPO row is cutoff_len tokens."""
    file = tmp_path / "full_dpo.yaml"
    file.write_text("model_name_or_path: Qwen/Qwen2-VL-7B-Instruct\nstage: dpo\nfinetuning_type: full\n"
                    "lora_rank: 8\npref_loss: orpo\ncutoff_len: 3000\nbf16: true\nfreeze_vision_tower: false\n")
    got = read_recipe_file(file).overrides()
    assert got["train.lora_r"] == 0 and got["train.param_dtype"] == "float32"
    assert got["train.freeze_vision"] is False and "train.lora_towers" not in got
    assert (got["step"], got["step.logits"], got["step.reference"]) == ("dpo", "full_fp32", False)
    assert got["data.lm_max_length"] + got["step.completion_length"] == 3000


def test_swift_command_line_becomes_the_values_it_writes():
    text = (DATA / "swift_sft_qwen2_5vl.sh").read_text()
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    flag = {tokens[i][2:]: tokens[i + 1] for i in range(len(tokens) - 1) if tokens[i].startswith("--")}
    recipe = read_recipe_file(DATA / "swift_sft_qwen2_5vl.sh")
    got = recipe.overrides()
    assert (recipe.kind, recipe.recipe) == ("ms_swift", "ms_swift")
    assert got["model"] == flag["model"]
    assert got["train.lora_r"] == int(flag["lora_rank"]) and got["train.lora_alpha"] == int(flag["lora_alpha"])
    assert got["train.lora_target_modules"] == LM_LINEAR  # all-linear with the ViT frozen
    assert got["train.freeze_vision"] is True and got["train.lora_towers"] == ["lm"]
    assert got["train.param_dtype"] == got["train.autocast_dtype"] == flag["torch_dtype"]
    assert got["data.batch_size"] == int(flag["per_device_train_batch_size"])
    assert got["train.grad_accum_steps"] == int(flag["gradient_accumulation_steps"])
    assert got["data.lm_max_length"] == int(flag["max_length"])
    assert got["model.attn_implementation"] == "flash_attention_2"  # flash_attn
    assert got["data.max_pixels"] == 1003520  # MAX_PIXELS=1003520 before the command
    assert got["dist.world_size"] == 2  # NPROC_PER_NODE=2
    # --deepspeed zero2: ms-swift's swift/config/zero2.json (stage 2, buckets of 2e8, overlap_comm false)
    assert (got["dist"], got["dist.reduce_bucket_size"], got["dist.overlap_comm"]) == ("zero2", 200000000, False)
    assert got["train.grad_ckpt.lm"] is got["train.grad_ckpt.vision"] is True


def test_swift_args_json_becomes_the_values_it_writes():
    written = json.loads((DATA / "swift_args.json").read_text())
    got = settings("swift_args.json")
    assert got["step"] == written["rlhf_type"] == "grpo"
    assert got["train.lora_r"] == 0  # tuner_type full: its lora_rank is not read
    assert got["train.freeze_vision"] is written["freeze_vit"] is False and "train.lora_towers" not in got
    assert got["step.num_generations"] == written["num_generations"]
    assert got["step.max_completion_length"] == written["max_completion_length"]
    assert got["step.beta"] == written["beta"] and got["step.use_vllm"] is written["use_vllm"]
    assert got["data.lm_max_length"] == written["max_length"]  # GRPO: the prompt's length
    assert (got["dist"], got["dist.offload_optimizer"]) == ("zero3", "cpu")  # the inline DeepSpeed dict
    assert got["dist.world_size"] == written["global_world_size"]
    assert got["dist.ranks_per_node"] == written["local_world_size"]


def test_trl_sft_yaml_becomes_the_values_it_writes():
    written = yaml.safe_load((DATA / "trl_sft_qwen2_5vl.yaml").read_text())
    recipe = read_recipe_file(DATA / "trl_sft_qwen2_5vl.yaml")
    got = recipe.overrides()
    assert (recipe.kind, recipe.recipe) == ("trl_sft", "trl_sft")
    assert got["train.param_dtype"] == written["dtype"] and got["train.autocast_dtype"] == "bfloat16"
    assert got["train.lora_r"] == written["lora_r"]
    assert got["train.lora_alpha"] == 32 and got["train.lora_dropout"] == 0.05  # ModelConfig's defaults
    assert got["train.lora_target_modules"] == written["lora_target_modules"]
    assert got["train.freeze_vision"] is True  # peft freezes every weight but the adapters
    assert got["data.lm_max_length"] == written["max_length"] and got["data.packing"] is True  # padding_free
    assert got["train.grad_ckpt.lm"] is True and got["train.grad_ckpt_reentrant"] is False
    assert got["train.liger_kernel"] is True and got["model.attn_implementation"] == "sdpa"
    assert got["data.batch_size"] == written["per_device_train_batch_size"]


def test_trl_grpo_yaml_becomes_the_values_it_writes():
    written = yaml.safe_load((DATA / "trl_grpo_qwen2_5vl.yaml").read_text())
    recipe = read_recipe_file(DATA / "trl_grpo_qwen2_5vl.yaml")
    got = recipe.overrides()
    assert (recipe.kind, recipe.recipe) == ("trl_grpo", "trl_grpo")
    for key in ("num_generations", "max_completion_length", "beta", "use_vllm"):
        assert got[f"step.{key}"] == written[key]
    assert got["data.lm_max_length"] == written["max_prompt_length"]
    assert got["data.batch_size"] == written["per_device_train_batch_size"]  # completions, as TRL counts them
    assert got["train.quantization"] == "nf4" and got["train.quantization_double_quant"] is False  # load_in_4bit
    assert got["train.quantization_compute_dtype"] == written["dtype"]
    # peft's all-linear: every Linear but lm_head, the vision tower's too
    assert got["train.lora_towers"] == ["lm", "vision"] and got["train.freeze_vision"] is False
    assert got["train.lora_target_modules"][:7] == LM_LINEAR and "qkv" in got["train.lora_target_modules"]


def test_accelerate_fsdp2_yaml_becomes_dist_settings():
    written = yaml.safe_load((DATA / "accelerate_fsdp2.yaml").read_text())
    recipe = read_recipe_file(DATA / "accelerate_fsdp2.yaml")
    got = recipe.overrides()
    assert (recipe.kind, recipe.recipe) == ("accelerate", "none")
    assert got["dist"] == "fsdp2" and got["dist.world_size"] == written["num_processes"]
    assert got["dist.ranks_per_node"] == written["num_processes"] // written["num_machines"]
    assert got["dist.offload_param"] == "cpu" and got["dist.reshard_after_forward"] is True
    # accelerate 1.16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over fp32 master weights
    assert (got["dist.mp_param_dtype"], got["dist.mp_reduce_dtype"], got["train.param_dtype"]) == \
        ("bfloat16", "bfloat16", "float32")
    assert got["train.grad_ckpt.lm"] is True  # fsdp_activation_checkpointing


def test_deepspeed_json_becomes_its_stage_and_path():
    recipe = read_recipe_file(DATA / "ds_z3_config.json")
    assert (recipe.kind, recipe.recipe) == ("deepspeed", "none")
    assert recipe.overrides() == {"dist": "zero3", "dist.deepspeed_config": str(DATA / "ds_z3_config.json")}
    assert {i.key for i in recipe.ignored} >= {"train_micro_batch_size_per_gpu", "bf16"}  # "auto": the trainer's


@pytest.mark.parametrize("name", ["llamafactory_qwen2_5vl_lora_sft.yaml", "swift_sft_qwen2_5vl.sh", "swift_args.json",
                                  "trl_sft_qwen2_5vl.yaml", "trl_grpo_qwen2_5vl.yaml", "accelerate_fsdp2.yaml",
                                  "ds_z3_config.json"])
def test_mapping_lines_name_every_key_and_every_setting_exists_in_conf(name):
    text = (DATA / name).read_text()
    if name.endswith(".sh"):
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
        keys = [t for t in tokens if t.startswith("--")] + [t.split("=")[0] for t in tokens if "=" in t]
    else:
        keys = list(yaml.safe_load(text))
    recipe = read_recipe_file(DATA / name)
    lines = mapping_lines(recipe)
    assert len(lines) == len(recipe.mapped) + len({i.why for i in recipe.ignored})  # ignored keys: a line per reason
    ignored = {k for line in lines if line.startswith("ignored: ")
               for k in line.removeprefix("ignored: ").split(" (", 1)[0].split(", ")}
    for key in keys if name != "ds_z3_config.json" else [k for k in keys if k != "zero_optimization"] + ["(file)"]:
        assert any(line.startswith((f"{key}: ", f"{key}.")) for line in lines) or key in ignored or any(
            k.startswith(f"{key}.") for k in ignored), key
    conf = REPO / "conf"
    sections = {s: yaml.safe_load((conf / s / "default.yaml").read_text()) for s in ("train", "data")}
    steps = {p.stem: yaml.safe_load(p.read_text()) for p in (conf / "step").glob("*.yaml")}
    dists = {p.stem: yaml.safe_load(p.read_text()) for p in (conf / "dist").glob("*.yaml")}
    model = yaml.safe_load((conf / "model" / "qwen2_5_vl_7b.yaml").read_text())
    for setting, value in recipe.overrides().items():
        group, _, rest = setting.partition(".")
        if not rest:
            assert shipped_option(value) if group == "model" else (conf / group / f"{value}.yaml").is_file(), setting
        elif group in sections:
            node = sections[group]
            for part in rest.split("."):
                node = node[part]  # a KeyError names a setting the config does not have
        elif group == "step":
            assert any(rest in options for options in steps.values()), setting
        elif group == "dist":
            assert any(rest in options for options in dists.values()), setting
        else:
            assert group == "model" and rest in model, setting


def test_detect_kind_tells_the_kinds_apart_by_their_keys():
    assert detect_kind({"num_generations": 8, "per_device_train_batch_size": 1}) == "trl_grpo"
    assert detect_kind({"precompute_ref_log_probs": False, "beta": 0.1}) == "trl_dpo"
    assert detect_kind({"per_device_train_batch_size": 1, "output_dir": "x"}) == "hf_trainer"
    assert detect_kind({"cutoff_len": 1024}) == "llamafactory"
    assert detect_kind({"distributed_type": "MULTI_GPU", "num_processes": 2}) == "accelerate"
    assert detect_kind({"name": "x"}) is None


def test_an_explicit_kind_reads_a_plain_trainer_file_and_the_last_key_wins(tmp_path):
    file = tmp_path / "args.json"
    file.write_text(json.dumps({"per_device_train_batch_size": 2, "bf16": False, "fp16": True, "optim": "adamw_torch",
                                "gradient_accumulation_steps": 4, "max_seq_length": 512}))
    got = read_recipe_file(file, "hf_trainer").overrides()
    assert got == {"data.batch_size": 2, "train.autocast_dtype": "float16", "optimizer": "adamw",
                   "train.grad_accum_steps": 4, "data.lm_max_length": 512}
    assert "bf16" in {i.key for i in read_recipe_file(file, "hf_trainer").ignored}  # fp16: true decides


BAD = [
    ("does_not_exist.yaml", "no such file"),
    ("bad_unknown_kind.yaml", "its kind cannot be told"),
    ("bad_yaml.yaml", "not YAML: line 4"),
    ("bad_json.json", "not JSON: line 5"),
    ("bad_value_finetuning_type.yaml", "finetuning_type='freeze' is not allowed: vlmprobe models lora and full"),
    ("training_args.bin", "pickle"),
]


@pytest.mark.parametrize(("name", "says"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_naming_the_value_and_what_is_allowed(name, says):
    with pytest.raises(ConfigError) as caught:
        read_recipe_file(DATA / name)
    message = str(caught.value)
    assert says in message and "\n" not in message
    assert name in message
    if name == "training_args.bin":
        assert "to_json_string" in message  # how to give it instead
    if name == "bad_unknown_kind.yaml":
        assert all(kind in message for kind in KINDS)


def test_unknown_kind_and_unmappable_values_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="recipe.kind='axolotl' is not allowed: use one of llamafactory"):
        read_recipe_file(DATA / "trl_sft_qwen2_5vl.yaml", "axolotl")
    file = tmp_path / "fsdp1.yaml"
    file.write_text("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 1\n")
    with pytest.raises(ConfigError, match="fsdp_version=1 is not allowed: vlmprobe models FSDP2"):
        read_recipe_file(file)
    file.write_text("swift sft --model Qwen/Qwen2.5-VL-7B-Instruct --deepspeed zero9\n")
    with pytest.raises(ConfigError, match="--deepspeed='zero9' is not allowed: no such DeepSpeed JSON.*zero2_offload"):
        read_recipe_file(file, "ms_swift")
    file.write_text("model_name_or_path: x/y\noptim: lion_32bit\nper_device_train_batch_size: 1\n")
    with pytest.raises(ConfigError, match="optim='lion_32bit' is not allowed: vlmprobe models the optimizers "):
        read_recipe_file(file)


def test_swift_ranks_without_deepspeed_are_ddp_with_non_reentrant_checkpointing(tmp_path):
    """mixin.py _fix_gradient_checkpointing: use_reentrant False under plain DDP; NPROC_PER_NODE x NNODES ranks."""
    file = tmp_path / "train.sh"
    file.write_text("NNODES=2 NPROC_PER_NODE=4 swift sft --model Qwen/Qwen2-VL-2B-Instruct --tuner_type full "
                    "--freeze_vit false --target_modules q_proj v_proj --quant_bits 4 > log.txt\n")
    recipe = read_recipe_file(file)
    got = recipe.overrides()
    assert (got["dist"], got["dist.world_size"], got["dist.ranks_per_node"]) == ("ddp", 8, 4)
    assert got["train.grad_ckpt_reentrant"] is False and got["train.freeze_vision"] is False
    assert got["train.lora_r"] == 0 and "train.lora_target_modules" not in got  # full: target_modules not read
    assert got["train.quantization"] == "nf4"
    assert "log.txt" not in " ".join(mapping_lines(recipe))  # the shell's redirection ends the command


@pytest.mark.slow
def test_all_linear_names_are_the_real_qwen2_5_vl_classes_linear_layers():
    """LLaMA-Factory's `all` rule (misc.py find_all_linear_modules: every Linear's last name but lm_head, the merger
    and, frozen, the vision blocks) run on transformers' own Qwen2_5_VLForConditionalGeneration (meta device)."""
    import torch
    from torch import nn
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vlmprobe.recipes.common import ALL_LINEAR_LM, VISION_LINEAR

    config = Qwen2_5_VLConfig(text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
                              vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                             "out_hidden_size": 64})
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)

    def linear_names(forbidden: tuple[str, ...]) -> set[str]:
        return {name.split(".")[-1] for name, module in model.named_modules()
                if isinstance(module, nn.Linear) and not any(f in name for f in forbidden)}

    assert linear_names(("lm_head", "visual.merger", "visual.patch_embed", "visual.blocks")) == set(ALL_LINEAR_LM)
    assert linear_names(("lm_head", "visual.merger")) <= set(ALL_LINEAR_LM + VISION_LINEAR)


def test_a_llamafactory_lora_target_list_reads_as_the_comma_string_does(tmp_path):
    texts = {"comma": "lora_target: q_proj,v_proj\n", "list": "lora_target: [q_proj, v_proj]\n"}
    read = {}
    for name, target in texts.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text("model_name_or_path: Qwen/Qwen2.5-VL-7B-Instruct\nstage: sft\nfinetuning_type: lora\n" + target)
        read[name] = read_recipe_file(path).overrides()["train.lora_target_modules"]
    assert read["comma"] == read["list"] == ["q_proj", "v_proj"]


def test_an_unquoted_no_in_an_accelerate_config_is_one_process_and_a_missing_deepspeed_file_is_named(tmp_path):
    file = tmp_path / "accelerate.yaml"
    file.write_text("distributed_type: NO\nmixed_precision: bf16\nnum_processes: 1\n")  # YAML 1.1 reads NO as false
    assert yaml.safe_load(file.read_text())["distributed_type"] is False
    assert ("dist", "none") in [(m.setting, m.becomes) for m in read_recipe_file(file).mapped]
    file = tmp_path / "llamafactory.yaml"
    file.write_text("model_name_or_path: x/y\nstage: sft\nfinetuning_type: lora\ndeepspeed: missing_ds.json\n")
    with pytest.raises(ConfigError, match=r"^recipe.file=\S*/llamafactory.yaml: deepspeed='missing_ds.json' is not allowed"):
        read_recipe_file(file)
