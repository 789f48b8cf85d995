#!/usr/bin/env python
"""Exit 0 when torch can use a CUDA GPU here (printing the device); otherwise one line that says why, exit 1.

"No GPU" and "a GPU torch cannot use" are different failures with different fixes: a CPU wheel, a CUDA
wheel newer than the driver (scripts/install_torch_cuda.sh picks one the driver runs), or no device at all.
"""

import subprocess
import sys

import torch

from vlmprobe.backends.cuda import unusable_reason


def driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else "none found"
    except (OSError, subprocess.TimeoutExpired):
        return "none found (no nvidia-smi)"


def main() -> int:
    reason = unusable_reason()
    if reason is not None:
        print(f"CUDA is not usable: {reason}; NVIDIA driver {driver()}", file=sys.stderr)
        return 1
    print(f"CUDA usable: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"driver {driver()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
