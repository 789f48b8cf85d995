"""A synthetic dataset for planning: lengths and image sizes drawn from stated distributions with a seed.

Form: a dict, or `synthetic:` followed by the same dict as JSON, e.g.
`synthetic:{"samples": 1000, "seed": 0, "text_tokens": {"lognormal": {"mean": 6.0, "sigma": 0.6}},
"images_per_sample": 1, "image_height": {"uniform": [336, 1344]}, "image_width": {"choice": [448, 896]}}`.
A distribution is an integer (constant), {"constant": n}, {"uniform": [low, high]} (integers, both ends included),
{"choice": [values]} (each equally likely) or {"lognormal": {"mean": m, "sigma": s}} (exp of a normal with that
mean and sigma, numpy's convention, rounded to the nearest integer). Draws come from numpy's default_rng(seed)
(PCG64) in a fixed order: per sample its text tokens, its image count, then each image's height and width; the
same config gives the same samples. Drawn sides below 1 px become 1, counts below 0 become 0.
"""

from __future__ import annotations

import json

import numpy as np

from vlmprobe.dataset.shapes import Sample
from vlmprobe.errors import ConfigError, whole

__all__ = ["DISTRIBUTIONS", "SYNTHETIC_PREFIX", "synthetic_samples"]

SYNTHETIC_PREFIX = "synthetic:"
DISTRIBUTIONS = ("constant", "uniform", "choice", "lognormal")
KEYS = ("samples", "seed", "text_tokens", "images_per_sample", "image_height", "image_width")


def synthetic_samples(config) -> list[Sample]:
    if isinstance(config, str):
        try:
            config = json.loads(config[len(SYNTHETIC_PREFIX):])
        except ValueError as exc:
            raise ConfigError(f"dataset {config!r} is not allowed: after synthetic: give a JSON object ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"dataset synthetic {config!r} is not allowed: give an object with {', '.join(KEYS)}")
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise ConfigError(f"synthetic.{unknown[0]} is not allowed: the keys are {', '.join(KEYS)}")
    count, seed = config.get("samples"), config.get("seed", 0)
    if not whole(count) or count < 1:
        raise ConfigError(f"synthetic.samples={count!r} is not allowed: it must be an integer >= 1")
    if not whole(seed) or seed < 0:
        raise ConfigError(f"synthetic.seed={seed!r} is not allowed: it must be an integer >= 0")
    if "text_tokens" not in config:
        raise ConfigError("synthetic.text_tokens is missing: a sample needs length information (a distribution)")
    text = distribution(config["text_tokens"], "text_tokens")
    per_sample = distribution(config.get("images_per_sample", 1), "images_per_sample")
    sides = None
    if config.get("images_per_sample", 1) != 0:
        missing = [k for k in ("image_height", "image_width") if k not in config]
        if missing:
            raise ConfigError(f"synthetic.{missing[0]} is missing: give a distribution, or images_per_sample=0")
        sides = distribution(config["image_height"], "image_height"), distribution(config["image_width"], "image_width")
    rng = np.random.default_rng(seed)
    samples = []
    for index in range(count):
        tokens = max(0, text(rng))
        n = max(0, per_sample(rng))
        images = tuple((max(1, sides[0](rng)), max(1, sides[1](rng))) for _ in range(n)) if sides else ()
        samples.append(Sample(index=index, text_tokens=tokens, images=images,
                              text_from=f"synthetic (seed {seed})"))
    return samples


def distribution(spec, key: str):
    """A draw function rng -> int for one distribution spec; ConfigError naming the key otherwise."""
    allowed = ("an integer, or one of {constant: n}, {uniform: [low, high]}, {choice: [values]}, "
               "{lognormal: {mean: m, sigma: s}}")
    if whole(spec):
        return lambda rng: spec
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise ConfigError(f"synthetic.{key}={spec!r} is not allowed: give {allowed}")
    kind, value = next(iter(spec.items()))
    if kind == "constant" and whole(value):
        return lambda rng: value
    if kind == "uniform" and isinstance(value, list) and len(value) == 2 and all(map(whole, value)) \
            and value[0] <= value[1]:
        return lambda rng: int(rng.integers(value[0], value[1], endpoint=True))
    if kind == "choice" and isinstance(value, list) and value and all(map(whole, value)):
        return lambda rng: int(value[rng.integers(len(value))])
    if kind == "lognormal" and isinstance(value, dict) and set(value) == {"mean", "sigma"} \
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()) \
            and value["sigma"] >= 0:
        return lambda rng: int(round(float(rng.lognormal(value["mean"], value["sigma"]))))
    raise ConfigError(f"synthetic.{key}={spec!r} is not allowed: give {allowed} (uniform: low <= high; lognormal: "
                      f"sigma >= 0)")
