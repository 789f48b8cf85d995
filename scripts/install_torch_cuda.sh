#!/usr/bin/env bash
# Install the torch CUDA wheel that the NVIDIA driver of this machine can run, then check that CUDA works.
# A driver runs CUDA builds up to the version nvidia-smi reports ("CUDA Version"); PyPI's default torch wheel
# is built for one CUDA version, which an older driver refuses at the first CUDA call. So: the newest build
# in TORCH_CUDA_BUILDS that the driver supports, from PyTorch's index for it.
#   TORCH_SPEC          the torch requirement (default: the project's range, "torch>=2.11,<2.14")
#   TORCH_CUDA_BUILDS   CUDA builds to choose from, newest first (default "13.0 12.8 12.6")
set -euo pipefail
TORCH_SPEC=${TORCH_SPEC:-"torch>=2.11,<2.14"}
BUILDS=${TORCH_CUDA_BUILDS:-"13.0 12.8 12.6"}

supported=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}' || true)
if [ -z "$supported" ]; then
  echo "install_torch_cuda: nvidia-smi reports no driver here: no CUDA build can run (is this a GPU machine?)" >&2
  exit 1
fi
choice=""
for build in $BUILDS; do
  if [ "$(printf '%s\n%s\n' "$build" "$supported" | sort -V | head -n 1)" = "$build" ]; then
    choice=$build
    break
  fi
done
if [ -z "$choice" ]; then
  echo "install_torch_cuda: the driver supports CUDA $supported, older than every build in '$BUILDS': update the driver" >&2
  exit 1
fi
tag="cu${choice//./}"
echo "install_torch_cuda: driver supports CUDA $supported; installing $TORCH_SPEC for CUDA $choice ($tag)" >&2
python -m pip install "$TORCH_SPEC" --index-url "https://download.pytorch.org/whl/$tag"
python "$(dirname "$0")/cuda_usable.py"
