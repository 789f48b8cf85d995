"""+advise=fit: which knob makes this point fit its card, and by how much.

Your point (the command line as given) and each knob that applies to it, one at a time on top of it, run with no
capacity (measure.device_memory=unbounded: a point that would not fit still shows its whole peak, so savings
compare); then the knobs that keep the training the same (checkpointing, accumulation at the same effective
batch, allocator and kernel settings), largest saving first, added one by one until what the card would show
(predicted_device_bytes) fits the card less the margin. Knobs that change the training (freezing, LoRA, 8-bit or
factored optimizer state, bf16 weights, 4-bit base, smaller images) are ranked beside them and tagged. A knob
the point cannot take is left out with its reason. Every run is a row of results.csv.
With dist= set the engines that shard more, the engine's host offload and twice the GPUs are knobs too.
Limits: the combination is greedy (largest saving first, one engine), not a search of every subset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vlmprobe.config.grid import Point
from vlmprobe.config.plan import Composer, PlannedPoint, plan_point
from vlmprobe.errors import ConfigError
from vlmprobe.gpu import device_profile
from vlmprobe.gpu.device_profile import UNBOUNDED
from vlmprobe.results.answer import gib, shown
from vlmprobe.sizes import GiB, margin_bytes, parse_bytes
from vlmprobe.states import Status

__all__ = ["Advisor", "Knob", "knobs"]


@dataclass(frozen=True)
class Knob:
    overrides: tuple[str, ...]  # what it sets, on top of the person's command line
    same_training: bool  # True: the same model trains on the same data to the same result (memory and time change)
    cost: str  # what it costs, in a few words
    group: str = ""  # knobs of one group are alternatives (one engine): the combination takes at most one of them

    @property
    def name(self) -> str:
        return " ".join(self.overrides)


def knobs(cfg: dict, inputs: dict, card) -> list[Knob]:
    """The knobs that apply to this point's resolved config `cfg` (its row's `inputs`, the target `card`)."""
    train, data, found = cfg["train"], cfg["data"], []
    ckpt = train["grad_ckpt"]
    if not ckpt["lm"]:
        found.append(Knob(("train.grad_ckpt.lm=true",), True, "recomputes the LM's forward in backward (slower step)"))
    if not ckpt["vision"] and not train["freeze_vision"]:
        found.append(Knob(("train.grad_ckpt.vision=true",), True, "recomputes the vision tower's forward in backward"))
    micro, accum = data["batch_size"], train["grad_accum_steps"]
    if micro > 1:
        found.append(Knob(("data.batch_size=1", f"train.grad_accum_steps={micro * accum}"), True,
                          f"the same effective batch of {micro * accum} in {micro * accum} micro steps (slower step)"))
    if not cfg["measure"].get("alloc_conf"):
        found.append(Knob(("measure.alloc_conf=expandable_segments:True",), True,
                          "allocator setting (PYTORCH_CUDA_ALLOC_CONF); less fragmentation"))
    target = str(cfg["optimizer"].get("_target_", ""))
    if target.endswith("AdamW") and cfg["optimizer"].get("foreach") is not False and not cfg["optimizer"].get("fused"):
        found.append(Knob(("optimizer=adamw_fused",), True, "one fused kernel: no foreach temporaries"))
    if cfg["model"].get("attn_implementation") == "sdpa" and (card is None or card.compute_capability >= (8, 0)):
        found.append(Knob(("model.attn_implementation=flash_attention_2",), True, "needs the flash-attn package"))
    if "liger_kernel" in train and not train["liger_kernel"]:
        found.append(Knob(("train.liger_kernel=true",), True, "needs Liger-Kernel; its fused kernels' numerics"))
    if not train["freeze_vision"]:
        found.append(Knob(("train.freeze_vision=true",), False, "the vision tower no longer trains"))
    if not train["lora_r"]:
        found.append(Knob(("train.lora_r=16",), False, "LoRA adapters (r 16) train in place of the whole model"))
    half = "bfloat16" if card is None or card.bf16 else "float16"
    if train["param_dtype"] == "float32":
        found.append(Knob((f"train.param_dtype={half}", "train.autocast_dtype=null"), False,
                          f"{half} weights, gradients and optimizer state (no float32 master copy)"))
    if "AdamW" in target and "8bit" not in target:
        found.append(Knob(("optimizer=adamw_8bit",), False, "8-bit AdamW state (bitsandbytes)"))
        found.append(Knob(("optimizer=adafactor",), False, "Adafactor: factored second moments, no first moment"))
    if train["lora_r"] and not train.get("quantization"):
        dtype = half if train["param_dtype"] == "float32" else train["param_dtype"]
        found.append(Knob(("train.quantization=nf4", f"train.quantization_compute_dtype={dtype}"), False,
                          "QLoRA: a 4-bit frozen base (bitsandbytes)"))
    found += engine_knobs(cfg["dist"], train["grad_accum_steps"])
    side = inputs.get("image_size")
    if side and side >= 112:
        smaller = max(56, side * 3 // 4 // 28 * 28)
        found.append(Knob((f"data.image_size={smaller}",), False, f"images of {smaller} px a side, not {side}"))
    return found


SHARDING = {"ddp": ("zero2", "zero3", "fsdp2"), "zero1": ("zero2", "zero3"), "zero2": ("zero3",)}  # engine -> the
# engines that shard more of the same training state (ZeRO-2: gradients too; ZeRO-3 and FSDP2: the weights too)
SHARDED = ("zero1", "zero2", "zero3", "fsdp2", "fsdp2_bf16")  # engines whose per-rank memory falls with more ranks


def engine_knobs(dist: dict, accum: int) -> list[Knob]:
    """With dist= set: engines that shard more, the host offload the engine offers, and twice the GPUs (the same
    effective batch where the accumulation halves). A person's own DeepSpeed JSON keeps its engine."""
    name, world, found = dist["name"], dist.get("world_size"), []
    if name == "none":
        return found
    if not dist.get("deepspeed_config"):
        found += [Knob((f"dist={other}", f"dist.world_size={world}"), True,
                       f"{other} shards more of the state across the {world} GPUs (more communication)", "engine")
                  for other in SHARDING.get(name, ())]
    if name in ("zero2", "zero3") and dist.get("offload_optimizer") == "none":
        found.append(Knob(("dist.offload_optimizer=cpu",), True, "optimizer state and step on the host (host memory, "
                                                                  "slower step)"))
    if name == "zero3" and dist.get("offload_param") == "none":
        found.append(Knob(("dist.offload_param=cpu",), True, "weights on the host between uses (host memory, slower)"))
    if name in SHARDED:
        if accum % 2 == 0:
            found.append(Knob((f"dist.world_size={2 * world}", f"train.grad_accum_steps={accum // 2}"), True,
                              f"{2 * world} GPUs at the same effective batch (half the accumulation)"))
        else:
            found.append(Knob((f"dist.world_size={2 * world}",), False,
                              f"{2 * world} GPUs: twice the effective batch"))
    return found


