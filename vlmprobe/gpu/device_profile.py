"""The target GPU of a point (`device=`, conf/device/<profile>.yaml): what the card reports and what runs on it.

A profile is data (each file cites its sources): the name and total memory torch reports, compute capability,
bfloat16, SDPA kernels, the cuBLAS workspace and the CUDA context where a figure is known. `build` turns a
profile's config into a DeviceProfile, refusing a bad value in one line; `device=none` (the default) is no
profile. The card's total memory is the point's capacity (a smaller measure.device_memory wins, a larger one is
refused); bfloat16 below sm80 is refused; the profile decides SDPA's kernels, predicted_device_bytes, and the
cuBLAS workspaces and reduction staging buffers charged on estimate and cpu (none without one; docs/gpu.md).
Pure: no CUDA. vlmprobe.backends.cuda reads the real card and calls name_note.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.utils import instantiate
from omegaconf import OmegaConf

from vlmprobe.errors import ConfigError, refused
from vlmprobe.paths import CONF
from vlmprobe.sizes import GiB, parse_bytes

__all__ = ["ASSUMED_CONTEXT_BYTES", "UNBOUNDED", "build", "capacity", "check", "context_bytes", "context_note", "DeviceProfile",
           "from_config", "key_of_card", "load", "name_note", "predicted_device_bytes", "workspace_blocks"]

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


@dataclass(frozen=True)
class DeviceProfile:
    key: str  # the config option (conf/device/<key>.yaml); the row's `device` column
    name: str  # torch.cuda.get_device_name() on the card
    total_memory: int  # bytes, torch.cuda.get_device_properties(0).total_memory
    compute_capability: tuple[int, int]  # (major, minor): sm86 is (8, 6)
    multiprocessors: int  # torch.cuda.get_device_properties(0).multi_processor_count (SMs)
    max_threads_per_multiprocessor: int  # its max_threads_per_multi_processor (resident threads an SM holds)
    bf16: bool  # native bfloat16 (sm80+)
    sdpa: dict  # flash, efficient, cudnn, math: whether each SDPA kernel runs there; default: the one torch tries first
    cublas_workspace_bytes: int  # bytes of one cuBLAS workspace (per handle and stream), from the caching allocator
    cublaslt_workspace_bytes: int  # bytes a cuBLASLt workspace adds to it (0 where Lt reuses the cuBLAS one)
    cuda_context_bytes: int | None  # bytes of the CUDA context outside the allocator; None where not known

    def describe(self) -> str:
        major, minor = self.compute_capability
        return f"{self.key} ({self.name}, {self.total_memory / GiB:.2f} GiB, sm{major}{minor})"


def _bytes(key: str, value, allow_none: bool = False, allow_zero: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if allow_zero and value == 0 and not isinstance(value, bool):
        return 0
    if value is None:
        raise ConfigError(f"device.{key}=null is not allowed: give bytes or a size like 24GiB")
    return parse_bytes(value, f"device.{key}")


def _capability(value) -> tuple[int, int]:
    text = str(value)
    major, dot, minor = text.partition(".")
    if isinstance(value, bool) or not dot or not major.isdigit() or not minor.isdigit():
        raise ConfigError(f"device.compute_capability={value!r} is not allowed: give major.minor as torch reports "
                          f"it (torch.cuda.get_device_capability), e.g. 8.6")
    return int(major), int(minor)


def _sdpa(value) -> dict:
    if not isinstance(value, dict) or set(value) != {*SDPA_BACKENDS, "default"}:
        raise ConfigError(f"device.sdpa={value!r} is not allowed: give {', '.join(SDPA_BACKENDS)} (true or false) "
                          f"and default (the kernel torch tries first)")
    for kernel in SDPA_BACKENDS:
        if not isinstance(value[kernel], bool):
            raise ConfigError(f"device.sdpa.{kernel}={value[kernel]!r} is not allowed: use true or false")
    if not value["math"]:
        raise ConfigError("device.sdpa.math=false is not allowed: the math kernel runs on every CUDA card")
    if value["default"] not in SDPA_BACKENDS or not value[value["default"]]:
        runs = [k for k in SDPA_BACKENDS if value[k]]
        raise ConfigError(f"device.sdpa.default={value['default']!r} is not allowed: use one of the kernels that run "
                          f"there ({', '.join(runs)})")
    return dict(value)


def _count(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"device.{key}={value!r} is not allowed: give a whole number of at least 1, as "
                          f"torch.cuda.get_device_properties(0) reports it")
    return value


def build(profile=None, name=None, total_memory=None, compute_capability=None, multiprocessors=None,
          max_threads_per_multiprocessor=None, bf16=None, sdpa=None, cublas_workspace_bytes=None,
          cublaslt_workspace_bytes=None, cuda_context_bytes=None) -> DeviceProfile | None:
    """The `_target_` of conf/device/*.yaml: a DeviceProfile, or None for `profile: null` (device=none)."""
    if profile is None:
        return None
    if not isinstance(profile, str) or not profile.strip():
        raise ConfigError(f"device.profile={profile!r} is not allowed: give the profile's name (its file's name)")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"device.name={name!r} is not allowed: give the name torch.cuda.get_device_name() reports")
    if not isinstance(bf16, bool):
        raise ConfigError(f"device.bf16={bf16!r} is not allowed: use true or false")
    return DeviceProfile(
        key=profile, name=name.strip(), total_memory=_bytes("total_memory", total_memory),
        compute_capability=_capability(compute_capability), multiprocessors=_count("multiprocessors", multiprocessors),
        max_threads_per_multiprocessor=_count("max_threads_per_multiprocessor", max_threads_per_multiprocessor),
        bf16=bf16, sdpa=_sdpa(sdpa),
        cublas_workspace_bytes=_bytes("cublas_workspace_bytes", cublas_workspace_bytes),
        cublaslt_workspace_bytes=_bytes("cublaslt_workspace_bytes", cublaslt_workspace_bytes, allow_zero=True),
        cuda_context_bytes=_bytes("cuda_context_bytes", cuda_context_bytes, allow_none=True))


def from_config(cfg: dict | None) -> DeviceProfile | None:
    """The profile of a point's composed `device` node (plain data), built through its `_target_`; a value the
    builder refuses is its one line, anything else (a key the builder does not take) quotes Hydra."""
    if cfg is None:
        return None
    try:
        return instantiate(cfg, _convert_="all")
    except Exception as exc:  # Hydra's InstantiationException wraps the builder's own refusal
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            raise cause from None
        raise refused(f"device={cfg.get('profile')}", f"{cfg.get('_target_')}", cause) from None


def load(key: str) -> DeviceProfile:
    """conf/device/<key>.yaml as a DeviceProfile (for code that names a card, e.g. the finding check)."""
    return from_config(OmegaConf.to_container(OmegaConf.load(CONF / "device" / f"{key}.yaml"), resolve=True))


def key_of_card(name: str) -> str | None:
    """The profile (conf/device/<key>.yaml) of the card torch names `name`, or None where no profile is that card's:
    what a CUDA run that named no profile ran on, for an estimate of the same card."""
    for path in sorted((CONF / "device").glob("*.yaml")):
        profile = load(path.stem)
        if profile is not None and names_match(name, profile.name):
            return profile.key
    return None


def check(device_memory: int | None, train: dict, dist: dict, attention: str, profile: DeviceProfile | None) -> None:
    """What a point asks of its target card, refused in one line before any heavy work: a capacity above the
    card's, flash_attention_2 or bfloat16 on a card without them. `device_memory`: measure.device_memory in
    bytes; `attention`: model.attn_implementation."""
    if profile is None:
        return
    if isinstance(device_memory, int) and device_memory > profile.total_memory:
        raise ConfigError(f"measure.device_memory={device_memory} is not allowed with device={profile.key}: the "
                          f"{profile.name} has {profile.total_memory:,} B ({profile.total_memory / GiB:.2f} GiB); "
                          f"give at most that, or null to use the card's")
    major, minor = profile.compute_capability
    if attention == "flash_attention_2" and major < 8:  # flash_api.cpp: "FlashAttention only supports Ampere GPUs or newer."
        raise ConfigError(f"model.attn_implementation=flash_attention_2 is not allowed with device={profile.key}: "
                          f"FlashAttention 2 runs on sm80 and newer, the {profile.name} is sm{major}{minor}; use sdpa")
    if profile.bf16:
        return
    dtypes = {"train.param_dtype": train.get("param_dtype"), "train.autocast_dtype": train.get("autocast_dtype"),
              "dist.mp_param_dtype": dist.get("mp_param_dtype"), "dist.mp_reduce_dtype": dist.get("mp_reduce_dtype")}
    for key, dtype in dtypes.items():
        if dtype == "bfloat16":
            raise ConfigError(f"{key}=bfloat16 is not allowed with device={profile.key}: the {profile.name} (sm{major}"
                              f"{minor}) has no bfloat16 kernels (they need sm80+); use float16 or float32")


UNBOUNDED = "unbounded"  # measure.device_memory: no capacity (estimate, cpu), the card's kernels still its own


def capacity(device_memory: int | str | None, profile: DeviceProfile | None) -> int | None:
    """The device bytes a point may use: measure.device_memory where set (a smaller card imposed on this one;
    "unbounded": none), else the card's total_memory, else none (unbounded)."""
    if device_memory == UNBOUNDED:
        return None
    if device_memory is not None:
        return device_memory
    return profile.total_memory if profile is not None else None


def names_match(real: str, expected: str) -> bool:
    """Whether torch's name for the card is the profile's. Older drivers name cards without the vendor
    ("GeForce RTX 3090", "A100-PCIE-40GB"), so a leading "NVIDIA" is not compared; case and spacing neither."""
    def norm(name: str) -> str:
        words = name.lower().split()
        return " ".join(words[1:] if words[:1] == ["nvidia"] else words)

    return norm(real) == norm(expected)


def name_note(real: str, profile: DeviceProfile | None) -> str | None:
    """The row's note when a CUDA worker ran on another card than its profile's; None when they agree."""
    if profile is None or names_match(real, profile.name):
        return None
    return (f"device={profile.key} is the {profile.name}, but this ran on the {real}: the figures are that card's "
            f"(its kernels, workspaces and context), with the profile's capacity imposed where the card is larger")


def workspace_blocks(profile: DeviceProfile | None) -> tuple[int, ...]:
    """The caching-allocator blocks (bytes) a thread's first matrix multiply on this card makes: its cuBLAS
    workspace, and a cuBLASLt one where the profile says Lt keeps its own. None without a profile."""
    if profile is None:
        return ()
    return (profile.cublas_workspace_bytes,) + ((profile.cublaslt_workspace_bytes,)
                                                 if profile.cublaslt_workspace_bytes else ())


# The CUDA context taken for a card whose profile does not know its own: the one vlmprobe measured on an H100 80GB
# HBM3 and an H200 (conf/device/h100_80gb.yaml: torch 2.11.0+cu130, driver 580). Cards with fewer SMs or an older
# CUDA hold less (a bare context on an RTX 3090: 256 MiB), so the prediction errs on the side of not fitting.
ASSUMED_CONTEXT_BYTES = 796_917_760


def context_bytes(profile: DeviceProfile) -> int:
    """The card's CUDA context: its profile's, else ASSUMED_CONTEXT_BYTES (context_note says so on the row)."""
    return profile.cuda_context_bytes if profile.cuda_context_bytes is not None else ASSUMED_CONTEXT_BYTES


def context_note(profile: DeviceProfile | None) -> str | None:
    """The row's note where predicted_device_bytes took the assumed context; None where the profile has its own."""
    if profile is None or profile.cuda_context_bytes is not None:
        return None
    return (f"predicted_device_bytes assumes a CUDA context of {ASSUMED_CONTEXT_BYTES / 2**20:.0f} MiB (measured on an "
            f"H100 and an H200, torch 2.11 / CUDA 13); the {profile.name}'s is not known: set "
            f"device.cuda_context_bytes (a cuda row's nvml_process_bytes - peak_reserved_bytes)")


def predicted_device_bytes(peak_reserved: int | None, profile: DeviceProfile | None) -> int | None:
    """What the card would show in use at the peak (nvidia-smi's figure for the process): the allocator model's
    peak reserved bytes (the cuBLAS workspaces are blocks of it) and the CUDA context (outside the allocator; the
    assumed one where the profile has none). None without a profile."""
    if profile is None or peak_reserved is None:
        return None
    return peak_reserved + context_bytes(profile)
