"""Every bad input of issue 9 is one line naming the value and what is allowed (exit 2), before any point
runs and before anything is written; an internal failure is one line and a log file. In-process through
vlmprobe.cli.main (the CLI's own entry); test_cli.py runs a few of the same through a subprocess."""

import re
from pathlib import Path

import pandas as pd
import pytest

from vlmprobe.cli import main
from vlmprobe.run.resume import check_resume


QLORA = ["model=qwen2_vl_tiny", "train.lora_r=4", "measure.backend=estimate"]
GRPO = ["model=qwen2_5_vl_tiny", "step=grpo", "data.batch_size=4", "measure.backend=estimate"]
BAD_INPUT = {
    "negative lr": (["model=nanovlm_tiny", "optimizer.lr=-1"],
                    "optimizer.lr=-1 is not allowed: torch.optim.AdamW refuses it: Invalid learning rate: -1"),
    "betas not a key of the option": (["model=nanovlm_tiny", "optimizer.betas=[2,3]"],
                                      "optimizer.betas=[2,3] is not allowed: optimizer has no key 'betas' (keys there: "
                                      "foreach, fused, lr); to pass it to torch.optim.AdamW, add it: +optimizer.betas=[2,3]"),
    "betas torch refuses": (["model=nanovlm_tiny", "+optimizer.betas=[2,3]"],
                            "is not allowed: torch.optim.AdamW refuses it: Invalid beta parameter at index 0: 2"),
    "unknown top-level key": (["model=nanovlm_tiny", "nosuchkey=1"],
                              "nosuchkey=1 is not allowed: 'nosuchkey' is not a config key (keys there: advise, data, "),
    "unknown data key": (["model=nanovlm_tiny", "data.nosuch=1"],
                         "data.nosuch=1 is not allowed: data has no key 'nosuch' (keys there: batch_size, "),
    "axis without a sweep": (["model=nanovlm_tiny", "sweep.axes.data.batch_size=[1,2]"],
                             "sweep.axes.data.batch_size=[1,2] is not allowed: data.batch_size is not an axis of this "
                             "sweep; add it as a new axis with +sweep.axes.data.batch_size=[1,2]"),
    "an axis given in a dict": (["sweep.axes={model:[nanovlm_tiny,qwen2_vl_tiny]}"],
                                "sweep.axes={model:[nanovlm_tiny,qwen2_vl_tiny]} is not allowed: model is not an axis "
                                "of this sweep; add it as a new axis with +sweep.axes={model:[nanovlm_tiny,qwen2_vl_tiny]}"),
    "a key given in a dict": (["train.grad_ckpt={lm:true,nosuch:1}"],
                              "train.grad_ckpt={lm:true,nosuch:1} is not allowed: train.grad_ckpt has no key 'nosuch' "
                              "(keys there: lm, offload, vision)"),
    "negative timeout": (["model=nanovlm_tiny", "measure.timeout_s=-1"],
                         "measure.timeout_s=-1 is not allowed: give seconds > 0, or null for no limit"),
    "Qwen image below 28 px": (["model=qwen2_vl_2b", "data.image_size=3"],
                               "data.image_size=3 is not allowed for qwen2_vl_2b: a side must be at least 28 px"),
    "LoRA alpha peft cannot use": (["model=nanovlm_tiny", "train.lora_r=4", "train.lora_alpha=x"],
                                   "train.lora_alpha='x', train.lora_dropout=0.0, train.lora_target_modules=['q_proj', "
                                   "'k_proj', 'v_proj', 'o_proj', 'out_proj'] is not allowed: peft"),
    "LoRA names not a list": (["model=nanovlm_tiny", "train.lora_r=4", "train.lora_target_modules=q_proj"],
                              "train.lora_target_modules='q_proj' is not allowed: give a list of names, e.g. [q_proj, "
                              "v_proj]"),
    "model hyperparameter its constructor refuses": (["model=nanovlm_tiny", "model.text.hidden_size=-8"],
                                                     "model=nanovlm_tiny with its settings is not allowed: NanoVLMSpec"),
    "an axis value that is not a group option": (["+sweep=smoke", "+sweep.axes.model=[nanovlm_tiny,nope]"],
                                                 "model='nope' is not allowed: use one of deepseek_vl2_small, deepseek_vl2_tiny, deepseek_vl2_toy, gemma3_4b, gemma3_tiny, glm4_1v_9b, glm4_5v, glm4v_moe_tiny, glm4v_tiny, hf, idefics3_tiny"),
    "a flag": (["--cfg", "hydra"], "--cfg is not allowed: vlmprobe takes only overrides"),
    "unparsable": (["data.batch_size=[1,"], "data.batch_size=[1, is not allowed: Hydra cannot parse it"),
    "removing a key vlmprobe reads": (["~data"], "~data is not allowed: vlmprobe reads every config key"),
    "adding a key that exists": (["+data.batch_size=2"], "+data.batch_size=2 is not allowed: data.batch_size is "
                                                          "already a config key; set it without the +: data.batch_size=2"),
    "dry_run not a bool": (["dry_run=maybe"], "dry_run='maybe' is not allowed: use true or false"),
    # issue 54: byte sizes by one grammar, fractions of a byte refused; each axis value once; interpolations
    "a size of two decimal points": (["measure.device_memory=1.2.3"], "measure.device_memory='1.2.3' is not "
                                     "allowed: give bytes or a size like 24GiB (a number, then B, KiB, MiB, GiB or TiB)"),
    "half a byte": (["measure.device_memory=0.5"], "measure.device_memory=0.5 is not allowed: it is 0.5 bytes, not a "
                                                   "whole number of bytes; give 1 or more"),
    "a fraction of a byte in GiB": (["memory_budget=0.1GiB"], "memory_budget='0.1GiB' is not allowed: it is "
                                                              "107374182.4 bytes, not a whole number of bytes; give "
                                                              "107374182 or 107374183"),
    "a key added with + that nothing reads": (["model=nanovlm_tiny", "+model.text.hidden_sise=4096"],
                                              "+model.text.hidden_sise=4096 is not allowed: model.text has no key "
                                              "'hidden_sise', and vlmprobe would never read it; did you mean "
                                              "model.text.hidden_size? (keys there: hidden_size, "),
    "a key added with + under the vision tower": (["model=nanovlm_tiny", "+model.vision.nosuch=1"],
                                                  "+model.vision.nosuch=1 is not allowed: model.vision has no key "
                                                  "'nosuch', and vlmprobe would never read it (keys there: "),
    "a top-level key added with +": (["+nosuch=1"], "+nosuch=1 is not allowed: 'nosuch' is not a config key, and "
                                                    "vlmprobe would never read it (keys there: advise, data, device, "),
    "a tower a million layers deep": (["model=nanovlm_tiny", "model.text.num_hidden_layers=1000000"],
                                      "model.text.num_hidden_layers=1000000 is not allowed: vlmprobe builds at most 256 "
                                      "layers a tower (the deepest published VLM towers have 100 or fewer); give at "
                                      "most 256"),
    "an axis value twice": (["+sweep=smoke", "sweep.axes.data.batch_size=[1,1,2]"],
                            "sweep.axes.data.batch_size=[1, 1, 2] is not allowed: 1 is given twice; give each value "
                            "once"),
    "an environment variable that is not set": (["data.batch_size=${oc.env:VLMPROBE_NOT_SET}"],
                                                 "data.batch_size=${oc.env:VLMPROBE_NOT_SET} is not allowed: it does "
                                                 "not resolve (KeyError raised while resolving interpolation: "
                                                 "\"Environment variable 'VLMPROBE_NOT_SET' not found\")"),
    "max_points not positive": (["sweep.max_points=0"], "sweep.max_points=0 is not allowed: it must be a positive integer"),
    "alloc_conf not text": (["measure.alloc_conf=[1]"], "measure.alloc_conf=[1] is not allowed"),
    # allocator settings, by torch's own parser rules (issue 12)
    "alloc_conf key torch does not know": (["measure.alloc_conf=max_split_mb:128"],
                                           "measure.alloc_conf='max_split_mb:128' is not allowed: unrecognized key "
                                           "'max_split_mb' (torch's CUDA allocator knows backend, "),
    "alloc_conf bool not capitalised": (["measure.alloc_conf=expandable_segments:true"],
                                        "measure.alloc_conf='expandable_segments:true' is not allowed: "
                                        "expandable_segments takes True or False (capitalised), got 'true'"),
    "alloc_conf split size below 20 MB": (["measure.alloc_conf=max_split_size_mb:10"],
                                          "measure.alloc_conf='max_split_size_mb:10' is not allowed: max_split_size_mb "
                                          "must be >= 20, got 10"),
    "alloc_conf threshold outside (0, 1)": (["measure.alloc_conf=garbage_collection_threshold:1.5"],
                                            "garbage_collection_threshold must be in (0.0, 1.0), got 1.5"),
    "resume of no dir": (["resume=/nonexistent/dir"], "resume=/nonexistent/dir is not allowed: it is not a directory"),
    # the first bad inputs the command refused (before issue 9)
    "unknown sweep": (["+sweep=nope"], "sweep='nope' is not allowed: use one of"),
    "sweep without +": (["sweep=smoke"], "sweep=smoke is not allowed: a sweep is added to the config, write +sweep=smoke"),
    "batch size 0": (["data.batch_size=0"], "data.batch_size=0 is not allowed: it must be a positive integer"),
    "too short for the image": (["data.lm_max_length=40"], "data.lm_max_length=40 is too short for nanovlm_222m: the images take 49 tokens"),
    "pixels out of range": (["data.image_size=300"], "data.image_size=300 is not allowed for nanovlm_222m"),
    "axis not a config key": (["+sweep=smoke", "+sweep.axes.data.nope=[1,2]"], "sweep axis 'data.nope' is not allowed: it is not a key of the config"),
    "case key its group lacks": (["+sweep=smoke", "+sweep.cases=[{dist: zero3, dist.nope: 1}]"],
                                 "dist.nope=1 is not allowed: dist has no key 'nope'"),
    "cuda without a GPU": (["measure.backend=cuda"], "measure.backend=cuda is not allowed here: no CUDA GPU is visible"),
    "unknown backend": (["measure.backend=tpu"], "measure.backend='tpu' is not allowed: use one of auto, cuda, cpu, estimate"),
    # the target card (issue 12): an unknown one names the profiles; what the card cannot do is refused
    "unknown device": (["device=rtx9090"], "device='rtx9090' is not allowed: use one of a100_40gb, a100_80gb, "
                                           "a10g, b200, h100_80gb, h20, h200, l4, l40s, none, rtx3090, rtx4090, "
                                           "rtx5090, rtx_a6000, t4, v100_32gb"),
    "unknown device as an axis": (["+sweep=smoke", "+sweep.axes.device=[rtx3090,tpu]"],
                                  "device='tpu' is not allowed: use one of a100_40gb"),
    "bf16 on a card without it": (["model=nanovlm_tiny", "device=v100_32gb"],
                                  "train.autocast_dtype=bfloat16 is not allowed with device=v100_32gb: the Tesla "
                                  "V100-SXM2-32GB (sm70) has no bfloat16 kernels (they need sm80+); use float16 or float32"),
    "bf16 weights on a card without it": (["model=nanovlm_tiny", "device=v100_32gb", "train.param_dtype=bfloat16",
                                           "train.autocast_dtype=null"],
                                          "train.param_dtype=bfloat16 is not allowed with device=v100_32gb"),
    "device_memory above the card": (["model=nanovlm_tiny", "device=rtx3090", "measure.device_memory=32GiB"],
                                     "measure.device_memory=34359738368 is not allowed with device=rtx3090: the NVIDIA "
                                     "GeForce RTX 3090 has 25,438,126,080 B (23.69 GiB)"),
    "max-batch budget above the card": (["+find=max_batch", "device=rtx3090", "memory_budget=32GiB"],
                                        "memory_budget=32GiB is not allowed with device=rtx3090: the NVIDIA GeForce "
                                        "RTX 3090 has 25,438,126,080 B"),
    "a profile value its builder refuses": (["model=nanovlm_tiny", "device=rtx3090", "device.compute_capability=sm86"],
                                            "device.compute_capability='sm86' is not allowed: give major.minor"),
    # launchers (issue 14)
    "pool of no jobs": (["launcher=pool", "launcher.jobs=0"], "launcher.jobs=0 is not allowed: give an integer >= 1"),
    "pool of negative jobs": (["launcher=pool", "launcher.jobs=-1"], "launcher.jobs=-1 is not allowed: give an integer >= 1"),
    "pool jobs not a number": (["launcher=pool", "launcher.jobs=x"], "launcher.jobs='x' is not allowed: give an integer >= 1"),
    "auto of no jobs": (["launcher=auto", "launcher.jobs=0"], "launcher.jobs=0 is not allowed: give an integer >= 1"),
    "unknown launcher": (["launcher=slurm"], "launcher='slurm' is not allowed: use one of auto, local, pool, submitit"),
    "submitit off a SLURM cluster": (["launcher=submitit"], 'launcher.cluster=slurm is not allowed here: submitit says: '
                                                          'Could not detect "srun"'),
    "a parameter submitit rejects": (["launcher=submitit", "launcher.cluster=local", "+launcher.parameters.slurm_partitio=gpu"],
                                     "is not allowed: submitit says: Unknown argument 'partitio' for executor 'slurm'"),
    "a parameter of the wrong type": (["launcher=submitit", "launcher.cluster=local", "launcher.parameters.timeout_min=1.5"],
                                      'submitit says: Parameter "timeout_min" expected type'),
    "an unknown submitit cluster": (["launcher=submitit", "launcher.cluster=slurmm"],
                                    "launcher.cluster='slurmm' is not allowed: use slurm"),
    "no points per job": (["launcher=submitit", "launcher.cluster=local", "launcher.points_per_job=0"],
                          "launcher.points_per_job=0 is not allowed: give an integer >= 1"),
    "pool on cuda without a GPU": (["launcher=pool", "measure.backend=cuda"],
                                   "measure.backend=cuda is not allowed here: no CUDA GPU is visible"),
    "GRPO with one generation": (GRPO + ["step.num_generations=1"],
                                 "step.num_generations=1 is not allowed: TRL's GRPOConfig requires at least 2"),
    "GRPO batch of partial groups": (GRPO + ["data.batch_size=3"],
                                     "step.num_generations=4 is not allowed with data.batch_size=3 "
                                     "(per_device_train_batch_size), train.grad_accum_steps=1 and step.num_processes=1: "
                                     "TRL's GRPOConfig says \"generation_batch_size (3) must be divisible by "
                                     "num_generations (4)\""),
    "GRPO without completion": (GRPO + ["step.max_completion_length=0"],
                                "step.max_completion_length=0 is not allowed: it must be an integer >= 1"),
    "GRPO negative beta": (GRPO + ["step.beta=-0.1"], "step.beta=-0.1 is not allowed: the KL coefficient must be a "
                                                      "number >= 0"),
    "GRPO with colocated vLLM": (GRPO + ["step.use_vllm=true", "step.vllm_mode=colocate"],
                                 "step.vllm_mode=colocate is not allowed (backend estimate): colocated vLLM shares the "
                                 "training GPU through its own allocator"),
    "GRPO with a model that cannot generate": (["model=nanovlm_tiny", "step=grpo", "data.batch_size=4"],
                                               "step=grpo is not allowed with model=nanovlm_tiny: NanoVLMSpec cannot "
                                               "generate here"),
    "GRPO processes other than the ranks": (GRPO + ["dist=fsdp2", "dist.world_size=4", "step.num_processes=2"],
                                            "step.num_processes=2 is not allowed with dist.world_size=4: a sharded "
                                            "point's processes are its ranks"),
    "GRPO ranks that split a group": (GRPO + ["dist=fsdp2", "data.batch_size=1", "dist.world_size=2"],
                                      "step.num_generations=4 is not allowed with data.batch_size=1 "
                                      "(per_device_train_batch_size), train.grad_accum_steps=1 and "
                                      "step.num_processes=2"),
    "quantization unknown": (QLORA + ["train.quantization=fp8"],
                             "train.quantization='fp8' is not allowed: use nf4, int8 or null"),
    "LoRA on an unknown tower": (["train.lora_r=4", "train.lora_towers=[lm,audio]"],
                                 "train.lora_towers=['lm', 'audio'] is not allowed: give a list of distinct towers from "
                                 "lm and vision"),
    "LoRA on a frozen tower": (["train.lora_r=4", "train.lora_towers=[lm,vision]", "train.freeze_vision=true"],
                               "train.freeze_vision=true is not allowed with train.lora_towers containing vision"),
    "quantization without LoRA": (["model=qwen2_vl_tiny", "train.quantization=nf4"],
                                  "train.quantization=nf4 is not allowed with train.lora_r=0: QLoRA trains LoRA adapters "
                                  "on a frozen quantized base; set train.lora_r"),
    "quantization sharded": (QLORA + ["train.quantization=nf4", "dist=fsdp2"],
                             "train.quantization=nf4 is not allowed with dist=fsdp2"),
    "quantization compute dtype": (QLORA + ["train.quantization=nf4", "train.quantization_compute_dtype=int4"],
                                   "train.quantization_compute_dtype='int4' is not allowed: use one of bfloat16, "
                                   "float16, float32"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_naming_the_value_and_nothing_is_written(cli, tmp_path, case):
    import torch

    if case in ("cuda without a GPU", "pool on cuda without a GPU") and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    args, message = BAD_INPUT[case]
    code, lines = cli(args)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("vlmprobe: ") and message in lines[0], lines
    assert not (tmp_path / "r").exists()


def test_quantization_without_bitsandbytes_where_it_runs_says_how_to_install(cli, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    code, lines = cli(["model=qwen2_vl_tiny", "train.lora_r=4", "train.quantization=int8", "measure.backend=cpu"])
    assert code == 2 and len(lines) == 1
    assert 'train.quantization=int8 on backend cpu needs bitsandbytes, not installed here: pip install -e ".[quant]"' in lines[0]
    assert not (tmp_path / "r").exists()


def test_results_dir_that_is_a_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "taken"
    target.write_text("x")
    assert main(["model=nanovlm_tiny", f"results_dir={target}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"vlmprobe: results_dir={target} is not allowed: {target} is a file, not a directory; give a "
                    f"directory (it is made if missing)")
    assert target.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_grid_above_max_points_is_refused_with_its_size_and_time(cli, tmp_path):
    code, lines = cli(["+sweep=smoke", "sweep.max_points=3", "measure.steps=1", "measure.backend=estimate"])
    assert code == 2 and len(lines) == 2
    assert lines[0] == "vlmprobe: this sweep has 4 points, more than sweep.max_points=3: timing one point to say how long they would take"
    assert lines[1].startswith("vlmprobe: this sweep has 4 points, more than sweep.max_points=3: raise it "
                               "(sweep.max_points=4) to run them; one point took ")
    assert re.search(r"one point took \d+\.\d s here, so all would take about \d+ s$", lines[1]), lines[1]
    assert not (tmp_path / "r").exists()
    code, lines = cli(["+sweep=smoke", "sweep.max_points=4", "dry_run=true"])  # at the limit: allowed
    assert code == 0 and lines[-1].startswith("vlmprobe: dry run: 4 points planned and valid")
    code, lines = cli(["model=nanovlm_tiny", "dry_run=true"])  # a single point: one, not "1 points"
    assert code == 0 and lines[-1].startswith("vlmprobe: dry run: 1 point planned and valid")


def test_an_internal_error_is_one_line_and_a_log_with_the_traceback(cli, monkeypatch):
    import vlmprobe.run.command

    def broken(*args, **kwargs):
        raise RuntimeError("planner broke\nsecond line")

    monkeypatch.setattr(vlmprobe.run.command, "plan", broken)
    code, lines = cli(["model=nanovlm_tiny"])
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("vlmprobe: internal error, not a problem with your input (RuntimeError: planner broke); "
                               "the traceback is in ")
    log = Path(lines[0].rsplit(" ", 1)[1])
    text = log.read_text()
    log.unlink()
    assert "Traceback (most recent call last)" in text and "planner broke" in text


def test_null_and_text_axis_values_get_every_table_and_the_plot(cli, tmp_path):
    code, lines = cli(["model=nanovlm_tiny", "measure.steps=1",
                       '+sweep.axes.measure.alloc_conf=[null,"expandable_segments:True"]'])
    assert code == 0, lines
    (out,) = (tmp_path / "r" / "single").iterdir()
    for name in ("results.csv", "results.parquet", "summary.md", "plot.png"):
        assert (out / name).stat().st_size > 0, name
    assert len(pd.read_parquet(out / "results.parquet")) == 2
    summary = (out / "summary.md").read_text()
    assert "| null " in summary and "| expandable_segments:True " in summary


def test_resume_compares_only_what_decides_the_rows(tmp_path):
    from omegaconf import OmegaConf

    from vlmprobe.errors import ConfigError

    saved = {"results_dir": "results", "dry_run": False, "memory_budget": None,
             "sweep": {"name": "smoke", "axes": {"data": {"batch_size": [1, 2]}}, "max_points": 1000},
             "data": {"batch_size": 1}}
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    now = {**saved, "results_dir": "elsewhere", "resume": str(tmp_path),
           "sweep": {**saved["sweep"], "max_points": 5000}}
    check_resume(tmp_path, now)  # where the rows go and how many points are allowed decide no row
    with pytest.raises(ConfigError, match=r"differs in: data.batch_size, sweep.axes.data.batch_size\)"):
        check_resume(tmp_path, {**now, "data": {"batch_size": 2}, "sweep": {**now["sweep"], "axes": {"data": {"batch_size": [1]}}}})


def test_an_interrupt_between_making_the_dir_and_its_config_leaves_nothing_and_says_so(tmp_path):
    """The race CI met: Ctrl-C after the results dir is made but before its config.yaml is whole. The dir is
    removed (nothing in it to resume) and the line says nothing was written; once the config exists, the line
    names the dir and the resume command."""
    from vlmprobe.run.resume import interrupted_line

    made = tmp_path / "smoke" / "20261123-000000"
    made.mkdir(parents=True)
    (made / "config.partial.yaml").write_text("measure: {")
    assert interrupted_line(["+sweep=smoke"], made) == "vlmprobe: interrupted before any point ran; nothing was written"
    assert not made.exists()

    made.mkdir()
    (made / "config.yaml").write_text("{}\n")
    line = interrupted_line(["+sweep=smoke", "resume=old"], made)
    assert line == (f"vlmprobe: interrupted: 0 rows kept in {made / 'results.csv'}; "
                    f"resume with: python -m vlmprobe +sweep=smoke resume={made}")


def test_a_resumed_command_interrupted_before_reading_its_dir_names_that_dir_and_the_same_resume_command(tmp_path):
    # seen in CI's fault test: Ctrl-C during a resumed command's start-up (imports, composing), before its resume=
    # dir is known to the sweep; the rows in that dir are kept all the same
    from vlmprobe.run.resume import interrupted_line

    old = tmp_path / "smoke" / "20261123-000000"
    old.mkdir(parents=True)
    (old / "config.yaml").write_text("{}\n")
    (old / "results.csv").write_text("point_id,status\na,ok\n")
    line = interrupted_line(["+sweep=smoke", f"resume={old}"], None)
    assert line == (f"vlmprobe: interrupted: 1 rows kept in {old / 'results.csv'}; "
                    f"resume with: python -m vlmprobe +sweep=smoke resume={old}")
    assert interrupted_line(["+sweep=smoke", f"resume={tmp_path / 'none'}"], None) == (
        "vlmprobe: interrupted before any point ran; nothing was written")  # not a results dir: checked later
