#!/usr/bin/env bash
# Installs the Debian packages epmoe builds and tests with (cmake, ninja, g++, Open MPI,
# GoogleTest, libtorch, matplotlib). The CUDA 13 toolkit (with NCCL) is expected at /usr/local/cuda where there is one;
# without it the build is CPU-only. Skips apt when everything is already there (e.g. the H200
# machines, which have no network).
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v mpirun >/dev/null || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi/include/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
  || command -v mpicxx >/dev/null || need+=(libopenmpi-dev)
[ -e /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
# libtorch for the torch bindings (torch/, tests label torch): Debian's torch 1.13 (CPU). Not on the
# H200 machines, which have their own torch in /opt/torch/.venv (and no network).
if [ ! -d /opt/torch/.venv ]; then
  [ -e /usr/lib/x86_64-linux-gnu/cmake/Torch/TorchConfig.cmake ] || need+=(libtorch-dev)
  # From /: the repo's own torch/ folder would import as an empty namespace package here.
  (cd / && /usr/bin/python3 -c 'import torch, sys; sys.exit(0 if torch.__file__ else 1)') 2>/dev/null || need+=(python3-torch)
  # The main job's plot (launch/plot_train.py) and the benchmarks' PNGs.
  /usr/bin/python3 -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)
fi
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "[setup_deps] installing: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" libopenmpi-dev >/dev/null
fi
echo "[setup_deps] ok: $(cmake --version | head -1), $(mpirun --version 2>&1 | head -1)"
