"""`python -m vlmprobe [+sweep=NAME] [overrides]`: plan every point, run them, write the tables.

Overrides are Hydra's (key=value; +key=value adds a key or a sweep axis). dry_run=true plans and validates
every point and runs and writes nothing; `--cfg job` prints the composed config. The answer (a table and a verdict
per point) goes to stdout, progress to stderr.

Exit codes: 0 the sweep ran (OOM points are results; fail_on_oom=true makes them 1); 1 every point failed for a reason other than memory,
or vlmprobe itself failed (one line, and a log file with the traceback); 2 bad input (one line on stderr,
before any point runs and before anything is written); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM):
one line saying how many rows are kept, where, and the command that resumes.
"""

from __future__ import annotations

import logging
import sys

from vlmprobe import interrupt
from vlmprobe.config.overrides import composing, with_config_dirs, with_hub_ids
from vlmprobe.config.recipes import apply_recipe
from vlmprobe.errors import ConfigError, WriteError, first_line, log_internal_error
from vlmprobe.paths import CONF

__all__ = ["main"]


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit code. Every failure is one line on stderr, never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = with_hub_ids(with_config_dirs(argv))
    except ConfigError as exc:
        say(f"vlmprobe: {exc}")
        return 2
    if any(a in ("-h", "--help") for a in argv):
        return show(help_text())
    if argv[:2] == ["--cfg", "job"] or argv[-2:] == ["--cfg", "job"]:  # Hydra's: the composed config, nothing run
        return show_config([a for i, a in enumerate(argv) if a != "--cfg" and not (a == "job" and argv[i - 1] == "--cfg")])
    state: dict = {"out_dir": None}  # where rows go, once there is such a place
    # A library's log call that cannot format its own message (transformers, given a strange setting) makes the
    # logging module print a traceback of its own; the setting's refusal is the line the user needs
    logging.raiseExceptions = False
    with interrupt.watching():
        try:
            return run_guarded(argv, state)
        except KeyboardInterrupt:
            # imported here: pandas reads the rows kept, and is not imported before the first point (see below)
            from vlmprobe.run.resume import interrupted_line

            say(interrupted_line(argv, state["out_dir"], interrupt.signal_name()))
            return interrupt.exit_code()


QUESTIONS = """Five questions, one command each (no GPU: the rows are estimates, and say so):
  Does my setup fit my card?        vlmprobe model=qwen2_5_vl_7b train.lora_r=16 train.freeze_vision=true \\
                                      train.param_dtype=bfloat16 train.autocast_dtype=null data.batch_size=4 \\
                                      data.lm_max_length=2048 device=rtx4090
  Where does memory go with length? vlmprobe +sweep=seq_len
  What is the largest batch?        vlmprobe model=qwen2_vl_2b +find=max_batch memory_budget=24GiB
  How do the families compare?      vlmprobe +sweep=families device=h100_80gb
  What does my training run need?   vlmprobe recipe.file=MY_TRAINING_FILE device=rtx4090   (or recipe=llamafactory;
                                      a reported setup: the preset_* sweeps below)
Add fail_on_oom=true to exit 1 when a point does not fit; output=json for the rows as JSON lines on stdout."""


def help_text() -> str:
    """The docstring, the five questions, and each config group's options (conf/<group>/*.yaml)."""
    lines = [__doc__.strip(), "", QUESTIONS, "", "Config groups (group=OPTION; `--cfg job` prints the composed config):"]
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        options = sorted(p.stem for p in group.glob("*.yaml"))
        prefix = "+" if group.name in ("sweep", "find") else ""
        lines.append(f"  {prefix}{group.name}: {', '.join(options)}")
    return "\n".join(lines)


def show(text: str) -> int:
    """`text` on stdout; a reader that stops early (`| head`) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        sys.stdout = None
    return 0


def show_config(argv: list[str]) -> int:
    """`--cfg job`: the command line's composed config as YAML, each override checked as a run checks it."""
    try:
        with composing() as compose:
            applied = apply_recipe(compose, argv)
    except ConfigError as exc:
        say(f"vlmprobe: {exc}")
        return 2
    for line in applied.lines:
        say(line)
    cfg = applied.cfg
    from omegaconf import OmegaConf

    return show(OmegaConf.to_yaml(cfg).rstrip())


def run_guarded(argv: list[str], state: dict) -> int:
    """The command, its failures turned into exit codes: bad input 2 (one line), vlmprobe's own fault 1 (one line
    and a log file holding the traceback)."""
    if not CONF.is_dir():
        say(f"vlmprobe: config directory {CONF} not found; install from a checkout with `pip install -e .`")
        return 2
    try:
        with composing() as compose:
            applied = apply_recipe(compose, argv)  # a bad override is refused before torch is imported
            for line in applied.lines:
                say(line)
            with interrupt.deferred():
                # imported here, after the command line is known to be good, and with a Ctrl-C deferred: torch's,
                # transformers' and pandas' native start-up code crashes the process when interrupted inside
                from vlmprobe.run import command
            return command.run(applied.cfg, applied.argv, compose, state)
    except ConfigError as exc:
        if interrupt.received():  # a library failed because Ctrl-C struck inside it
            raise KeyboardInterrupt from None
        say(f"vlmprobe: {exc}")
        return 2
    except WriteError as exc:  # a full disk, a read-only folder: the file and the system's error, no traceback
        say(f"vlmprobe: {exc}")
        return 1
    except Exception as exc:
        if interrupt.received():
            raise KeyboardInterrupt from None
        log = log_internal_error(exc, state["out_dir"])
        say(f"vlmprobe: internal error, not a problem with your input ({type(exc).__name__}: "
            f"{first_line(exc)}); the traceback is in {log}")
        return 1