class Advisor:
    """+advise=fit for the point of the command line (module doc)."""

    def __init__(self, compose, overrides: list[str], base: dict):
        if base["sweep"]["axes"] or base["sweep"].get("cases"):
            raise ConfigError("+advise=fit is not allowed with a sweep: it advises on one point; drop +sweep= and "
                              "the axes, and give the point on the command line")
        if base["find"]:
            raise ConfigError("+advise=fit is not allowed with +find=max_batch: run one, then the other")
        if base["measure"]["backend"] == "cuda":
            raise ConfigError("+advise=fit is not allowed with measure.backend=cuda: it runs every knob without a "
                              "capacity, which a card cannot; use measure.backend=estimate")
        card = device_profile.from_config(base["device"])
        imposed = base["measure"]["device_memory"]
        self.capacity = parse_bytes(imposed, "measure.device_memory") if imposed not in (None, UNBOUNDED) else (
            card.total_memory if card else None)
        if self.capacity is None:
            raise ConfigError("device=none is not allowed with +advise=fit: name the card (device=rtx4090, ...) or "
                              "its memory (measure.device_memory=24GiB)")
        self.margin = margin_bytes(base["advise"].get("margin"), self.capacity, "advise.margin")
        self.usable = self.capacity - self.margin
        self.card = card
        backend = ["measure.backend=estimate"] if base["measure"]["backend"] == "auto" else []
        self.composer = Composer(compose, [*overrides, *backend, f"measure.device_memory={UNBOUNDED}"])
        self.base = plan_point(self.composer, Point(0, {}))
        weights = self.base.inputs["params"] // 2  # every weight in 4 bits: the least any knob here leaves
        if weights > self.usable:
            raise ConfigError(f"+advise=fit is not allowed here: {self.base.inputs['params']:,} parameters take "
                              f"{weights / GiB:.2f} GiB even in 4 bits, more than the {self.usable / GiB:.2f} GiB "
                              f"usable ({self.capacity / GiB:.2f} GiB less the margin); no knob makes it fit")
        self.knobs, self.left_out, self.planned = [], [], [self.base]
        for knob in knobs(self.base.config, self.base.inputs, card):
            try:
                self.planned.append(self.plan(knob.overrides, len(self.planned)))
                self.knobs.append(knob)
            except ConfigError as exc:
                self.left_out.append((knob, str(exc)))
        self.rows: dict[str, dict] = {}
        self.combined: list[tuple[Knob, dict]] = []

    @property
    def keys(self) -> list[str]:
        """The config keys the knobs set: the results table's columns beside the inputs."""
        return sorted({o.split("=", 1)[0] for knob in self.knobs for o in knob.overrides})

    def plan(self, overrides: tuple[str, ...], index: int) -> PlannedPoint:
        return plan_point(self.composer, Point(index, dict(o.split("=", 1) for o in overrides)))

    def fits(self, row: dict) -> bool:
        need = shown(row)
        return row["status"] == Status.OK and need is not None and need <= self.usable

    def run(self, runner, run_sweep) -> None:
        """Your point and each knob (`run_sweep(planned, runner)`), then the same-training knobs combined."""
        run_sweep(self.planned, runner)
        self.rows = {p.point.id: runner.done[p.point.id] for p in self.planned}
        if self.fits(self.row(self.base)):
            return
        saving = {k: self.saving(k) for k in self.knobs}
        chosen: list[str] = []
        groups: set[str] = set()
        for knob in sorted((k for k in self.knobs if k.same_training and (saving[k] or 0) > 0),
                           key=lambda k: -saving[k]):
            if knob.group and knob.group in groups:  # another engine is already in: the better one
                continue
            groups.add(knob.group)
            chosen += knob.overrides
            row = runner.run(self.plan(tuple(chosen), len(self.planned) + len(self.combined)))
            self.combined.append((knob, row))
            if self.fits(row):
                return

    def row(self, planned: PlannedPoint) -> dict:
        return self.rows[planned.point.id]

    def knob_row(self, knob: Knob) -> dict:
        return self.rows[",".join(knob.overrides)]  # its point's id (Point.id)

    def saving(self, knob: Knob) -> int | None:
        base, row = shown(self.row(self.base)), shown(self.knob_row(knob))
        return base - row if base is not None and row is not None else None

    def table(self) -> pd.DataFrame:
        """One line per knob (yours first), ranked by saving."""
        base = self.row(self.base)
        lines = [{"knob": "(your point)", "saves_bytes": None, "card_bytes": shown(base), "fits": self.fits(base),
                  "training": "-", "cost": "-"}]
        ranked = sorted(self.knobs, key=lambda k: -(self.saving(k) or -2**62))
        for knob in ranked:
            row = self.knob_row(knob)
            lines.append({"knob": knob.name, "saves_bytes": self.saving(knob), "card_bytes": shown(row),
                          "fits": self.fits(row), "training": "same" if knob.same_training else "changes",
                          "cost": knob.cost if row["status"] == Status.OK else f"{row['status']}: {knob.cost}"})
        return pd.DataFrame(lines)

    def conclusion(self) -> str:
        """The smallest same-training set found that fits, or that none does and what came closest."""
        room = f"{self.usable / GiB:.2f} GiB usable of {self.capacity / GiB:.2f} ({self.margin / GiB:.2f} GiB kept free)"
        if self.fits(self.row(self.base)):
            return f"advise: your point fits as it is: {gib(shown(self.row(self.base)))} GiB on the card, {room}"
        if self.combined and self.fits(self.combined[-1][1]):
            names = " + ".join(k.name for k, _ in self.combined)
            return (f"advise: fits with the same training: {names} -> {gib(shown(self.combined[-1][1]))} GiB on the "
                    f"card, {room}")
        closest = min((shown(r) for _, r in self.combined if shown(r) is not None), default=None)
        changes = [k.name for k in self.knobs if not k.same_training and self.fits(self.knob_row(k))]
        tail = f"; alone, these fit but change the training: {', '.join(changes)}" if changes else ""
        near = f" (closest: all of them, {gib(closest)} GiB)" if closest is not None else ""
        return f"advise: no set of same-training knobs fits {room}{near}{tail}"

    def report(self, out_dir: Path) -> list[str]:
        """advise.csv, a summary.md section, and the lines for stdout."""
        table = self.table()
        table.to_csv(out_dir / "advise.csv", index=False)
        shown_table = table.assign(saves_GiB=table["saves_bytes"].map(gib), card_GiB=table["card_bytes"].map(gib),
                                   fits=table["fits"].map({True: "yes", False: "no"}))
        shown_table = shown_table[["knob", "saves_GiB", "card_GiB", "fits", "training", "cost"]]
        card = f"the {self.card.name}" if self.card else "the capacity given"
        head = (f"vlmprobe: +advise=fit on {card} (estimate; GiB = 2^30 B; card_GiB: what the card would show, peak "
                f"reserved + CUDA context)")
        grid = [list(shown_table.columns)] + shown_table.astype(str).values.tolist()
        widths = [max(len(line[i]) for line in grid) for i in range(len(grid[0]))]
        text = ["  ".join(c.rjust(w) if i in (1, 2) else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
                for line in grid]
        lines = [head, *text, ""]
        lines += [f"left out: {k.name}: {why}" for k, why in self.left_out]
        if self.combined:
            lines += [f"combined: {' + '.join(k.name for k, _ in self.combined[:i + 1])} -> {gib(shown(r))} GiB"
                      for i, (_, r) in enumerate(self.combined)]
        lines.append(self.conclusion())
        with (out_dir / "summary.md").open("a") as f:
            f.write("\n## +advise=fit\n\n" + shown_table.to_markdown(index=False) + "\n\n" + lines[-1] + "\n")
        return lines

