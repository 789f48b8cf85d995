"""The web form's fields, and how each becomes one command-line override: the only way a value from the web
reaches the config.

The rule: a field is known (FIELDS), its value is checked against an allow-list or a type (a group's options as
conf/ holds them, a Hub id as vlmprobe.hub.HUB_NAME reads one, a whole number in a range, a choice) and then
written by this module as `key=value`; nothing else from the web reaches Hydra: no `_target_`, no interpolation
(`${...}` matches no allow-list), no list or sweep (no comma, no bracket), no other key. An empty field is left
out (the config's default). A refusal is one ConfigError line in the command line's words. The values that pass
may still be refused by the command's own checks (vlmprobe.config.checks), whose one line the page then shows.
Known limits: the form covers the common knobs, not every config key; the command line takes the rest.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from urllib.parse import urlencode

from vlmprobe.errors import ConfigError
from vlmprobe.hub import HUB_NAME
from vlmprobe.paths import CONF

__all__ = ["FIELDS", "Field", "QUESTIONS", "Question", "command_line", "group_options", "question_of", "url_of"]

MAX_TEXT = 200  # characters of a field's value


def group_options(group: str) -> tuple[str, ...]:
    """A config group's options as conf/ holds them (model=hf needs a config file: the form takes a Hub id instead)."""
    return tuple(sorted(p.stem for p in (CONF / group).glob("*.yaml") if not (group == "model" and p.stem == "hf")))


@dataclass(frozen=True)
class Field:
    name: str  # the form's field name: the override's key
    label: str
    kind: str  # group | model | int | choice
    choices: tuple[str, ...] = ()  # group, choice: the values allowed ("null" for none)
    minimum: int = 0  # int
    maximum: int = 10**9
    section: str = "setup"

    def override(self, raw) -> str | None:
        """`key=value` for this field's value, None for an empty one; ConfigError (one line) for a value that is
        not allowed."""
        if raw is None:
            return None
        if not isinstance(raw, (str, int)) or isinstance(raw, bool):
            raise ConfigError(f"{self.name}={raw!r} is not allowed: give it as text")
        value = str(raw).strip()
        if not value:
            return None
        if len(value) > MAX_TEXT:
            raise ConfigError(f"{self.name}={value[:40]!r}... is not allowed: at most {MAX_TEXT} characters")
        if self.kind in ("group", "choice"):
            if value not in self.choices:
                raise ConfigError(f"{self.name}={value!r} is not allowed: use one of {', '.join(self.choices)}")
        elif self.kind == "model":
            if value not in self.choices and not HUB_NAME.match(value):
                raise ConfigError(f"model={value!r} is not allowed: use one of the shipped models "
                                  f"({', '.join(self.choices)}) or a Hugging Face Hub id (ORG/NAME)")
        elif self.kind == "int":
            if not value.isdigit() or not self.minimum <= int(value) <= self.maximum:
                raise ConfigError(f"{self.name}={value!r} is not allowed: give a whole number from {self.minimum} "
                                  f"to {self.maximum:,}")
            value = str(int(value))
        return f"{self.name}={value}"


BOOL = ("true", "false")
FIELDS = [
    Field("model", "model (a shipped name or a Hub id)", "model", group_options("model"), section="question"),
    Field("device", "card", "group", group_options("device"), section="question"),
    Field("recipe", "framework recipe (its defaults under the fields below)", "group", group_options("recipe")),
    Field("step", "step", "group", group_options("step")),
    Field("dist", "engine", "group", group_options("dist")),
    Field("dist.world_size", "GPUs (ranks)", "int", minimum=1, maximum=4096),
    Field("optimizer", "optimizer", "group", group_options("optimizer")),
    Field("data.batch_size", "batch size", "int", minimum=1, maximum=65536, section="data"),
    Field("data.lm_max_length", "tokens per sample", "int", minimum=1, maximum=10**7, section="data"),
    Field("data.image_size", "image side (px)", "int", minimum=1, maximum=100000, section="data"),
    Field("data.images_per_sample", "images per sample", "int", minimum=0, maximum=1024, section="data"),
    Field("data.max_pixels", "max pixels per image", "int", minimum=1, maximum=10**9, section="data"),
    Field("train.param_dtype", "weights dtype", "choice", ("float32", "bfloat16", "float16")),
    Field("train.autocast_dtype", "autocast", "choice", ("bfloat16", "float16", "null")),
    Field("train.grad_ckpt.lm", "checkpoint the LM", "choice", BOOL),
    Field("train.grad_ckpt.vision", "checkpoint the vision tower", "choice", BOOL),
    Field("train.freeze_vision", "freeze the vision tower", "choice", BOOL),
    Field("train.freeze_lm", "freeze the LM", "choice", BOOL),
    Field("train.lora_r", "LoRA rank (0: none)", "int", minimum=0, maximum=65536),
    Field("train.quantization", "4/8-bit base", "choice", ("null", "nf4", "int8")),
    Field("train.grad_accum_steps", "accumulation steps", "int", minimum=1, maximum=65536),
    Field("train.liger_kernel", "Liger kernels", "choice", BOOL),
]
BY_NAME = {f.name: f for f in FIELDS}


@dataclass(frozen=True)
class Question:
    overrides: tuple[str, ...]  # what vlmprobe.api.run takes, positional
    values: dict  # the form's non-empty values, checked: what the page's URL carries
    advise: bool


ASKS = ("check", "advise")  # the question field: does it fit (vlmprobe.api.run), which knob helps (advise)
QUESTIONS = {"check": "does it fit? (the verdict and its breakdown)", "advise": "which knob makes it fit? (ranked)"}


def question_of(form: dict) -> Question:
    """The form's values as the command's overrides; ConfigError (one line) for an unknown field or a value that
    is not allowed, before anything runs."""
    if not isinstance(form, dict):
        raise ConfigError("the form is not allowed: send its fields as a JSON object of field names to text")
    unknown = sorted(str(k) for k in form if k not in BY_NAME and k != "ask")
    if unknown:
        raise ConfigError(f"{unknown[0][:60]} is not allowed: the form takes ask, {', '.join(BY_NAME)}")
    ask = form.get("ask") or "check"
    if ask not in ASKS:
        raise ConfigError(f"ask={str(ask)[:60]!r} is not allowed: use one of {', '.join(ASKS)}")
    overrides, values = [], {}
    for field in FIELDS:
        override = field.override(form.get(field.name))
        if override is not None:
            overrides.append(override)
            values[field.name] = override.split("=", 1)[1]
    if "model" not in values:
        raise ConfigError("model is not allowed empty: use one of the shipped models or a Hub id (ORG/NAME)")
    advise = ask == "advise"
    if advise:
        values = {"ask": "advise", **values}
    return Question(tuple((["+advise=fit"] if advise else []) + overrides), values, advise)


def command_line(question: Question) -> str:
    """The command that asks the same question in a terminal."""
    return " ".join(["vlmprobe", *(shlex.quote(o) for o in question.overrides)])


def url_of(question: Question, path: str = "/") -> str:
    """The page's URL with the form's values, asked again when opened (run=1)."""
    return f"{path}?{urlencode({**question.values, 'run': '1'})}"
